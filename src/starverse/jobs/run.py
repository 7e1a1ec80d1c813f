"""``run_job(job) -> JobResult``: a supervised training job from its job file to its bill.

The CLI's ``starverse train`` and the service are faces over this: they print or serve a :class:`JobResult`
and hold no logic of their own. :func:`prepare_job` does everything that can fail on bad input before any
process starts (job file, cluster, prices, budget, ledger, resume point); :meth:`PreparedJob.run` trains.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import starverse
from starverse.checks import check_port_free, check_run_dir, check_seq_len
from starverse.config import where
from starverse.elastic.inplace import InplaceLauncher
from starverse.elastic.job import (
    JobPrices,
    RayPoolSettings,
    TrainJob,
    check_job_inputs,
    job_mtbf,
    job_prices,
    load_job,
)
from starverse.elastic.supervisor import Attempt, SupervisedResult, Supervisor, read_progress
from starverse.jobs.ledger import InplaceAccounting, JobBill, check_ledger_job, job_bill
from starverse.jobs.wiring import JobCallbacks, build_callbacks
from starverse.metrics.callbacks import ENDPOINT_FILE, lease_pricing
from starverse.providers.local import LocalLauncher, rank_server
from starverse.providers.ray_pool import RayPoolSource, pool_source_for
from starverse.runtime.cluster import Cluster
from starverse.runtime.launch import resolve_launcher
from starverse.runtime.lora import check_mode
from starverse.runtime.modeling import model_modules
from starverse.runtime.trainer import FitResult

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobProgress:
    """A training step completed (what ``on_progress`` receives, from rank 0's progress record)."""

    step: int
    """Steps completed."""
    max_steps: int
    """Steps of the whole job."""
    loss: float | None
    """Loss of that step."""
    time: float
    """Unix time it completed."""


@dataclass(frozen=True)
class JobResult:
    """What a supervised job did: steps, attempts, checkpoints, metrics endpoint and bill."""

    final_step: int
    """Steps completed in the end."""
    lost_steps: int
    """Steps computed twice because of hard losses."""
    final_loss: float | None
    """Loss of the last step (None if the last attempt did not complete)."""
    stop_reason: str | None
    """Why training stopped before ``max_steps`` (budget, ...), None when it ran to the end."""
    attempts: tuple[Attempt, ...]
    """Every attempt in order."""
    checkpoint_interval: str | None
    """The interval of the last checkpoint and why it was chosen."""
    run_dir: Path
    """The run directory."""
    checkpoints: Path
    """The checkpoint folder."""
    metrics_url: str | None
    """Where the Prometheus endpoint was served (None: metrics off)."""
    bill: JobBill | None
    """The job's bill (None: billing off)."""
    fit: FitResult | None
    """The last attempt's result."""

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly form (``train --json``, the service)."""
        return {
            "final_step": self.final_step, "lost_steps": self.lost_steps, "final_loss": self.final_loss,
            "stop_reason": self.stop_reason,
            "attempts": [a.__dict__ | {"device_kinds": list(a.device_kinds)} for a in self.attempts],
            "checkpoint_interval": self.checkpoint_interval, "run_dir": str(self.run_dir),
            "checkpoints": str(self.checkpoints), "metrics_url": self.metrics_url,
            "bill": self.bill.as_dict() if self.bill is not None else None,
            "pipeline": self.fit.pipeline.as_dict() if self.fit is not None and self.fit.pipeline else None,
        }


class PreparedJob:
    """A job checked and wired, not started: :meth:`summary_lines` says what will run, :meth:`run` runs it."""

    def __init__(self, job: TrainJob, *, source: str = "job", resume_from: int | str | None = "latest"):
        """Check ``job`` (``source``: its file, for messages) and build its cluster, prices, callbacks and
        supervisor; ``resume_from``: a checkpoint step, ``"latest"`` or None (fresh start)."""
        self.job = job
        self.source = source
        self.run_dir = Path(job.run_dir)
        check_run_dir(job.run_dir, source)
        check_job_inputs(job, source)
        if job.metrics.enabled:
            check_port_free(job.metrics.port, f"{where(source, ('metrics', 'port'))}: metrics.port")
        pretrained = Path(job.model).is_dir()
        # a pretrained folder is never scaled down: the default size cap applies only when the job file sets it
        max_params = job.train.max_params if not pretrained or "max_params" in job.train.model_fields_set else None
        # a Ray pool: the cluster's devices now, the Ray launcher, and the cluster asked again at each re-plan
        ray_pool: RayPoolSource | None = pool_source_for(job.pool) if isinstance(job.pool, RayPoolSettings) else None
        self.cluster: Cluster = starverse.accelerate(
            model_id=job.model, plan=job.plan, num_cpu_ranks=job.devices.cpu_ranks, use_gpus=job.devices.use_gpus,
            seq_len=job.train.seq_len, global_batch=job.train.global_batch, max_params=max_params,
            mode=job.train.mode, lora_rank=job.train.lora_rank, ranks=ray_pool.ranks() if ray_pool else None,
            recovery=job.recovery, rebalance_every=job.train.rebalance_every,
        )
        check_seq_len(job.train.seq_len, self.cluster.model_config, job.model, source)
        check_mode(job.train.mode, [r.device for r in self.cluster.ranks], source)
        kinds = [r.device_kind for r in self.cluster.ranks]
        self.mtbf_s, self.mtbf_why = job_mtbf(job, kinds)
        self.prices: JobPrices | None = None
        if job.billing.enabled:
            # refuses a job above max_budget_per_hour
            self.prices = job_prices(job, kinds, source, pool=ray_pool.pool() if ray_pool else None)
        self.callbacks: JobCallbacks = build_callbacks(job, mtbf_s=self.mtbf_s, prices=self.prices)
        billing = self.callbacks.billing
        if billing is not None and billing.ledger_path is not None and self.prices is not None:
            check_ledger_job(Path(billing.ledger_path), billing.job_name or self.run_dir.name, self.prices.currency,
                             job.billing.budget_total, source)
        launcher: Any = self._restart_launcher(ray_pool)
        self.inplace: InplaceAccounting | None = None
        if job.recovery == "in-place":
            launcher = self._inplace_launcher(launcher)
        self.supervisor = Supervisor(
            self.cluster, self.run_dir,
            checkpoint=self.callbacks.checkpoint, preemption=self.callbacks.preemption,
            callbacks=self.callbacks.accounting,
            trainer_options={"lr": job.train.lr, "seed": job.train.seed,
                             "rebalance_every": job.train.rebalance_every, "launcher": launcher,
                             "eval_fraction": job.train.eval_fraction, "eval_every": job.train.eval_every,
                             "recovery": job.recovery},
            max_restarts=job.max_restarts, pool_source=ray_pool,
        )
        self.resume_from = resume_from
        self.resume_path = self.supervisor.resume_path(resume_from)  # checked before anything is launched

    def _restart_launcher(self, ray_pool: RayPoolSource | None) -> Any:
        """The launcher of ``devices.launcher`` (or a Ray pool's), with the job's heartbeat settings."""
        launcher: Any = ray_pool.launcher() if ray_pool else resolve_launcher(self.job.devices.launcher)
        return dataclasses.replace(launcher, heartbeat_s=self.job.heartbeat_s,
                                   heartbeat_timeout_s=self.job.heartbeat_timeout_s)

    def _inplace_launcher(self, launcher: Any) -> InplaceLauncher:
        """``recovery: in-place``: the torchft launcher (its Ray variant for ``devices.launcher: ray`` or a Ray
        pool: ``launcher`` is then a RayLauncher), its lost and joining leases billed (see
        :class:`~starverse.jobs.ledger.InplaceAccounting`)."""
        job = self.job
        # a plan in-place recovery does not run falls back to checkpoint-restart with one line (Trainer.fit)
        # warm spares unless the job says no locally; on Ray only when it says yes (a spare holds a bundle)
        beat, timeout = job.heartbeat_s, job.heartbeat_timeout_s
        if isinstance(launcher, LocalLauncher):
            launcher = InplaceLauncher(replace_after_s=job.replace_after_s, warm_spares=job.warm_spares is not False,
                                       heartbeat_s=beat, heartbeat_timeout_s=timeout)
        else:
            from starverse.providers.ray_inplace import RayInplaceLauncher

            launcher = RayInplaceLauncher(replace_after_s=job.replace_after_s, warm_spares=bool(job.warm_spares),
                                          ray=launcher, heartbeat_s=beat, heartbeat_timeout_s=timeout)
        billing = self.callbacks.billing
        if billing is not None and billing.ledger_path is not None:
            plan, prices = self.cluster.plan, billing.prices
            self.inplace = InplaceAccounting(Path(billing.ledger_path), billing.job_name or self.run_dir.name,
                                             self.run_dir, lambda acc: lease_pricing(prices, plan, acc))
            launcher.on_loss, launcher.on_join = self.inplace.on_loss, self.inplace.on_join
        return launcher

    def summary_lines(self) -> list[str]:
        """What will run: cluster, checkpoint interval and resume point, ledger and prices, metrics."""
        job, ck = self.job, self.job.checkpoint
        lines = list(self.cluster.summary_lines())
        lines.append(
            f"checkpoints: {self.supervisor.store.root}; interval "
            + (f"{ck.interval_steps} steps (job file)" if ck.interval_steps else
               f"Young/Daly, MTBF from {self.mtbf_why}")
            + (f"; resuming from {self.resume_path.name}" if self.resume_path else "; fresh start")
        )
        billing, prices = self.callbacks.billing, self.prices
        if billing is not None and prices is not None:
            budget = ", ".join(f"{k} {v} {prices.currency}" for k, v in (
                ("total budget", job.billing.budget_total), ("max per hour", job.billing.max_budget_per_hour)) if v)
            lines.append(f"ledger: {billing.ledger_path} (job '{billing.job_name}'); devices cost "
                         f"{prices.cost_per_hour.normalize():f} {prices.currency}/h" + (f"; {budget}" if budget else ""))
            lines.extend(f"  {line}" for line in prices.lines)
        if job.metrics.enabled:
            lines.append(f"metrics: Prometheus on 127.0.0.1:{job.metrics.port or '<free port>'} while training "
                         f"(URL in {self.run_dir / ENDPOINT_FILE})")
        return lines

    def stop(self, reason: str = "stop requested") -> None:
        """Ask the running job to write an emergency checkpoint and stop (``run`` then raises
        :class:`~starverse.errors.PreemptedError`); safe from any thread."""
        self.supervisor.request_stop(reason)

    def run(self, on_progress: Callable[[JobProgress], None] | None = None) -> JobResult:
        """Train to ``train.steps`` under the supervisor; ``on_progress`` is called (from a watcher thread)
        after each step rank 0 reports. Raises :class:`~starverse.errors.PreemptedError` after a stop."""
        job = self.job

        def model_factory(c: Cluster) -> Any:
            with c.mixed_mesh():
                return starverse.build_model(c, seed=job.train.seed)  # weights, dtype and adapters of the mode

        with contextlib.ExitStack() as job_scope:
            if type(self.supervisor.launcher) is LocalLauncher:  # the ranks' fork server, before any thread starts
                job_scope.enter_context(rank_server(model_modules(self.cluster.model_config)))
            watcher = _ProgressWatcher(self.run_dir, job.train.steps, on_progress) if on_progress else None
            try:
                out = self.supervisor.run(
                    model_factory, job.dataset, resume_from=self.resume_from,
                    per_device_batch_size=job.train.micro_batch, max_steps=job.train.steps,
                    seq_len=job.train.seq_len, global_batch=job.train.global_batch, tokenizer=job.train.tokenizer,
                )
            finally:
                if watcher is not None:
                    watcher.close()
                if self.inplace is not None:
                    self.inplace.close()
        return self._result(out)

    def _result(self, out: SupervisedResult) -> JobResult:
        store = self.supervisor.store
        latest = store.latest()
        interval = (latest.manifest.get("interval") or {}).get("reason") if latest else None
        billing = self.callbacks.billing
        bill = None
        if billing is not None and billing.ledger_path and billing.job_name:
            bill = job_bill(billing.ledger_path, billing.job_name)
        endpoint = self.run_dir / ENDPOINT_FILE
        metrics_url = None
        if self.job.metrics.enabled and endpoint.is_file():
            metrics_url = json.loads(endpoint.read_text()).get("url")
        return JobResult(
            final_step=out.final_step, lost_steps=out.lost_steps,
            final_loss=out.fit.final_loss if out.fit else None, stop_reason=out.fit.stop_reason if out.fit else None,
            attempts=out.attempts, checkpoint_interval=interval, run_dir=self.run_dir, checkpoints=store.root,
            metrics_url=metrics_url, bill=bill, fit=out.fit,
        )


class _ProgressWatcher:
    """Polls rank 0's progress record and calls ``on_progress`` once per new step."""

    def __init__(self, run_dir: Path, max_steps: int, on_progress: Callable[[JobProgress], None],
                 period_s: float = 0.25):
        self.run_dir, self.max_steps, self.on_progress, self.period_s = run_dir, max_steps, on_progress, period_s
        self._stop = threading.Event()
        self._last: int | None = None
        self._thread = threading.Thread(target=self._loop, name="job-progress", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        p = read_progress(self.run_dir)
        if p is not None and p.get("step") != self._last:
            self._last = int(p["step"])
            try:
                self.on_progress(JobProgress(self._last, self.max_steps, p.get("loss"), float(p.get("time", 0.0))))
            except Exception:  # a failing observer must not stop the job
                log.exception("on_progress failed")

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self._poll()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._poll()


def prepare_job(job: TrainJob | str | Path, *, resume_from: int | str | None = "latest",
                metrics_port: int | None = None, source: str | Path | None = None) -> PreparedJob:
    """Load (a path) and check a job, wire it; nothing is started. See :class:`PreparedJob`. ``metrics_port``
    overrides the job's ``metrics.port``; ``source`` names the file a loaded :class:`TrainJob` came from (in
    messages)."""
    loaded = job if isinstance(job, TrainJob) else load_job(job)
    if metrics_port is not None:
        loaded = loaded.model_copy(update={"metrics": loaded.metrics.model_copy(update={"port": metrics_port})})
    name = str(source) if source is not None else ("job" if isinstance(job, TrainJob) else str(job))
    return PreparedJob(loaded, source=name, resume_from=resume_from)


def run_job(job: TrainJob | str | Path, *, resume_from: int | str | None = "latest",
            on_progress: Callable[[JobProgress], None] | None = None) -> JobResult:
    """Run a training job (a :class:`TrainJob` or a job file) under the supervisor to its end: checkpoints,
    preemption notices, re-plan and resume on device loss, ledger and budgets, metrics. Raises
    :class:`~starverse.errors.PreemptedError` when preempted as a whole (resume by running it again)."""
    return prepare_job(job, resume_from=resume_from).run(on_progress)
