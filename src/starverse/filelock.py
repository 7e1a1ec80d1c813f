"""Exclusive, non-blocking ``flock`` on a file: the one primitive behind the run-directory lock
(``elastic.runlock``), the service's job locks (``service.runner``) and its per-tenant storage lock
(``service.storage``). The kernel holds the lock for the open file descriptor and drops it when the holder
exits, even by SIGKILL, so no crash leaves a stale lock."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


def try_flock(path: Path, mode: int = 0o600) -> int | None:
    """Open ``path`` (created with ``mode`` if missing) and take an exclusive, non-blocking flock on it: the
    open fd (closing it releases the lock), or None if another process holds the lock."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, mode)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd
