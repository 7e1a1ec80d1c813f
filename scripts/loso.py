"""Leave-one-source-out check of the cost model: refit every fitted constant without each source of
data/validation and score that source with it. Prints one JSON object (``costmodel.fit.leave_one_source_out``).

Usage: .venv/bin/python scripts/loso.py [FOLDER ...]   (default: data/validation)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from starverse.catalog import load_catalog
from starverse.costmodel.fit import leave_one_source_out
from starverse.costmodel.validate import find_cases, load_case


def main(argv: list[str]) -> int:
    """Run the check over the given folders and print the JSON document."""
    folders = argv or [str(Path(__file__).resolve().parents[1] / "data" / "validation")]
    cases = [load_case(p) for p in find_cases(folders)]
    doc = leave_one_source_out(cases, load_catalog())
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
