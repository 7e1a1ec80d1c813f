"""In-place recovery (torchft) when a replica is sharded inside: 2 replicas x 2 ranks, ZeRO-1 in each replica.

Each group of the plan is one replica; its two ranks shard AdamW's state over the replica's own gloo world, and
torchft's group of shard ``s`` sums shard ``s``'s gradients over the replicas. SIGKILL one rank of replica 1
mid-step: the launcher stops its partner (a replica loss, not a code error), replica 0 redoes the step in flight
with the whole global batch and finishes; or a replacement replica (two new processes) heals shard by shard from
replica 0 and trains the rest. Losses and final weights equal one process's on the same batches.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from helpers import SEQ, TinyLM, reference_training
from helpers import ramp_tokens as _tokens
from starverse.elastic.inplace import InplaceLauncher
from starverse.errors import LossCause
from starverse.plan import Group, Plan, Stage, TrainSpec
from starverse.runtime.callbacks import Callback, TrainContext
from starverse.runtime.cluster import Cluster
from starverse.runtime.data import PackedDataset
from starverse.runtime.ft import INPLACE_LOG
from starverse.runtime.launch import RankSpec
from starverse.runtime.steps import batch_loss
from starverse.runtime.trainer import Trainer, _recovery_for, inplace_refusal
from starverse.testing import KillReplicaMidStep, WaitForReplicas

pytest.importorskip("torchft", reason="recovery: in-place needs torchft (the train extra)")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

MB, GB, STEPS = 2, 12, 5


@dataclass
class _Moments(Callback):
    """Each rank of the leader replica writes how many optimizer-state numbers it holds at the end."""

    def on_fit_end(self, ctx: TrainContext) -> None:
        n = sum(t.numel() for st in ctx.optimizer.state.values() for t in st.values() if t.dim())
        (ctx.run_dir / f"moments{ctx.rank}.json").write_text(json.dumps(n))


def _plan(zero: int = 1, sizes: tuple[int, ...] = (2, 2)) -> Plan:
    return Plan(model="tiny", train=TrainSpec(seq_len=SEQ, global_batch=GB, precision="fp32", zero_stage=zero),
                groups=[Group(replicas=n, stages=[Stage(accelerator="cpu", layers=1)]) for n in sizes])


def test_zero1_groups_run_in_place_and_other_sharded_plans_fall_back_with_one_line():
    assert inplace_refusal(_plan()) is None and _recovery_for("in-place", _plan()) == "in-place"
    assert inplace_refusal(_plan(2)) == "ZeRO-2 inside a replica (sharded replicas are built for ZeRO-1)"
    assert inplace_refusal(_plan(1, (4,))) == (
        "ZeRO over one group (each group is a sharded replica: a loss would leave none)")
    assert inplace_refusal(_plan(1, (2, 1))) == "sharded replicas (groups) of different sizes"


def _fit(tmp_path, launcher, callbacks):
    torch.manual_seed(0)
    model = TinyLM()
    initial = copy.deepcopy(model)
    ranks = tuple(RankSpec(r, "cpu", "cpu", num_threads=1) for r in range(4))
    trainer = Trainer(Cluster(plan=_plan(), ranks=ranks), run_dir=tmp_path, lr=2e-2, warmup_steps=2, grad_clip=0.5,
                      timeout_s=120, collective_timeout_s=30, recovery="in-place", launcher=launcher,
                      callbacks=[*callbacks, _Moments()], progress=False, tensorboard=False)
    res = trainer.fit(model, dataset=_tokens(), per_device_batch_size=MB, max_steps=STEPS, seq_len=SEQ,
                      global_batch=GB)
    assert res.steps == STEPS
    tokens = np.concatenate([t.numpy() for t in _tokens()]).astype(np.int32)
    ref_losses, ref_state = reference_training(initial, trainer, PackedDataset(tokens, SEQ), STEPS, GB, batch_loss)
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(ref_losses))
    state = model.state_dict()
    assert any((state[k] - initial.state_dict()[k]).abs().max() > 1e-3 for k in state)  # it trained
    for name, value in state.items():
        torch.testing.assert_close(value, ref_state[name], rtol=1e-5, atol=5e-5, msg=name)
    # ZeRO-1: each rank of the leader replica held AdamW's moments of a part of the parameters, the parts the whole
    held = [json.loads((tmp_path / f"moments{r}.json").read_text()) for r in (0, 1)]
    assert all(held) and sum(held) == 2 * sum(p.numel() for p in model.parameters()), held
    events = [json.loads(line) for line in (tmp_path / INPLACE_LOG).read_text().splitlines()]
    return res, events


def test_a_lost_rank_loses_its_sharded_replica_the_other_finishes_exact(tmp_path):
    launcher = InplaceLauncher()
    res, events = _fit(tmp_path, launcher, [KillReplicaMidStep(replica=3, step=3)])
    # rank 3 (replica 1, shard 1) killed; the launcher stopped its partner, rank 2
    assert [(x.error.rank, x.error.cause) for x in launcher.losses] == [(3, LossCause.SIGNAL), (2, LossCause.REPLICA)]
    assert res.shares_history[-1][1] == (GB // MB,), res.shares_history  # the survivor took the whole batch
    assert [e["lost"] for e in events if e["event"] == "members"] == [[1]], events
    assert res.ranks[0].tokens > 0 and res.ranks[1].tokens > 0  # both shards of the survivor computed


def test_a_replacement_sharded_replica_heals_shard_by_shard(tmp_path):
    launcher = InplaceLauncher(replace_after_s=0.0)
    res, events = _fit(tmp_path, launcher, [KillReplicaMidStep(replica=3, step=2),
                                            WaitForReplicas(replicas=2, after_step=2, pause_s=1.5)])
    assert [x.error.rank for x in launcher.losses] == [3, 2]
    assert [(j.rank, j.warm) for j in launcher.joins] == [(2, False), (3, False)]
    sizes = [len(s) for _, s in res.shares_history]
    assert sizes[0] == 2 and sizes[-1] == 2, res.shares_history  # (a fast replacement may be in the redo quorum)
    assert res.ranks[2].tokens > 0 and res.ranks[3].tokens > 0  # the replacement's two shards trained
    assert [e["replica"] for e in events if e["event"] == "healed"] == [1], events  # once, from its first shard
