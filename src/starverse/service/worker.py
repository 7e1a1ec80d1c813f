"""The worker: runs queued jobs in runner processes that outlive the request that submitted them.

``starverse serve`` starts one worker process (``python -m starverse.service.worker``). Each poll it:

1. **recovers** jobs left ``running`` by a worker that is gone (its lock file ``ROOT/workers/<id>.lock`` is
   free) once their runner is gone too (the job's own lock is free): they go back to the queue and their
   next launch resumes from their latest checkpoint (the runner's default);
2. **reaps** finished runners: exit 0 is ``succeeded`` (``stopped`` when the ledger's budget stopped it
   early), 3 is ``stopped`` (emergency checkpoint), anything else ``failed``;
3. **stops** runners whose job was asked to stop, or whose tenant's prepaid balance reached zero (SIGTERM:
   the job writes an emergency checkpoint);
4. **samples** running jobs' progress (``progress.json`` and the job's Prometheus endpoint) into the
   database, for the live charts;
5. **claims** queued jobs while it has free slots, each with one conditional UPDATE (``state='queued'`` ->
   ``'running'``): a job is claimed by exactly one worker, and its runner's lock keeps it from running twice
   even across restarts.

Runners get SIGTERM when the worker dies (``PR_SET_PDEATHSIG``), so a killed server leaves checkpoints,
not orphans.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, TextIO

import yaml
from sqlalchemy import select, update

from starverse.filelock import try_flock
from starverse.service.db import Database, Job, JobSample, JobState, Tenant
from starverse.service.jobs import LAUNCH_FILE, LOG_FILE, RESULT_FILE, RUN_DIR, job_dir
from starverse.service.runner import EXIT_LOCKED, LOCK_FILE, is_locked
from starverse.service.settings import ServiceSettings
from starverse.service.tenants import balance

log = logging.getLogger(__name__)
WORKERS_DIR = "workers"
_PR_SET_PDEATHSIG = 1


def _die_with_parent(sig: int) -> None:
    """In a child before exec: receive ``sig`` when the parent dies (Linux)."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)


def _term_with_parent() -> None:
    os.setsid()
    _die_with_parent(signal.SIGTERM)


@dataclass
class Running:
    """A runner this worker started."""

    job_id: str
    tenant_id: str
    proc: subprocess.Popen[bytes]
    folder: Path
    files: list[TextIO | Any] = field(default_factory=list)
    last_step: int = -1
    stop_reason: str | None = None


def worker_lock(settings: ServiceSettings, worker_id: str) -> Path:
    """The lock file a live worker holds."""
    return settings.root / WORKERS_DIR / f"{worker_id}.lock"


