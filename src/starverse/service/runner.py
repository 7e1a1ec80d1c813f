"""The process that runs one job: ``python -m starverse.service.runner JOB_DIR [RESUME_STEP]``.

It holds an exclusive lock on ``JOB_DIR/.lock`` for as long as it lives, so a job's files are never driven
by two processes at once (a worker that finds the lock taken knows the job still runs), and records each
launch in ``JOB_DIR/launches.jsonl``. It runs the job file the worker wrote (``launch.yaml``) with the
library's :func:`starverse.jobs.prepare_job` / ``run`` (what ``starverse train`` runs: checkpoints,
preemption, re-plan, ledger, budgets), writes the outcome to ``result.json`` and logs to stderr (the job's
log); SIGTERM (a stop, a drained balance, the worker going away) makes the job write an emergency
checkpoint and exit with code 3.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

from starverse.filelock import try_flock

log = logging.getLogger("starverse.service.runner")
LOCK_FILE = ".lock"
LAUNCHES_FILE = "launches.jsonl"
EXIT_LOCKED = 75
"""Exit code when another process already runs this job."""


def is_locked(path: Path) -> bool:
    """Whether a live process holds the lock on ``path``."""
    if not path.exists():
        return False
    fd = try_flock(path)
    if fd is None:
        return True
    os.close(fd)
    return False


def _record(job_dir: Path, entry: dict[str, object]) -> None:
    with (job_dir / LAUNCHES_FILE).open("a") as fh:
        fh.write(json.dumps(entry) + "\n")


def main(argv: list[str]) -> int:
    """Run the job in ``argv[0]`` (resuming from step ``argv[1]`` when given, else from its latest checkpoint);
    returns the exit code: 0 done (possibly stopped early by its budget, see ``result.json``), 3 preempted as a
    whole (emergency checkpoint written), another error's ``exit_code`` for a user error, 1 for a bug."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    for noisy in ("starverse.runtime.cluster", "httpx", "torch"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    job_dir = Path(argv[0])
    fd = try_flock(job_dir / LOCK_FILE)
    if fd is None:
        return EXIT_LOCKED
    resume: int | str = int(argv[1]) if len(argv) > 1 else "latest"
    _record(job_dir, {"pid": os.getpid(), "event": "start", "at": time.time(),
                      "resume_from": resume if isinstance(resume, int) else None})
    rc = 1
    try:
        rc = _run(job_dir, resume)
    finally:
        _record(job_dir, {"pid": os.getpid(), "event": "end", "at": time.time(), "rc": rc})
    return rc


def _run(job_dir: Path, resume: int | str) -> int:
    from starverse.errors import StarverseError
    from starverse.jobs import JobProgress, prepare_job
    from starverse.service.jobs import LAUNCH_FILE, RESULT_FILE

    def progress(p: JobProgress) -> None:
        log.info("step %d/%d loss %s", p.step, p.max_steps, "-" if p.loss is None else f"{p.loss:.4f}")

    try:
        prepared = prepare_job(job_dir / LAUNCH_FILE, resume_from=resume)
        for line in prepared.summary_lines():
            log.info("  %s", line)
        result = prepared.run(progress)
    except StarverseError as e:
        log.error("error: %s", " ".join(str(e).split()))
        return e.exit_code
    tmp = job_dir / (RESULT_FILE + ".tmp")
    tmp.write_text(json.dumps(result.as_dict(), default=str))
    tmp.replace(job_dir / RESULT_FILE)
    if result.stop_reason:
        log.info("stopped early: %s", result.stop_reason)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
