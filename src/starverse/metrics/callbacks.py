"""Training callbacks of the accounting side: :class:`BillingCallback` (ledger, budgets, insurance events)
and :class:`MetricsCallback` (Prometheus exporter).

Both act on rank 0 only (every rank runs a copy; the others return at once) and are picklable: the ledger
and the HTTP server are opened in ``on_fit_start`` inside the rank process.

Wiring with checkpoints and preemption notices (list the checkpoint callback first)::

    billing = BillingCallback(budget_total=50)
    ckpt = CheckpointCallback(billing_cursor=billing.checkpoint_cursor, resume_from="latest")
    Trainer(cluster, callbacks=[PreemptionCallback(), ckpt, billing, MetricsCallback(checkpoints=ckpt, billing=billing)])

(``starverse.jobs.build_callbacks`` is the one place a job wires them.)

``checkpoint_cursor`` records a checkpoint event each time a checkpoint is taken (and returns the cursor
saved in its manifest). A run stopped by a preemption notice records a preemption instead of a stop. A
relaunch that finds leases of the job still open knows the previous run died: it records the preemption
at their last heartbeat and closes them there. A resumed run records the resume with the step it resumed
from. These events are what the insurance credits are computed from. ``CheckpointCallback`` also
publishes each committed checkpoint as ``ctx.committed`` (a ``CommittedCheckpoint``); a checkpoint is recorded
once, whichever is seen first.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

from starverse.billing import EventKind, LeasePricing, Ledger, PricingMode, next_interval_exceeds
from starverse.billing.ledger import LEDGER_FILE, Job
from starverse.billing.money import ticks_to_decimal
from starverse.metrics.exporter import JobState, MetricsExporter, RankState
from starverse.runtime.callbacks import Callback, CommittedCheckpoint, TrainContext

log = logging.getLogger(__name__)

ENDPOINT_FILE = "metrics.json"
"""Written in the run directory by :class:`MetricsCallback`: ``{"url": ..., "port": ...}``."""


@dataclass(frozen=True)
class BillingStatus:
    """The job's money as the ledger has it now (rank 0; published by :class:`BillingCallback`)."""

    currency: str
    """The job's billing currency."""
    spent: Decimal
    """Charges so far (all runs of the job)."""
    credits: Decimal
    """Insurance credits so far."""
    cost_per_hour: Decimal
    """What the open leases cost per hour together."""
    budget_total: Decimal | None
    """The job's total budget (None: none)."""
    preemptions: int
    """Preemptions recorded for the job."""
    ledger: str
    """Ledger file."""
    job: str
    """The job's name in the ledger."""


def _last_state(ledger: Ledger, job: Job) -> EventKind | None:
    """The last preemption/resume/stop event of the job (checkpoints do not change its state)."""
    states = [e.kind for e in ledger.events(job) if e.kind != EventKind.CHECKPOINT]
    return states[-1] if states else None


def lease_pricing(prices: Mapping[str, LeasePricing], plan: Any, accelerator: str) -> LeasePricing:
    """A lease's pricing: the job's ``prices`` (from its pool), else the plan's on-demand ``pricing``, else free."""
    if accelerator in prices:
        return prices[accelerator]
    pricing = plan.pricing
    if pricing is not None and accelerator in pricing.price_per_hour:
        return LeasePricing(PricingMode.ON_DEMAND, Decimal(repr(pricing.price_per_hour[accelerator])),
                            pricing.currency)
    return LeasePricing.free()


