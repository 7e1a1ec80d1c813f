"""BillingCallback and MetricsCallback driven step by step with a fake clock: leases per rank, prices from
the plan, checkpoint events, a run that dies (its leases recovered, preemption and resume recorded,
credits itemised), the per-hour cap refusing a start, and the callbacks surviving pickling."""

from __future__ import annotations

import pickle
from decimal import Decimal
from pathlib import Path

import pytest
import torch

from starverse.billing import CreditKind, EventKind, LeasePricing, Ledger, PricingMode, check_ledger
from starverse.errors import BudgetExceededError
from starverse.metrics.callbacks import BillingCallback, MetricsCallback
from starverse.plan import Group, Plan, Pricing, Stage, TrainSpec
from starverse.runtime.callbacks import CommittedCheckpoint, Notice, StepMetrics, TrainContext

T0 = 1_700_000_000


class Clock:
    def __init__(self) -> None:
        self.t = float(T0)

    def __call__(self) -> float:
        return self.t


def make_ctx(run_dir: Path, step: int = 0, pricing: Pricing | None = None) -> TrainContext:
    plan = Plan(model="tiny", train=TrainSpec(seq_len=8, global_batch=4),
                groups=[Group(replicas=1, stages=[Stage(accelerator="rtx-4090", layers=1)]),
                        Group(replicas=1, stages=[Stage(accelerator="t4", layers=1)])],
                pricing=pricing or Pricing(currency="USD", price_per_hour={"rtx-4090": 0.36, "t4": 0.18}))
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return TrainContext(rank=0, world_size=2, plan=plan, run_dir=run_dir, step=step, model=model, optimizer=opt,
                        lr_scheduler=None, sampler=None, group=None, device_kind="rtx-4090",
                        rank_kinds=["rtx-4090", "t4"], shares=[3, 1],
                        metrics=StepMetrics(step_time_s=10.0, step_times_s=[10.0, 9.0], shares=[3, 1],
                                            tokens_step=32))


def step(ctx: TrainContext, clock: Clock, cbs: list, seconds: float = 10.0, checkpoint: bool = False) -> None:
    clock.t += seconds
    ctx.step += 1
    ctx.metrics.tokens_total += 32
    ctx.metrics.loss = 1.0 / ctx.step
    if checkpoint:
        ctx.committed = CommittedCheckpoint(step=ctx.step, at_s=int(clock.t), seconds=0.5, path="", reason="interval")
    for cb in cbs:
        cb.on_step_end(ctx)


def test_run_dies_then_resumes_with_itemised_credits(tmp_path: Path):
    clock = Clock()
    ctx = make_ctx(tmp_path)
    billing = BillingCallback(job="j", clock=clock)
    billing.on_fit_start(ctx)
    for i in range(1, 7):
        step(ctx, clock, [billing], checkpoint=(i == 3))  # checkpoint after step 3, at T0+30
    # the process is killed after step 6 (T0+60): no on_fit_end; the relaunch comes 40 s later
    clock.t += 40
    ctx2 = make_ctx(tmp_path, step=3)  # resumed from the step-3 checkpoint
    copy = pickle.loads(pickle.dumps(billing))  # a started callback still pickles (without its connection)
    assert copy._ledger is None and copy._leases == billing._leases
    billing2 = BillingCallback(job="j", clock=clock)
    billing2.on_fit_start(ctx2)
    step(ctx2, clock, [billing2])
    billing2.on_fit_end(ctx2)
    with Ledger.open(tmp_path / "ledger.sqlite") as led:
        job = led.job("j")
        kinds = [(e.kind, e.at_s - T0) for e in led.events(job)]
        assert kinds == [(EventKind.CHECKPOINT, 30), (EventKind.PREEMPTION, 60), (EventKind.RESUME, 100),
                         (EventKind.STOP, 110)]
        leases = led.leases(job)
        assert [(le.accelerator, le.start_s - T0, le.end_s - T0) for le in leases] == [
            ("rtx-4090", 0, 60), ("t4", 0, 60), ("rtx-4090", 100, 110), ("t4", 100, 110)]
        assert led.spent_ticks(job) == (360_000 + 180_000) * 70
        credits = led.credits(job)
        # redone: steps 4-6 (T0+30..60) on both devices; no lease ran during the restart gap
        assert [(c.kind, c.lease_id, c.seconds, c.ticks) for c in credits] == [
            (CreditKind.REDO, 1, 30, 360_000 * 30), (CreditKind.REDO, 2, 30, 180_000 * 30)]
        assert check_ledger(led).ok
    assert billing2.status is not None and billing2.status.preemptions == 1
    assert billing2.status.credits == Decimal("0.004500")