class Worker:
    """The worker loop (see the module docstring)."""

    def __init__(self, settings: ServiceSettings, db: Database | None = None):
        self.settings = settings
        self.db = db or Database(settings.url)
        self.id = uuid.uuid4().hex
        self.running: dict[str, Running] = {}
        self._stop = False
        self._lock_fd: int | None = None
        self._last_balance_check = 0.0

    # -- life cycle -------------------------------------------------------------------------------------
    def start(self) -> None:
        """Take this worker's lock (its liveness for other workers)."""
        path = worker_lock(self.settings, self.id)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock_fd = try_flock(path)

    def request_stop(self, *_: object) -> None:
        """Stop claiming; running jobs get SIGTERM (emergency checkpoint) and are resumed by the next worker."""
        self._stop = True

    def run_forever(self) -> None:
        """Poll until asked to stop; then stop the runners and wait for their checkpoints."""
        self.start()
        while not self._stop:
            try:
                self.poll_once()
            except Exception:
                # a bug or a database hiccup must not take the worker (and every running job) down
                log.exception("worker poll failed; retrying")
            time.sleep(self.settings.poll_s)
        for r in self.running.values():
            _signal(r.proc, signal.SIGTERM)
        for r in self.running.values():
            try:
                r.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                _signal(r.proc, signal.SIGKILL)
        # the jobs stay 'running' under this worker's id: the next worker finds this lock free and resumes them

    def poll_once(self) -> None:
        """One round of recover, reap, stop, sample, claim."""
        self.recover()
        self.reap()
        self.enforce_stops()
        for r in list(self.running.values()):
            self.sample(r)
        self.claim()

    # -- 1. recover -------------------------------------------------------------------------------------
    def recover(self) -> int:
        """Requeue jobs of dead workers whose runner has exited; returns how many."""
        n = 0
        with self.db.session() as s:
            stale = s.scalars(select(Job).where(Job.state == JobState.RUNNING.value,
                                                Job.worker_id != self.id)).all()
            for job in stale:
                if job.worker_id and is_locked(worker_lock(self.settings, job.worker_id)):
                    continue  # its worker is alive
                if is_locked(job_dir(self.settings, job) / LOCK_FILE):
                    continue  # its runner is still writing its emergency checkpoint
                res = s.execute(update(Job).where(Job.id == job.id, Job.state == JobState.RUNNING.value,
                                                  Job.worker_id == job.worker_id)
                                .values(state=JobState.QUEUED.value, worker_id=None, pid=None,
                                        updated_at=time.time()))
                if res.rowcount == 1:  # type: ignore[attr-defined]
                    self.db.add_event(s, job.id, "recovered",
                                      f"worker {str(job.worker_id)[:8]} is gone; requeued to resume from its "
                                      "latest checkpoint")
                    n += 1
        return n

    # -- 2. reap ----------------------------------------------------------------------------------------
    def reap(self) -> None:
        """Record the outcome of runners that exited."""
        for job_id, r in list(self.running.items()):
            rc = r.proc.poll()
            if rc is None:
                continue
            for f in r.files:
                f.close()
            del self.running[job_id]
            self.sample(r)
            if rc == EXIT_LOCKED:  # another runner holds the job's folder: it is not ours to run
                with self.db.session() as s:
                    s.execute(update(Job).where(Job.id == job_id, Job.worker_id == self.id).values(
                        state=JobState.QUEUED.value, worker_id=None, pid=None, updated_at=time.time()))
                    self.db.add_event(s, job_id, "requeued", "another runner still held the job's folder")
                continue
            result = _read_json(r.folder / RESULT_FILE)
            stop = (result or {}).get("stop_reason")
            if rc == 0 and isinstance(stop, str) and stop.startswith("budget"):
                state, reason = JobState.STOPPED, r.stop_reason or f"balance exhausted ({stop})"
            elif rc == 0:
                state, reason = JobState.SUCCEEDED, None
            elif rc == 3:
                state, reason = JobState.STOPPED, r.stop_reason or "preempted: emergency checkpoint written"
            elif rc == -signal.SIGTERM and r.stop_reason is not None:
                # stopped before the training loop could write a checkpoint: the earlier ones stand
                state, reason = JobState.STOPPED, r.stop_reason.split(":")[0] + " before it started training"
            else:
                state, reason = JobState.FAILED, _last_error(r.folder / LOG_FILE) or f"exit code {rc}"
            with self.db.session() as s:
                s.execute(update(Job).where(Job.id == job_id, Job.worker_id == self.id).values(
                    state=state.value, exit_code=rc, stop_reason=reason, finished_at=time.time(),
                    updated_at=time.time(), pid=None, stop_requested=False))
                self.db.add_event(s, job_id, state.value, reason or "")

    # -- 3. stop ----------------------------------------------------------------------------------------
    def enforce_stops(self) -> None:
        """SIGTERM runners whose job was asked to stop or whose tenant has no balance left."""
        if not self.running:
            return
        with self.db.session() as s:
            asked = set(s.scalars(select(Job.id).where(Job.id.in_(list(self.running)),
                                                       Job.stop_requested.is_(True))).all())
        for job_id in asked:
            r = self.running[job_id]
            if r.stop_reason is None:
                r.stop_reason = "stopped by the user: emergency checkpoint written"
                _signal(r.proc, signal.SIGTERM)
        now = time.time()
        if now - self._last_balance_check < 2.0:
            return
        self._last_balance_check = now
        for tenant_id in {r.tenant_id for r in self.running.values()}:
            with self.db.session() as s:
                tenant = s.get(Tenant, tenant_id)
            if tenant is None or balance(self.db, self.settings, tenant).remaining_ticks > 0:
                continue
            for r in self.running.values():
                if r.tenant_id == tenant_id and r.stop_reason is None:
                    r.stop_reason = "balance exhausted: emergency checkpoint written; top up to resume"
                    _signal(r.proc, signal.SIGTERM)

    # -- 4. sample --------------------------------------------------------------------------------------
    def sample(self, r: Running) -> None:
        """Record a progress sample when the job's step advanced."""
        run = r.folder / RUN_DIR
        prog = _read_json(run / "progress.json")
        if not prog or int(prog.get("step", -1)) <= r.last_step:
            return
        r.last_step = int(prog["step"])
        tps, shares = _progress_figures(prog)
        loss = prog.get("loss")
        with self.db.session() as s:
            s.add(JobSample(job_id=r.job_id, at=float(prog.get("time") or time.time()), step=r.last_step,
                            loss=float(loss) if isinstance(loss, (int, float)) else None,
                            tokens_per_s=tps, shares=json.dumps(shares)))
            s.execute(update(Job).where(Job.id == r.job_id).values(last_step=r.last_step, updated_at=time.time()))

    # -- 5. claim ---------------------------------------------------------------------------------------
    def claim(self) -> None:
        """Claim queued jobs (oldest first) while slots are free, and launch them."""
        if self._stop:
            return
        free = self.settings.worker_slots - len(self.running)
        if free <= 0:
            return
        with self.db.session() as s:
            ids = s.scalars(select(Job.id).where(Job.state == JobState.QUEUED.value)
                            .order_by(Job.created_at).limit(free * 2)).all()
        for job_id in ids:
            if len(self.running) >= self.settings.worker_slots:
                return
            with self.db.session() as s:
                res = s.execute(update(Job).where(Job.id == job_id, Job.state == JobState.QUEUED.value)
                                .values(state=JobState.RUNNING.value, worker_id=self.id, updated_at=time.time(),
                                        stop_requested=False, launches=Job.launches + 1))
                if res.rowcount != 1:  # type: ignore[attr-defined]
                    continue  # another worker took it
                job = s.get(Job, job_id)
                assert job is not None
                self._launch(s, job)

    def _launch(self, s: Any, job: Job) -> None:
        from starverse.checkpoint.store import CheckpointStore

        folder = job_dir(self.settings, job)
        tenant = s.get(Tenant, job.tenant_id)
        bal = balance(self.db, self.settings, tenant)
        if bal.remaining_ticks <= 0:
            job.state, job.stop_reason = JobState.STOPPED.value, "balance exhausted: top up to run it"
            job.finished_at = time.time()
            self.db.add_event(s, job.id, "stopped", job.stop_reason)
            return
        spec = yaml.safe_load(job.spec)
        billing = spec.setdefault("billing", {})
        # the job may spend what it already spent plus what the tenant has left (the ledger stops it cleanly)
        already = _job_spent(self.settings, job)
        cap = already + bal.remaining
        given = billing.get("budget_total")
        billing["budget_total"] = float(min(Decimal(str(given)), cap) if given is not None else cap)
        (folder / LAUNCH_FILE).write_text(yaml.safe_dump(spec, sort_keys=False))
        ckpt = folder / RUN_DIR / "checkpoints"
        fresh = job.resume_from is None and (not ckpt.is_dir() or CheckpointStore(ckpt).latest() is None)
        if fresh:
            job.fresh_starts += 1
        args = [sys.executable, "-m", "starverse.service.runner", str(folder)]
        if job.resume_from is not None:
            args.append(str(job.resume_from))
        (folder / RESULT_FILE).unlink(missing_ok=True)  # the runner writes this launch's outcome
        err = (folder / LOG_FILE).open("ab")
        # each job its own cache of tokenised corpora: no tenant's data in a shared cache, and no two jobs
        # writing the same cache file at once
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "STARVERSE_CACHE": str(folder / "cache")}
        proc = subprocess.Popen(args, stdout=err, stderr=err, stdin=subprocess.DEVNULL, cwd=folder, env=env,
                                preexec_fn=_term_with_parent)
        self.running[job.id] = Running(job.id, job.tenant_id, proc, folder, [err])
        job.pid, job.started_at = proc.pid, job.started_at or time.time()
        how = "fresh start" if fresh else (f"rollback to step {job.resume_from}" if job.resume_from is not None
                                           else "resuming from its latest checkpoint")
        self.db.add_event(s, job.id, "started", f"launch {job.launches} ({how}), pid {proc.pid}")
        job.resume_from = None