class BillingCallback(Callback):
    """Leases for the run's devices in the per-second ledger, checkpoint/preemption/resume events, budgets.

    - ``on_fit_start``: opens the ledger (``ledger_path``, default ``run_dir/ledger.sqlite``), starts or
      resumes the job, closes leases a dead previous run left open (recording that preemption and this
      resume), then opens one lease per rank, priced by ``prices`` (accelerator id -> ``LeasePricing``),
      else the plan's ``pricing`` (on-demand), else free (the user's own machine). A lease above
      ``max_budget_per_hour`` fails the start with ``BudgetExceededError``.
    - ``on_step_end``: heartbeat, checkpoint events, and the total budget: when the next interval would
      exceed it, records ``budget_stop`` and calls ``ctx.request_stop`` (the checkpoint callback saves on
      a requested stop), so the job overshoots by at most one interval.
    - ``on_fit_end``: closes the leases and records ``stop``.

    Publishes :attr:`status` (a :class:`BillingStatus`) for the metrics callback.
    """

    def __init__(self, *, job: str | None = None, ledger_path: str | Path | None = None,
                 currency: str | None = None, budget_total: Decimal | str | float | None = None,
                 max_budget_per_hour: Decimal | str | float | None = None,
                 prices: Mapping[str, LeasePricing] | None = None, provider: str = "local",
                 clock: Callable[[], float] = time.time, checkpoint_s: float = 0.0):
        self.job_name = job
        self.ledger_path = None if ledger_path is None else str(ledger_path)
        self.currency = currency
        self.budget_total = None if budget_total is None else str(budget_total)
        self.max_budget_per_hour = None if max_budget_per_hour is None else str(max_budget_per_hour)
        self.prices = dict(prices or {})
        self.provider = provider
        self.clock = clock
        self.checkpoint_s = checkpoint_s
        """Expected checkpoint time, added to the budget horizon (a stop is followed by a checkpoint)."""
        self._ledger: Ledger | None = None
        self._job: Job | None = None
        self._leases: list[int] = []
        self._ckpt_steps: set[int] = set()
        """Steps whose checkpoint this run recorded (the cursor at capture, ctx.committed once committed)."""
        self.budget_stopped = False
        self.status: BillingStatus | None = None
        """The job's money after the last hook (rank 0)."""

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_ledger"] = None  # a connection does not cross processes; reopened in on_fit_start
        return state

    def _now(self) -> int:
        return int(self.clock())

    def _pricing(self, ctx: TrainContext, accelerator: str) -> LeasePricing:
        return lease_pricing(self.prices, ctx.plan, accelerator)

    def on_fit_start(self, ctx: TrainContext) -> None:
        """Open the ledger, recover a dead run's leases, record a resume, open this run's leases.

        ``ctx.takeover`` (an in-place replica taking over from a lost leader): the run goes on, so its open
        leases are adopted as they are (nothing recovered, no event)."""
        if ctx.rank != 0:
            return
        path = Path(self.ledger_path) if self.ledger_path else ctx.run_dir / LEDGER_FILE
        self._ledger = ledger = Ledger.open(path)
        if ctx.takeover:
            self._job = ledger.job(self.job_name or ctx.run_dir.resolve().name)
            self._leases = [le.id for le in ledger.leases(self._job, open_only=True)]
            self._ckpt_steps = {ctx.step}
            self._publish(ctx, self._now())
            return
        currency = self.currency or (ctx.plan.pricing.currency if ctx.plan.pricing is not None else "USD")
        name = self.job_name or ctx.run_dir.resolve().name
        self._job = job = ledger.start_job(name, currency=currency, budget_total=self.budget_total,
                                           max_budget_per_hour=self.max_budget_per_hour, run_dir=ctx.run_dir)
        now = self._now()
        stale = ledger.leases(job, open_only=True)
        if stale:
            died_at = max(le.last_seen_s for le in stale)
            if _last_state(ledger, job) != EventKind.PREEMPTION:  # else a notice already recorded it
                ledger.record_event(job, EventKind.PREEMPTION, at_s=died_at,
                                    detail={"detected": "leases left open by a run that died",
                                            "leases": [le.id for le in stale]})
            ledger.recover(job)
        if ctx.step > 0 or _last_state(ledger, job) == EventKind.PREEMPTION:
            ledger.record_event(job, EventKind.RESUME, at_s=now, step=ctx.step)
        host = socket.gethostname()
        kinds = ctx.rank_kinds or [ctx.device_kind] * ctx.world_size
        self._leases = []
        try:
            for rank, acc in enumerate(kinds):
                lease = ledger.open_lease(job, f"{host}/rank{rank}", acc, self._pricing(ctx, acc),
                                          provider=self.provider, at_s=now)
                self._leases.append(lease.id)
        except BaseException:
            for lease_id in self._leases:  # a refused lease must not leave the others running up charges
                ledger.close_lease(lease_id, now)
            raise
        self._ckpt_steps = {ctx.step}  # the checkpoint resumed from (or step 0) is on record already
        self._publish(ctx, now)

    def checkpoint_cursor(self, ctx: TrainContext) -> dict[str, Any]:
        """For ``CheckpointCallback(billing_cursor=...)``: record a checkpoint of ``ctx.step`` taken now, and
        return the cursor stored in the checkpoint's manifest (job, step, time, ledger)."""
        now = self._now()
        cursor: dict[str, Any] = {"step": ctx.step, "at_s": now}
        if ctx.rank == 0 and self._ledger is not None and self._job is not None:
            if ctx.step not in self._ckpt_steps:
                self._ledger.record_event(self._job, EventKind.CHECKPOINT, at_s=now, step=ctx.step)
                self._ckpt_steps.add(ctx.step)
            cursor.update(job=self._job.name, ledger=str(self._ledger.path))
        return cursor

    def record_preemption(self, ctx: TrainContext, detail: Mapping[str, Any] | None = None) -> None:
        """Record a preemption now (e.g. on a provider's notice), on rank 0."""
        if ctx.rank == 0 and self._ledger is not None and self._job is not None:
            self._ledger.record_event(self._job, EventKind.PREEMPTION, at_s=self._now(), step=ctx.step,
                                      detail=detail)

    def on_step_end(self, ctx: TrainContext) -> None:
        """Heartbeat, checkpoint events, and the total-budget stop."""
        if ctx.rank != 0 or self._ledger is None or self._job is None:
            return
        ledger, job, now = self._ledger, self._job, self._now()
        ledger.heartbeat(job, at_s=now)
        info = ctx.committed
        if info is not None and info.step not in self._ckpt_steps:
            self._ckpt_steps.add(info.step)
            ledger.record_event(job, EventKind.CHECKPOINT, at_s=info.at_s, step=info.step,
                                detail={"seconds": info.seconds})
        status = next_interval_exceeds(ledger, job, now, ctx.metrics.step_time_s, self.checkpoint_s)
        if status is not None and status.stop and not self.budget_stopped:
            self.budget_stopped = True
            ledger.record_event(job, EventKind.BUDGET_STOP, at_s=now, step=ctx.step,
                                detail={"spent": str(status.spent), "projected": str(status.projected),
                                        "budget": str(status.budget), "horizon_s": status.horizon_s})
            ctx.request_stop(f"budget: {status.projected} {job.currency} by the end of the next "
                             f"{status.horizon_s} s would exceed the total budget {status.budget}")
        self._publish(ctx, now)

    def on_fit_end(self, ctx: TrainContext) -> None:
        """Close this run's leases and record the stop."""
        if ctx.rank != 0 or self._ledger is None or self._job is None:
            return
        now = self._now()
        for lease_id in self._leases:
            if self._ledger.lease(lease_id).end_s is None:  # an in-place loss ended its lease already
                self._ledger.close_lease(lease_id, now)
        notice = ctx.notice
        if notice is not None:  # stopped by a preemption notice: the relaunch will resume
            self._ledger.record_event(self._job, EventKind.PREEMPTION, at_s=now, step=ctx.step,
                                      detail={"notice": notice.source})
        elif not self.budget_stopped:
            self._ledger.record_event(self._job, EventKind.STOP, at_s=now, step=ctx.step)
        self._publish(ctx, now)
        self._ledger.close()
        self._ledger = None

    def _publish(self, ctx: TrainContext, now: int) -> None:
        assert self._ledger is not None and self._job is not None
        ledger, job = self._ledger, self._job
        spent = ledger.spent(job, at_s=now)
        credits = sum((c.ticks for c in ledger.credits(job)), 0)
        preemptions = sum(1 for e in ledger.events(job) if e.kind == EventKind.PREEMPTION)
        fresh = ledger.job(job.id)
        self.status = BillingStatus(
            currency=job.currency, spent=spent, credits=ticks_to_decimal(credits),
            cost_per_hour=ledger.burn_rate(job), budget_total=fresh.budget_total,
            preemptions=preemptions, ledger=str(ledger.path), job=job.name,
        )


