"""The job supervisor: run ``Trainer.fit`` under checkpoint insurance; on a loss, re-plan and resume.

One attempt is one ``Trainer.fit`` over the current cluster. It ends in one of four ways:

- **completed**: ``max_steps`` reached; done.
- **hard loss**: a rank killed (SIGKILL, OOM, node gone). ``launch`` notices within its polling period and
  the collective timeout, stops the other ranks and names the dead rank; the supervisor drops that
  device, re-plans on the survivors with the planner (``replan_with_planner``: same global batch, so the
  trajectory continues; one group per device kind if the planner fails), relaunches and resumes from the
  last complete checkpoint. Work lost: at most one checkpoint interval.
- **notice on some ranks** (SIGTERM or another notice source in a rank): the ranks stop together at a
  step boundary and write an emergency checkpoint; the noticed devices are dropped, the rest resume from
  that checkpoint. Work lost: none.
- **in place** (``recovery: in-place``, :mod:`starverse.elastic.inplace`): the launcher absorbs a lost
  data-parallel replica; the others finish the step in flight and go on (torchft), so the attempt completes;
  its ``replicas_lost`` / ``replicas_joined`` say what happened. Only when every replica is lost does the
  launcher raise, and the supervisor falls back to the restart above without all of them.
- **notice for the whole job** (SIGTERM to the supervisor): forwarded to every rank, which checkpoint
  and stop; the supervisor raises :class:`PreemptedError` (exit code 3). Resume later from the run dir.

The supervisor decides on the *type* of the launcher's error, never on its text: a
:class:`~starverse.errors.LostRankError` (a process killed or exited, a heartbeat lost, a Ray actor or node
gone) is a lost device, dropped before re-planning; a :class:`~starverse.errors.RankCodeError` (a rank raised:
a bug or bad data, not a lost device) or a :class:`~starverse.errors.JobTimeoutError` is retried on the same
devices at most ``max_restarts`` times, then re-raised.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from starverse.checkpoint.callback import CheckpointCallback
from starverse.checkpoint.store import CheckpointStore
from starverse.elastic.inplace import InplaceLauncher
from starverse.elastic.runlock import RunLock
from starverse.errors import CheckpointError, DistributedError, LostRankError, PreemptedError, StarverseError
from starverse.plan import Plan
from starverse.runtime.callbacks import Callback, TrainContext
from starverse.runtime.cluster import (
    Cluster,
    estimate_or_none,
    has_blocks,
    local_plan,
    order_ranks_like_plan,
)
from starverse.runtime.launch import Launcher, RankSpec, resolve_launcher
from starverse.runtime.parallel.pipeline_split import can_be_pipelined
from starverse.runtime.trainer import FitResult, Trainer

log = logging.getLogger(__name__)

NOTICES_DIR = "notices"
PROGRESS_FILE = "progress.json"


@dataclass(frozen=True)
class Attempt:
    """One ``Trainer.fit`` of the supervised job."""

    number: int
    """1 for the first launch."""
    device_kinds: tuple[str, ...]
    """Accelerator id of each rank."""
    resumed_from: int | None
    """Checkpoint step it resumed from (None: fresh start)."""
    outcome: str
    """``completed``, ``lost``, ``notice``, ``preempted`` or ``error``."""
    last_step: int | None
    """Last step completed (from the progress file), when known."""
    detail: str = ""
    """The error or notice text."""
    wall_s: float = 0.0
    """Duration of the attempt."""
    ended_at: float = 0.0
    """``time.time()`` when the supervisor saw the attempt end (a loss: when it noticed)."""
    replicas_lost: tuple[int, ...] = ()
    """``recovery: in-place``: ranks lost during the attempt that the others survived without a restart."""
    replicas_joined: tuple[int, ...] = ()
    """``recovery: in-place``: ranks whose replacement joined during the attempt."""


@dataclass(frozen=True)
class SupervisedResult:
    """What the supervised job did."""

    fit: FitResult | None
    """The last attempt's result (None if it did not complete)."""
    attempts: tuple[Attempt, ...]
    """Every attempt in order."""
    final_step: int
    """Steps completed in the end."""

    @property
    def lost_steps(self) -> int:
        """Steps computed twice because of hard losses (last step reached minus the step resumed from)."""
        lost = 0
        for prev, nxt in zip(self.attempts, self.attempts[1:], strict=False):
            if prev.last_step is not None and nxt.resumed_from is not None:
                lost += max(0, prev.last_step - nxt.resumed_from)
        return lost


