"""The supervisor decides on the launcher's error *type*, never on its text: a LostRankError drops the device
and re-plans, a RankCodeError retries on the same devices (whatever the messages say)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from helpers import TinyLM, ramp_tokens
from starverse.checkpoint import CheckpointCallback
from starverse.elastic.supervisor import Supervisor, replan_local
from starverse.errors import LossCause, LostRankError, RankCodeError, RankFailedError
from starverse.providers.local import LocalLauncher
from starverse.runtime.cluster import Cluster, local_plan
from starverse.runtime.launch import RankSpec

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


class FailFirst:
    """A launcher whose first launch fails with ``error`` (nothing runs); later ones run the ranks locally."""

    def __init__(self, error: RankFailedError):
        self.error, self.calls, self.local = error, 0, LocalLauncher()

    def notify(self, signum: int) -> int:
        return self.local.notify(signum)

    def launch(self, fn: Callable[..., Any], ranks: Sequence[RankSpec], **kw: Any) -> list[Any]:
        self.calls += 1
        if self.calls == 1:
            raise self.error
        return self.local.launch(fn, ranks, **kw)


def _cluster(n: int) -> Cluster:
    ranks = tuple(RankSpec(i, "cpu", "cpu", 1) for i in range(n))
    return Cluster(plan=local_plan(ranks, "tiny", 1, 16, 8, precision="fp32"), ranks=ranks)


def _supervise(tmp_path, error: RankFailedError) -> tuple[Supervisor, Any]:
    sup = Supervisor(_cluster(2), tmp_path, checkpoint=CheckpointCallback(interval_steps=2),
                     trainer_options={"rebalance_every": 0, "launcher": FailFirst(error)}, replan=replan_local)
    torch.manual_seed(0)
    out = sup.run(lambda c: TinyLM(), ramp_tokens(), resume_from=None, per_device_batch_size=2, max_steps=2,
                  seq_len=16)
    return sup, out


def test_a_lost_rank_is_dropped_whatever_its_message_says(tmp_path):
    # the text matches nothing the supervisor once parsed: only the type says "lost"
    lost = LostRankError("the spot instance went away", rank=1, device_kind="cpu", cause=LossCause.ACTOR_DIED,
                         node="10.0.0.7")
    sup, out = _supervise(tmp_path, lost)
    assert [a.outcome for a in out.attempts] == ["lost", "completed"]
    assert [len(a.device_kinds) for a in out.attempts] == [2, 1] and len(sup.cluster.ranks) == 1
    assert out.final_step == 2


def test_a_code_error_is_retried_on_the_same_devices_even_if_it_reads_like_a_loss(tmp_path):
    bug = RankCodeError("rank 1 (cpu, cpu) killed by signal SIGKILL without reporting", rank=1, device_kind="cpu",
                        error="ValueError: bad batch")
    sup, out = _supervise(tmp_path, bug)
    assert [a.outcome for a in out.attempts] == ["error", "completed"]
    assert [len(a.device_kinds) for a in out.attempts] == [2, 2] and len(sup.cluster.ranks) == 2