class MetricsCallback(Callback):
    """Serves the job's Prometheus metrics from rank 0 on ``host:port`` (127.0.0.1, port 0 = a free one).

    The URL is written to ``run_dir/metrics.json``. ``linger_s`` keeps the endpoint up that long after
    training ends (for a last scrape). Money comes from ``billing`` (list it first).
    """

    def __init__(self, *, job: str | None = None, host: str = "127.0.0.1", port: int = 0, linger_s: float = 0.0,
                 checkpoints: Any = None, billing: BillingCallback | None = None):
        """``checkpoints``: the run's ``CheckpointCallback`` (its ``checkpointer.stats`` give the checkpoint
        count and seconds); without it, ``ctx.committed`` is read. ``billing``: the run's billing callback
        (the same object in the rank: callbacks are pickled together), whose ``status`` gives the money."""
        self.job_name = job
        self.checkpoints = checkpoints
        self.billing = billing
        self.host = host
        self.port = port
        self.linger_s = linger_s
        self.exporter: MetricsExporter | None = None
        self._checkpoints = 0
        self._checkpoint_s_total = 0.0
        self._last_ckpt: CommittedCheckpoint | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["exporter"] = None
        return state

    def on_fit_start(self, ctx: TrainContext) -> None:
        """Start the endpoint and publish where it is."""
        if ctx.rank != 0:
            return
        self.exporter = MetricsExporter(self.job_name or ctx.run_dir.resolve().name, self.host, self.port).start()
        self._last_ckpt = ctx.committed
        ctx.run_dir.mkdir(parents=True, exist_ok=True)
        tmp = ctx.run_dir / (ENDPOINT_FILE + ".tmp")
        tmp.write_text(json.dumps({"url": self.exporter.url, "host": self.host, "port": self.exporter.port}))
        tmp.replace(ctx.run_dir / ENDPOINT_FILE)
        self._update(ctx)

    def on_step_end(self, ctx: TrainContext) -> None:
        """Publish the step's figures."""
        if ctx.rank == 0 and self.exporter is not None:
            self._update(ctx)

    def on_fit_end(self, ctx: TrainContext) -> None:
        """Publish the final figures, linger, stop serving."""
        if ctx.rank != 0 or self.exporter is None:
            return
        self._update(ctx)
        if self.linger_s > 0:
            time.sleep(self.linger_s)
        self.exporter.stop()
        self.exporter = None

    def _update(self, ctx: TrainContext) -> None:
        assert self.exporter is not None
        m = ctx.metrics
        kinds = ctx.rank_kinds or [ctx.device_kind] * ctx.world_size
        shares = list(m.shares or ctx.shares)
        total_share = sum(shares) or 1
        ranks = []
        for r, acc in enumerate(kinds):
            ranks.append(RankState(
                r, acc, m.step_times_s[r] if r < len(m.step_times_s) else m.step_time_s,
                m.compute_times_s[r] if r < len(m.compute_times_s) else None,
                shares[r] if r < len(shares) else 0, (shares[r] if r < len(shares) else 0) / total_share))
        stats = getattr(getattr(self.checkpoints, "checkpointer", None), "stats", None)
        if stats is not None:
            # saves are asynchronous: the time training waited is what a checkpoint cost the run
            self._checkpoints = int(stats.num_saves)
            self._checkpoint_s_total = float(stats.blocked_s)
            last_s: float | None = float(stats.last_write_s) if stats.num_saves else None
        else:
            info = ctx.committed
            if info is not None and info != self._last_ckpt:
                self._last_ckpt = info
                self._checkpoints += 1
                self._checkpoint_s_total += info.seconds
            last_s = self._last_ckpt.seconds if self._last_ckpt is not None else None
        bill = self.billing.status if self.billing is not None else None
        loss = m.loss if m.loss == m.loss else None  # NaN before the first step: leave the gauge empty
        self.exporter.update(JobState(
            steps=ctx.step, tokens=m.tokens_total, tokens_per_s=m.tokens_per_s, mfu=m.mfu, loss=loss,
            ranks=ranks, world_size=ctx.world_size, currency=bill.currency if bill else None,
            cost=float(bill.spent) if bill else None, credits=float(bill.credits) if bill else None,
            cost_per_hour=float(bill.cost_per_hour) if bill else None,
            budget_remaining=(None if bill is None or bill.budget_total is None
                              else float(bill.budget_total - bill.spent)),
            preemptions=bill.preemptions if bill else 0, checkpoints=self._checkpoints,
            checkpoint_s=last_s, checkpoint_s_total=self._checkpoint_s_total))