class ProgressCallback(Callback):
    """Rank 0 records the last completed step and its time (``run_dir/progress.json``) for the supervisor;
    a rank that received a preemption notice itself leaves ``run_dir/notices/rank-N.json``."""

    def on_step_end(self, ctx: TrainContext) -> None:
        """Write progress (rank 0) and this rank's notice, if any."""
        if ctx.rank == 0:
            p = Path(ctx.run_dir) / PROGRESS_FILE
            tmp = p.with_suffix(".tmp")
            m = ctx.metrics
            tmp.write_text(json.dumps({"step": ctx.step, "time": time.time(), "loss": m.loss,
                                       "tokens_per_s": m.tokens_per_s, "shares": list(ctx.shares)}))
            tmp.replace(p)

    def on_fit_end(self, ctx: TrainContext) -> None:
        """Leave a notice marker when this rank itself was warned (its device is going away)."""
        notice = ctx.notice
        if notice is not None and notice.source != "another rank":
            d = Path(ctx.run_dir) / NOTICES_DIR
            d.mkdir(parents=True, exist_ok=True)
            (d / f"rank-{ctx.rank}.json").write_text(
                json.dumps({"rank": ctx.rank, "device_kind": ctx.device_kind, "source": notice.source,
                            "step": ctx.step})
            )


