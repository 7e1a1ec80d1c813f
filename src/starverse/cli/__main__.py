"""``python -m starverse.cli``: same as the ``starverse`` console script."""

from __future__ import annotations

import sys

from starverse.cli import main

sys.exit(main())
