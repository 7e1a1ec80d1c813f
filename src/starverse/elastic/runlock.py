"""One supervisor per run directory: an exclusive lock that names its holder.

Two supervisors on one run directory train beside each other: their checkpoints, retention and ledger
heartbeats interleave, and one deletes the checkpoint the other is about to load. The lock is an
``flock`` on ``RUN_DIR/supervisor.lock`` (the kernel drops it when the holder dies, even by SIGKILL, so
a crash never leaves a stale lock), and the file says who holds it: pid, host, start time and command.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from types import TracebackType

from starverse.errors import StarverseError
from starverse.filelock import try_flock

LOCK_FILE = "supervisor.lock"


class RunDirBusyError(StarverseError):
    """Another live supervisor holds the run directory."""

    def __init__(self, message: str, holder: dict[str, object]):
        super().__init__(message)
        self.holder = holder
        """What the lock file says about its holder (pid, host, started_at, command)."""


class RunLock:
    """``with RunLock(run_dir):`` -- hold the run directory for this process, or raise :class:`RunDirBusyError`."""

    def __init__(self, run_dir: str | Path):
        """Lock ``run_dir`` (created if missing)."""
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        """Take the lock now, or raise :class:`RunDirBusyError` naming the holder (never waits)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = try_flock(self.path, 0o644)
        if fd is None:
            holder = read_holder(self.path)
            who = (f"pid {holder.get('pid', '?')} on {holder.get('host', '?')} since "
                   f"{holder.get('started_at', '?')} ({holder.get('command', '?')})")
            raise RunDirBusyError(
                f"{self.path.parent}: run directory in use by another supervisor: {who}. To fix: wait for it to "
                f"end, stop it (`kill -TERM {holder.get('pid', 'PID')}`: it checkpoints and exits), or use another "
                "run_dir.", holder,
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({
            "pid": os.getpid(), "host": socket.gethostname(),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": " ".join(sys.argv)[:300],
        }).encode())
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        """Give the lock back (the file stays; its content is only meaningful while locked)."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


def read_holder(path: Path) -> dict[str, object]:
    """What a lock file says about its holder ({} if unreadable)."""
    try:
        data = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