def read_progress(run_dir: Path) -> dict[str, Any] | None:
    """The last progress record, or None."""
    try:
        return json.loads((Path(run_dir) / PROGRESS_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def replan_local(cluster: Cluster, survivors: Sequence[RankSpec], lost: Sequence[RankSpec], why: str = "") -> Cluster:
    """The re-plan without the planner: one data-parallel group per surviving device kind; same model,
    sequence length and **global batch** (so the loss trajectory continues), ranks renumbered. ``why``: what
    the note says about the planner not being used."""
    ranks = tuple(RankSpec(i, r.device_kind, r.device, r.num_threads, r.env) for i, r in enumerate(survivors))
    old = cluster.plan
    plan = local_plan(
        ranks, old.model, old.groups[0].stages[0].layers, old.train.seq_len, old.train.global_batch,
        precision=old.train.precision,
    )
    how = "one data-parallel group per device kind" + (f" (planner not used: {why})" if why else "")
    return _replanned(cluster, plan, ranks, lost, how, estimate_or_none(plan))


def replan_with_planner(cluster: Cluster, survivors: Sequence[RankSpec], lost: Sequence[RankSpec], *,
                        pipelines: bool = True, recovery: str = "restart", rebalance_every: int = 0,
                        blocks: bool = True) -> Cluster:
    """The default re-plan: :func:`starverse.planner.plan_for_devices` on the surviving devices, within what
    the runtime executes there (:func:`~starverse.runtime.cluster.executable_caps`: TP, ZeRO, recompute,
    offload, pipelines; the checkpoint loads across layouts), for the same model (the cluster's config, scaled
    copy included), sequence length, precision, training mode and **global batch**, with the cluster's policy;
    the runnable plans only, the simplest within 5 % of the best first. Falls back to :func:`replan_local` only
    when the planner fails (unknown model or device, a batch that does not split over the survivors...), logged
    with the planner's reason. ``pipelines=False``: one stage per group (the model cannot be cut into stages);
    ``recovery="in-place"``: plain data parallelism, so the next attempt can still recover in place;
    ``rebalance_every``: the Trainer's (ZeRO-2/3 plans need 0: their ranks run in lockstep); ``blocks=False``: the
    model has no ``nn.ModuleList`` of blocks (ZeRO ≤ 1, no recompute)."""
    from starverse.runtime.cluster import executable_caps, plan_on_ranks

    ranks = tuple(RankSpec(i, r.device_kind, r.device, r.num_threads, r.env) for i, r in enumerate(survivors))
    old = cluster.plan
    model = cluster.model_config if cluster.model_config is not None else old.model
    train = {"seq_len": old.train.seq_len, "global_batch": old.train.global_batch,
             "precision": old.train.precision, "mode": old.train.mode, "lora_rank": old.train.lora_rank}
    try:
        result = plan_on_ranks(model, old.model, ranks, cluster.policy, train,
                               executable_caps(ranks, recovery, pipelines, blocks), catalog=cluster.catalog,
                               rebalance_every=rebalance_every, recovery=recovery)
        best = result.best
    except StarverseError as e:
        reason = " ".join(str(e).split())
        log.warning("planner not used for the re-plan (%s: %s); one data-parallel group per device kind",
                    e.__class__.__name__, reason)
        return replan_local(cluster, survivors, lost, f"{e.__class__.__name__}: {reason}")
    est = best.estimate
    how = (f"planned by the planner (objective {result.objective}): {best.layout()}; estimate: step "
           f"{est.step_time_s:.4g} s, {best.tokens_per_s:,.0f} tokens/s")
    ordered = order_ranks_like_plan(best.plan, list(ranks))
    return _replanned(cluster, best.plan, ordered, lost, how, est)


def _replanned(cluster: Cluster, plan: Plan, ranks: tuple[RankSpec, ...], lost: Sequence[RankSpec], how: str,
               estimate: Any) -> Cluster:
    gone = ", ".join(f"{r.device_kind} (rank {r.rank})" for r in lost)
    note = f"re-planned after losing {gone}: {len(ranks)} ranks, {how}, global batch {plan.train.global_batch}"
    log.warning("%s", note)
    return dataclasses.replace(cluster, plan=plan, ranks=ranks, weights=(), estimate=estimate,
                               notes=(*cluster.notes, note))


class PoolSource(Protocol):
    """Where a job's devices come from, asked again at each re-plan (a running Ray cluster:
    :class:`~starverse.providers.ray_pool.RayPoolSource`), so devices that joined or left since the job started
    change what it re-plans on."""

    def current_ranks(self, survivors: Sequence[RankSpec], lost: Sequence[RankSpec]) -> Sequence[RankSpec]:
        """The ranks to re-plan on now: the survivors still available, then devices that joined."""
        ...


class Supervisor:
    """Runs a training job to completion across device losses (see the module docstring)."""

    def __init__(
        self,
        cluster: Cluster,
        run_dir: str | Path,
        *,
        checkpoint: CheckpointCallback,
        preemption: Callback | None = None,
        callbacks: Sequence[Callback] | Callable[[int], Sequence[Callback]] = (),
        trainer_options: dict[str, Any] | None = None,
        max_restarts: int = 5,
        replan: Callable[[Cluster, Sequence[RankSpec], Sequence[RankSpec]], Cluster] = replan_with_planner,
        pool_source: PoolSource | None = None,
    ):
        """``checkpoint``/``preemption``: the insurance callbacks (their settings apply to every attempt);
        ``callbacks``: other callbacks, or a function of the attempt number returning them (tests inject
        failures in the first attempt only); ``trainer_options``: extra ``Trainer`` fields; ``pool_source``: the
        devices to re-plan on are asked from it (None: the survivors)."""
        self.cluster = cluster
        self.run_dir = Path(run_dir).resolve()
        self.checkpoint = checkpoint
        self.preemption = preemption
        self.callbacks = callbacks
        self.trainer_options = dict(trainer_options or {})
        # one launcher object for every attempt: the supervisor forwards a SIGTERM to the ranks it runs
        self.launcher: Launcher = resolve_launcher(self.trainer_options.get("launcher", "local"))
        self.trainer_options["launcher"] = self.launcher
        self.max_restarts = max_restarts
        self.replan = replan
        self.pool_source = pool_source
        self._job_notice: str | None = None

    @property
    def store(self) -> CheckpointStore:
        """The run's checkpoint store."""
        return CheckpointStore(self.checkpoint.directory or self.run_dir / "checkpoints")

    def resume_path(self, resume_from: int | str | None) -> Path | None:
        """Check ``resume_from`` (a step, ``"latest"`` or None) before launching anything; read-only."""
        store = self.store
        if resume_from is None:
            return None
        if resume_from == "latest":
            info = store.latest()
            return info.path if info is not None else None
        info = store.get(int(resume_from))
        store.verify(info)
        return info.path

    def _attempt_callbacks(self, number: int) -> list[Callback]:
        extra = self.callbacks(number) if callable(self.callbacks) else self.callbacks
        insurance: list[Callback] = [self.preemption] if self.preemption is not None else []
        # Order matters: the notice is agreed before the checkpoint callback decides; progress comes last.
        return [*insurance, self.checkpoint, *extra, ProgressCallback()]

    def _on_sigterm(self, signum: int, frame: object) -> None:
        self.request_stop(signal.Signals(signum).name)

    def request_stop(self, reason: str) -> None:
        """Stop the whole job: every rank writes an emergency checkpoint and stops; :meth:`run` then raises
        :class:`PreemptedError`. What SIGTERM to the supervisor does; callable from any thread."""
        if self._job_notice is None:
            self._job_notice = reason
            log.warning("supervisor received %s: asking every rank for an emergency checkpoint", self._job_notice)
        # from a thread: a signal handler interrupts the main thread, maybe inside the launcher's own wait
        threading.Thread(target=self.launcher.notify, args=(signal.SIGTERM,), name="notify-ranks", daemon=True).start()

    def run(self, model_factory: Callable[[Cluster], Any], dataset: Any, *, resume_from: int | str | None = "latest",
            **fit_kwargs: Any) -> SupervisedResult:
        """Train until ``fit_kwargs['max_steps']``; ``model_factory(cluster)`` builds the (initial) model.

        Holds the run directory's lock throughout (:class:`~starverse.elastic.runlock.RunLock`): a second
        supervisor on a live run directory is refused with :class:`RunDirBusyError` naming the holder."""
        with RunLock(self.run_dir):
            return self._run(model_factory, dataset, resume_from, fit_kwargs)

    def _run(self, model_factory: Callable[[Cluster], Any], dataset: Any, resume_from: int | str | None,
             fit_kwargs: dict[str, Any]) -> SupervisedResult:
        resume = self.resume_path(resume_from)
        first_model = model_factory(self.cluster)
        if self.replan is replan_with_planner:  # a user's model is not cut; in-place recovery needs plain DP
            options: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(Trainer)} | self.trainer_options
            self.replan = functools.partial(replan_with_planner, pipelines=can_be_pipelined(first_model),
                                            recovery=str(options["recovery"]),
                                            rebalance_every=int(options["rebalance_every"]),
                                            blocks=has_blocks(first_model))
        if resume is not None:
            self._check_model(first_model, resume)
        # signal handlers can only be set from the main thread; elsewhere (a service) stop with request_stop
        in_main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, self._on_sigterm) if in_main else None
        attempts: list[Attempt] = []
        errors = 0
        try:
            while True:
                number = len(attempts) + 1
                resumed_step = _step_of(resume)
                t0 = time.monotonic()
                (self.run_dir / NOTICES_DIR).mkdir(parents=True, exist_ok=True)
                for old in (self.run_dir / NOTICES_DIR).glob("rank-*.json"):
                    old.unlink()
                (self.run_dir / PROGRESS_FILE).unlink(missing_ok=True)  # a stale one would misreport losses
                trainer = Trainer(self.cluster, callbacks=self._attempt_callbacks(number), run_dir=self.run_dir,
                                  **self.trainer_options)
                kinds = tuple(r.device_kind for r in self.cluster.ranks)
                try:
                    model = first_model if number == 1 else model_factory(self.cluster)
                    fit = trainer.fit(model, dataset, resume_from=resume, **fit_kwargs)
                except DistributedError as e:
                    progress = read_progress(self.run_dir)
                    last = progress["step"] if progress else None
                    lost = e.rank if isinstance(e, LostRankError) else None
                    outcome = "lost" if lost is not None else "error"
                    attempts.append(Attempt(number, kinds, resumed_step, outcome, last, str(e),
                                            time.monotonic() - t0, time.time(), *self._inplace_record()))
                    if self._job_notice is not None:
                        raise self._preempted(attempts) from None
                    if lost is None:
                        errors += 1
                        if errors > self.max_restarts:
                            raise
                        log.warning("attempt %d failed (%s); retrying on the same devices", number, e)
                    else:
                        # in place, every replica was lost one after the other: all of them are gone
                        self._drop([lost, *self._inplace_record()[0]], str(e))
                    if len(attempts) > self.max_restarts:
                        raise DistributedError(
                            f"gave up after {len(attempts)} attempts (max_restarts={self.max_restarts}); last: {e}. "
                            f"Progress is kept in {self.store.root}: resume with `starverse train` later."
                        ) from None
                    resume = self._latest_or_none(resume)
                    continue
                noticed = sorted(int(p.stem.split("-")[1]) for p in (self.run_dir / NOTICES_DIR).glob("rank-*.json"))
                if self._job_notice is not None:
                    attempts.append(Attempt(number, kinds, resumed_step, "preempted", fit.steps, self._job_notice,
                                            time.monotonic() - t0, time.time()))
                    raise self._preempted(attempts)
                if fit.steps >= fit_kwargs.get("max_steps", fit.steps) or not noticed:
                    attempts.append(Attempt(number, kinds, resumed_step, "completed", fit.steps, fit.stop_reason or "",
                                            time.monotonic() - t0, time.time(), *self._inplace_record()))
                    return SupervisedResult(fit, tuple(attempts), fit.steps)
                attempts.append(Attempt(number, kinds, resumed_step, "notice", fit.steps,
                                        f"notice on ranks {noticed}", time.monotonic() - t0, time.time()))
                if len(noticed) == len(self.cluster.ranks):
                    raise self._preempted(attempts)
                self._drop(noticed, f"preemption notice on ranks {noticed}")
                resume = self._latest_or_none(resume)
        finally:
            if in_main:
                signal.signal(signal.SIGTERM, previous)

    def _inplace_record(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Ranks lost for good and ranks replaced during the last in-place launch (empty for other launchers)."""
        if not isinstance(self.launcher, InplaceLauncher):
            return (), ()
        joined = tuple(j.rank for j in self.launcher.joins)
        lost = tuple(x.error.rank for x in self.launcher.losses if x.error.rank not in joined)
        return lost, joined

    def _check_model(self, model: Any, resume: Path) -> None:
        """Refuse a checkpoint of another model before launching anything (the ranks check it again)."""
        from starverse.checkpoint.state import fingerprint

        info = CheckpointStore(resume.parent).get(int(resume.name.split("-", 1)[1]))
        fp, num = fingerprint(model)
        if fp != info.model_fingerprint:
            raise CheckpointError(
                f"{info.path}: written for a different model ({info.num_params:,} parameters, fingerprint "
                f"{info.model_fingerprint}; this job's model has {num:,}, fingerprint {fp}). To fix: use the "
                "model it was written for, or another run_dir."
            )

    def _drop(self, lost_ranks: Sequence[int], why: str) -> None:
        lost = [r for r in self.cluster.ranks if r.rank in set(lost_ranks)]
        survivors = [r for r in self.cluster.ranks if r.rank not in set(lost_ranks)]
        if self.pool_source is not None:
            survivors = list(self.pool_source.current_ranks(survivors, lost))
        if not survivors:
            raise DistributedError(f"every device of the job is gone ({why}). Progress is kept in {self.store.root}.")
        self.cluster = self.replan(self.cluster, survivors, lost)

    def _latest_or_none(self, previous: Path | None) -> Path | None:
        info = self.store.latest()
        if info is None:
            if previous is not None:
                raise CheckpointError(f"{self.store.root}: the checkpoint resumed from is gone; cannot continue.")
            log.warning("no checkpoint yet: restarting from step 0")
            return None
        return info.path

    def _preempted(self, attempts: list[Attempt]) -> StarverseError:
        info = self.store.latest()
        where = f"checkpoint step-{info.step} in {info.path.parent}" if info else "no checkpoint"
        return PreemptedError(
            f"job preempted ({self._job_notice or 'every device got a notice'}) after {len(attempts)} attempt(s); "
            f"last {where}. To resume: run the same `starverse train` command again."
        )


def _step_of(path: Path | None) -> int | None:
    if path is None:
        return None
    m = re.match(r"^step-(\d+)$", path.name)
    return int(m.group(1)) if m else None
