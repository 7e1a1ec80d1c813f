"""The process that runs one job: ``python -m starverse.service.runner JOB_DIR [RESUME_STEP]``.

It holds an exclusive lock on ``JOB_DIR/.lock`` for as long as it lives, so a job's files are never driven
by two processes at once (a worker that finds the lock taken knows the job still runs), and records each
launch in ``JOB_DIR/launches.jsonl``. It runs the job file the worker wrote (``launch.yaml``) with the
library's supervised training run (``starverse train``: checkpoints, preemption, re-plan, ledger, budgets),
its JSON outcome on stdout; SIGTERM (a stop, a drained balance, the worker going away) makes the job write
an emergency checkpoint and exit with code 3.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from pathlib import Path

LOCK_FILE = ".lock"
LAUNCHES_FILE = "launches.jsonl"
EXIT_LOCKED = 75
"""Exit code when another process already runs this job."""


def try_lock(path: Path) -> int | None:
    """An exclusive, non-blocking flock on ``path`` (its fd), or None if another process holds it."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def is_locked(path: Path) -> bool:
    """Whether a live process holds the lock on ``path``."""
    if not path.exists():
        return False
    fd = try_lock(path)
    if fd is None:
        return True
    os.close(fd)
    return False


def _record(job_dir: Path, entry: dict[str, object]) -> None:
    with (job_dir / LAUNCHES_FILE).open("a") as fh:
        fh.write(json.dumps(entry) + "\n")


def main(argv: list[str]) -> int:
    """Run the job in ``argv[0]`` (resuming from step ``argv[1]`` when given); returns the exit code."""
    from starverse.cli import main as cli_main
    from starverse.service.jobs import LAUNCH_FILE

    job_dir = Path(argv[0])
    fd = try_lock(job_dir / LOCK_FILE)
    if fd is None:
        return EXIT_LOCKED
    args = ["train", str(job_dir / LAUNCH_FILE), "--json"]
    if len(argv) > 1:
        args += ["--resume-from", argv[1]]
    _record(job_dir, {"pid": os.getpid(), "event": "start", "at": time.time(),
                      "resume_from": int(argv[1]) if len(argv) > 1 else None})
    rc = 1
    try:
        rc = cli_main(args)
    finally:
        sys.stdout.flush()
        _record(job_dir, {"pid": os.getpid(), "event": "end", "at": time.time(), "rc": rc})
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
