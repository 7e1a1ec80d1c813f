"""The one place a job's callbacks are built, in a fixed order.

Every attempt of a supervised job runs, on every rank, in this order:

1. ``PreemptionCallback``: polls the notice sources and agrees a notice over all ranks (sets ``ctx.notice``);
2. ``CheckpointCallback``: periodic saves at the Young/Daly interval, the emergency save after a notice
   (reads ``ctx.notice``, publishes ``ctx.committed``);
3. ``BillingCallback``: leases, heartbeats, checkpoint/preemption events, budgets (reads ``ctx.committed``
   and ``ctx.notice``; its manifest cursor is called by the checkpoint callback);
4. ``MetricsCallback``: the Prometheus exporter (reads the checkpoint callback's stats and the billing
   callback's ``status``);
5. the supervisor's ``ProgressCallback`` (added by the supervisor, always last).

Callbacks hand values to each other through typed ``TrainContext`` fields or references to one another
(pickled together into each rank, so a reference stays the same object there), never string keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from starverse.billing.ledger import LEDGER_FILE
from starverse.checkpoint.callback import CheckpointCallback
from starverse.elastic.job import JobPrices, TrainJob
from starverse.elastic.notice import (
    FileNotice,
    HttpNotice,
    NoticeSource,
    SignalNotice,
    answers_ok,
    aws_spot_notice,
    gcp_preemption_notice,
)
from starverse.elastic.preemption import PreemptionCallback
from starverse.metrics.callbacks import BillingCallback, MetricsCallback
from starverse.runtime.callbacks import Callback


@dataclass(frozen=True)
class JobCallbacks:
    """A job's callbacks, built by :func:`build_callbacks`."""

    preemption: PreemptionCallback
    """Notice sources: SIGTERM, plus the job's ``notice_file`` / ``notice_url``."""
    checkpoint: CheckpointCallback
    """Checkpoint insurance."""
    billing: BillingCallback | None
    """The per-second ledger (None: billing disabled)."""
    metrics: MetricsCallback | None
    """The Prometheus exporter (None: disabled)."""

    @property
    def accounting(self) -> list[Callback]:
        """Billing then metrics: what comes after the checkpoint callback."""
        return [cb for cb in (self.billing, self.metrics) if cb is not None]

    def ordered(self) -> list[Callback]:
        """All of them in the order they run (see the module docstring)."""
        return [self.preemption, self.checkpoint, *self.accounting]


def notice_sources(job: TrainJob) -> list[NoticeSource]:
    """SIGTERM, plus the job's notice file and notice URL (``aws``, ``gcp`` or a URL answering 200 when
    preempted). Every source is picklable: it crosses into each rank process."""
    ck = job.checkpoint
    sources: list[NoticeSource] = [SignalNotice()]
    if ck.notice_file:
        sources.append(FileNotice(ck.notice_file))
    if ck.notice_url == "aws":
        sources.append(aws_spot_notice())
    elif ck.notice_url == "gcp":
        sources.append(gcp_preemption_notice())
    elif ck.notice_url:
        sources.append(HttpNotice(ck.notice_url, answers_ok, interval_s=ck.notice_poll_s))
    return sources


def build_callbacks(job: TrainJob, *, mtbf_s: float, prices: JobPrices | None) -> JobCallbacks:
    """The job's callbacks in their fixed order. ``prices``: the leases' pricing (None: billing disabled)."""
    run_dir = Path(job.run_dir)
    bill_cfg = job.billing
    billing: BillingCallback | None = None
    if bill_cfg.enabled and prices is not None:
        billing = BillingCallback(
            job=bill_cfg.job or run_dir.name, ledger_path=Path(bill_cfg.ledger or run_dir / LEDGER_FILE),
            currency=prices.currency, budget_total=bill_cfg.budget_total,
            max_budget_per_hour=bill_cfg.max_budget_per_hour, prices=prices.prices,
        )
    ck = job.checkpoint
    checkpoint = CheckpointCallback(
        ck.dir, interval_steps=ck.interval_steps, mtbf_s=mtbf_s, max_interval_s=ck.max_interval_s,
        keep_last=ck.keep_last, keep_every=ck.keep_every, async_save=ck.async_save,
        billing_cursor=billing.checkpoint_cursor if billing is not None else None,
    )
    metrics = None
    if job.metrics.enabled:
        metrics = MetricsCallback(job=billing.job_name if billing else None, port=job.metrics.port,
                                  linger_s=job.metrics.linger_s, checkpoints=checkpoint, billing=billing)
    return JobCallbacks(PreemptionCallback(notice_sources(job), grace_s=ck.grace_s), checkpoint, billing, metrics)
