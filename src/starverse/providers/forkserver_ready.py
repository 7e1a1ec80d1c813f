"""Imported by the fork server only, last of its preload (see :func:`starverse.providers.local.rank_context`):
turns the garbage collector back on that :mod:`starverse.providers.forkserver_exit` turned off for the preload, and
freezes what the preload made, so that the ranks forked from the server never walk those objects again (nor touch
their pages: they stay shared with the server). Imported anywhere else it does nothing."""

from __future__ import annotations

import gc

from starverse.providers.forkserver_exit import in_fork_server

if in_fork_server():
    gc.enable()
    gc.freeze()