def _signal(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(sig)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _last_error(path: Path) -> str | None:
    """The last ``error:`` line of a runner's log (a user error the library reported)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if line.startswith("error:"):
            return line.removeprefix("error:").strip()
    return lines[-1][:500] if lines else None


def _job_spent(settings: ServiceSettings, job: Job) -> Decimal:
    from starverse.billing import Ledger
    from starverse.errors import BillingError
    from starverse.service.jobs import job_ledger

    path = job_ledger(settings, job)
    if not path.is_file():
        return Decimal(0)
    try:
        with Ledger.open(path, create=False) as ledger:
            return ledger.spent(ledger.job(job.id))
    except BillingError:
        return Decimal(0)


def _progress_figures(prog: dict[str, Any]) -> tuple[float | None, list[float]]:
    """tokens/s and each rank's share of the global batch from the job's ``progress.json`` (written at every
    step by the supervisor's progress callback, so a job that ends between two polls still has them)."""
    tps = prog.get("tokens_per_s")
    raw = prog.get("shares")
    shares = [float(x) for x in raw] if isinstance(raw, list) and all(isinstance(x, (int, float)) for x in raw) else []
    total = sum(shares)
    return (float(tps) if isinstance(tps, (int, float)) else None), ([x / total for x in shares] if total else [])


def main(argv: list[str] | None = None) -> int:
    """``python -m starverse.service.worker ROOT [DATABASE_URL] [SLOTS]``: the loop until SIGTERM/SIGINT."""
    args = sys.argv[1:] if argv is None else argv
    settings = ServiceSettings(root=Path(args[0]), database_url=args[1] if len(args) > 1 else "",
                               worker_slots=int(args[2]) if len(args) > 2 else 2)
    logging.basicConfig(level=logging.WARNING, format="worker %(levelname)s %(name)s: %(message)s")
    # the server started us: go with it (its SIGKILL too)
    _die_with_parent(signal.SIGTERM)
    w = Worker(settings)
    signal.signal(signal.SIGTERM, w.request_stop)
    signal.signal(signal.SIGINT, w.request_stop)
    w.run_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
