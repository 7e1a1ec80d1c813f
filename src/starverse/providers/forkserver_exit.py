"""Imported by the fork server only (first of its preload, see :func:`starverse.providers.local.rank_context`):
once the server's launcher is gone the server ends with ``os._exit`` instead of a full interpreter shutdown.

The server exits when its launcher does (the end of its "alive" pipe). A normal shutdown of an interpreter holding
torch and transformers took 8 s on a loaded 2-core machine (load 16), and the server is the launcher's child: it
would outlive a killed launcher that long. The exit is registered with :mod:`atexit` (last, so it runs first in the
shutdown); ranks forked from the server never run it (a forked process ends in ``os._exit``).

The server also imports its preload (torch, transformers: hundreds of thousands of objects) with the garbage
collector off, which saved ~1.5 s of CPU of ~10; :mod:`starverse.providers.forkserver_ready`, the preload's last
module, turns it on again before any rank is forked. Imported anywhere else -- not from
``multiprocessing.forkserver.main`` -- this module does nothing.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
from pathlib import Path
from types import FrameType


def in_fork_server() -> bool:
    """Whether this import runs inside ``multiprocessing.forkserver.main`` (the server's preload)."""
    frame: FrameType | None = sys._getframe()
    while frame is not None:
        code = frame.f_code
        if code.co_name == "main" and Path(code.co_filename).parts[-2:] == ("multiprocessing", "forkserver.py"):
            return True
        frame = frame.f_back
    return False


if in_fork_server():
    atexit.register(os._exit, 0)
    gc.disable()