def test_metrics_callback_publishes_a_consistent_snapshot(tmp_path: Path):
    clock = Clock()
    ctx = make_ctx(tmp_path)
    # pickled together (as into a rank): the metrics callback's reference is the same billing callback
    billing0 = BillingCallback(job="m", clock=clock, budget_total="10")
    billing, metrics = pickle.loads(pickle.dumps((billing0, MetricsCallback(job="m", billing=billing0))))
    assert metrics.billing is billing
    billing.clock = clock  # the copy's clock is a copy too: drive it with the test's
    billing.on_fit_start(ctx)
    metrics.on_fit_start(ctx)
    try:
        assert (tmp_path / "metrics.json").exists()
        step(ctx, clock, [billing, metrics], checkpoint=True)
        step(ctx, clock, [billing, metrics])
        state = metrics.exporter.collector.state
        assert state.steps == 2 and state.tokens == 64
        assert [(r.rank, r.accelerator, r.share) for r in state.ranks] == [(0, "rtx-4090", 0.75), (1, "t4", 0.25)]
        assert state.cost == pytest.approx(0.54 * 20 / 3600)
        assert state.cost_per_hour == pytest.approx(0.54)
        assert state.budget_remaining == pytest.approx(10 - 0.54 * 20 / 3600)
        assert state.checkpoints == 1 and state.checkpoint_s == 0.5
    finally:
        billing.on_fit_end(ctx)
        metrics.on_fit_end(ctx)
    assert metrics.exporter is None


def test_lease_above_max_budget_per_hour_refuses_the_start_and_leaves_nothing_open(tmp_path: Path):
    clock = Clock()
    ctx = make_ctx(tmp_path)
    prices = {"t4": LeasePricing(PricingMode.SPOT, Decimal("5"))}
    billing = BillingCallback(job="b", clock=clock, max_budget_per_hour="1", prices=prices)
    with pytest.raises(BudgetExceededError, match=r"lease of '.*/rank1' \(t4\) refused: job 'b' would cost "
                                                  r"5.360000 USD/h, above max_budget_per_hour 1.000000"):
        billing.on_fit_start(ctx)
    with Ledger.open(tmp_path / "ledger.sqlite") as led:
        assert led.leases(open_only=True) == []
        assert [(le.accelerator, le.end_s) for le in led.leases()] == [("rtx-4090", T0)]


def test_non_zero_ranks_do_nothing(tmp_path: Path):
    ctx = make_ctx(tmp_path)
    ctx.rank = 1
    cb = BillingCallback(job="x")
    cb.on_fit_start(ctx)
    cb.on_step_end(ctx)
    cb.on_fit_end(ctx)
    assert not (tmp_path / "ledger.sqlite").exists()


def test_notice_stop_is_a_preemption_and_checkpoint_stats_feed_the_metrics(tmp_path: Path):
    from types import SimpleNamespace

    clock = Clock()
    ctx = make_ctx(tmp_path)
    stats = SimpleNamespace(num_saves=0, blocked_s=0.0, last_write_s=0.0)
    ckpt = SimpleNamespace(checkpointer=SimpleNamespace(stats=stats))  # what CheckpointCallback exposes
    billing = BillingCallback(job="n", clock=clock)
    metrics = MetricsCallback(job="n", checkpoints=ckpt, billing=billing)
    billing.on_fit_start(ctx)
    metrics.on_fit_start(ctx)
    try:
        step(ctx, clock, [billing, metrics])
        cursor = billing.checkpoint_cursor(ctx)  # CheckpointCallback calls this when it saves
        stats.num_saves, stats.blocked_s, stats.last_write_s = 1, 0.25, 1.5
        step(ctx, clock, [billing, metrics])
        state = metrics.exporter.collector.state
        assert (state.checkpoints, state.checkpoint_s_total, state.checkpoint_s) == (1, 0.25, 1.5)
        ctx.notice = Notice(source="SIGTERM")
    finally:
        billing.on_fit_end(ctx)
        metrics.on_fit_end(ctx)
    assert cursor == {"step": 1, "at_s": T0 + 10, "job": "n", "ledger": str(tmp_path / "ledger.sqlite")}
    with Ledger.open(tmp_path / "ledger.sqlite") as led:
        evs = led.events(led.job("n"))
        assert [(e.kind, e.at_s - T0, e.step) for e in evs] == [
            (EventKind.CHECKPOINT, 10, 1), (EventKind.PREEMPTION, 20, 2)]
        assert evs[1].detail == {"notice": "SIGTERM"}
        # the redo (checkpoint -> notice) is insured even before the job resumes
        assert [(c.kind, c.seconds) for c in led.credits(led.job("n"))] == [(CreditKind.REDO, 10)] * 2


def test_checkpoint_recorded_once_whether_seen_at_capture_or_at_commit(tmp_path: Path):
    # the cursor fires when a save starts; CheckpointCallback publishes ctx.committed once the
    # save committed, a step or more later, while the next save may already have started
    clock = Clock()
    ctx = make_ctx(tmp_path)
    billing = BillingCallback(job="c", clock=clock)
    billing.on_fit_start(ctx)

    def committed(step: int) -> None:
        ctx.committed = CommittedCheckpoint(step=step, at_s=T0 + 10 * step, seconds=0.1, path="", reason="interval")

    step(ctx, clock, [billing])
    billing.checkpoint_cursor(ctx)  # step 1 captured
    step(ctx, clock, [billing])
    committed(1)
    step(ctx, clock, [billing])
    billing.checkpoint_cursor(ctx)  # step 3 captured while step 1 is the last committed
    step(ctx, clock, [billing])
    committed(3)
    step(ctx, clock, [billing])
    committed(5)  # a save the cursor did not see (e.g. another checkpoint callback) is still recorded
    step(ctx, clock, [billing])
    billing.on_fit_end(ctx)
    with Ledger.open(tmp_path / "ledger.sqlite") as led:
        got = [(e.step, e.at_s - T0) for e in led.events(led.job("c")) if e.kind == EventKind.CHECKPOINT]
    assert got == [(1, 10), (3, 30), (5, 50)]
