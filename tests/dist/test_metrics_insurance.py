"""Insurance end to end: a supervised run loses a rank after step 5 (checkpoint at step 4), resumes, and
the ledger credits exactly the work redone (checkpoint of step 4 -> loss), itemised per lease; the
checkpoint manifests carry the billing cursor."""

from __future__ import annotations

import os
import signal
import time
from decimal import Decimal
from pathlib import Path

import pytest
import torch

from starverse.billing import CreditKind, EventKind, LeasePricing, Ledger, PricingMode, check_ledger
from starverse.checkpoint import CheckpointCallback, CheckpointStore
from starverse.elastic.supervisor import Supervisor
from starverse.metrics.callbacks import BillingCallback
from starverse.runtime.callbacks import Callback, TrainContext
from starverse.runtime.cluster import Cluster, local_plan
from starverse.runtime.launch import RankSpec

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


class TinyLM(torch.nn.Module):
    """Embedding -> logits."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, 16)
        self.fc = torch.nn.Linear(16, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(self.emb(ids)))


class Pace(Callback):
    """Rank 0 waits after each step so that steps fall in different seconds (the ledger's unit)."""

    def on_step_end(self, ctx: TrainContext) -> None:
        if ctx.rank == 0:
            time.sleep(1.0)


class KillAfterCommit(Callback):
    """SIGKILL rank 1 after step 5, once the step-4 checkpoint is committed (a lost spot device)."""

    def on_step_end(self, ctx: TrainContext) -> None:
        if ctx.rank == 1 and ctx.step == 5:
            deadline = time.monotonic() + 60
            while not (ctx.run_dir / "checkpoints" / "step-4").is_dir():
                assert time.monotonic() < deadline, "checkpoint never committed"
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)


def test_preemption_credits_the_work_redone_since_the_checkpoint_resumed_from(tmp_path: Path):
    ranks = (RankSpec(0, "cpu", "cpu", 1), RankSpec(1, "cpu", "cpu", 1))
    cluster = Cluster(plan=local_plan(ranks, "tiny", 1, 16, 8, precision="fp32"), ranks=ranks)
    billing = BillingCallback(job="insured", prices={"cpu": LeasePricing(PricingMode.SPOT, Decimal("3.6"))})
    ckpt = CheckpointCallback(interval_steps=2, billing_cursor=billing.checkpoint_cursor)
    sup = Supervisor(cluster, tmp_path, checkpoint=ckpt,
                     callbacks=lambda attempt: [Pace(), billing] + ([KillAfterCommit()] if attempt == 1 else []),
                     trainer_options={"rebalance_every": 0, "collective_timeout_s": 30.0},
                     replan=lambda c, survivors, lost: c)
    data = [torch.randint(0, 64, (600,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(2)]
    out = sup.run(lambda c: TinyLM(), data, per_device_batch_size=2, max_steps=6, seq_len=16)
    assert [a.outcome for a in out.attempts] == ["lost", "completed"] and out.attempts[1].resumed_from == 4

    with Ledger.open(tmp_path / "ledger.sqlite") as led:
        job = led.job("insured")
        events = led.events(job)
        assert [(e.kind, e.step) for e in events] == [
            (EventKind.CHECKPOINT, 2), (EventKind.CHECKPOINT, 4), (EventKind.PREEMPTION, None),
            (EventKind.RESUME, 4), (EventKind.CHECKPOINT, 6), (EventKind.STOP, 6)]
        ckpt4, lost = events[1], events[2]
        assert lost.detail["detected"] == "leases left open by a run that died"
        first_leases = [le for le in led.leases(job) if le.end_s == lost.at_s]
        assert len(first_leases) == 2  # both ranks' leases closed at the last heartbeat
        credits = led.credits(job)
        # the step-5 work (checkpoint of step 4 -> loss) on both devices; nothing ran between loss and resume
        assert [(c.kind, c.lease_id, c.start_s, c.end_s) for c in credits] == [
            (CreditKind.REDO, le.id, ckpt4.at_s, lost.at_s) for le in first_leases]
        assert lost.at_s > ckpt4.at_s
        assert all(c.ticks == 3_600_000 * (lost.at_s - ckpt4.at_s) for c in credits)
        assert check_ledger(led).ok
    cursor = CheckpointStore(tmp_path / "checkpoints").get(4).billing_cursor
    assert cursor["job"] == "insured" and cursor["step"] == 4 and cursor["at_s"] == ckpt4.at_s
