"""In-place recovery (torchft) when a replica is sharded inside: 2 replicas x 2 ranks, ZeRO-1 in each replica.

Each group of the plan is one replica; its two ranks shard AdamW's state over the replica's own gloo world, and
torchft's group of shard ``s`` sums shard ``s``'s gradients over the replicas. SIGKILL one rank of replica 1
mid-step: the launcher stops its partner (a replica loss, not a code error), replica 0 redoes the step in flight
with the whole global batch and finishes; or a replacement replica (two new processes) heals shard by shard from
replica 0 and trains the rest. Losses and final weights equal one process's on the same batches.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

import starverse
from helpers import SEQ, VOCAB, TinyLM, reference_training
from helpers import ramp_tokens as _tokens
from starverse.catalog import load_catalog
from starverse.checkpoint import CheckpointCallback
from starverse.elastic.inplace import InplaceLauncher
from starverse.elastic.supervisor import Supervisor
from starverse.errors import InfeasiblePlanError, LossCause
from starverse.plan import Group, Plan, Stage, TrainSpec
from starverse.runtime.callbacks import Callback, TrainContext
from starverse.planner.devices import plan_for_devices
from starverse.runtime.cluster import Cluster, executable_caps, local_plan
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
        n = sum((t.to_local() if hasattr(t, "to_local") else t).numel()  # a DTensor (FSDP2): its local shard
                for st in ctx.optimizer.state.values() for t in st.values() if t.dim())
        (ctx.run_dir / f"moments{ctx.rank}.json").write_text(json.dumps(n))
        blocks = [type(b).__name__ for b in getattr(ctx.model, "layers", ())]  # recompute wraps them
        (ctx.run_dir / f"blocks{ctx.rank}.json").write_text(json.dumps(blocks))


class BlockLM(torch.nn.Module):
    """TinyLM with its hidden layers in an ``nn.ModuleList`` (FSDP2's units: ZeRO-2/3 need blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 32)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(2))
        self.norm = torch.nn.LayerNorm(32)
        self.out = torch.nn.Linear(32, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.out(self.norm(h))


def _plan(zero: int = 1, sizes: tuple[int, ...] = (2, 2), offload: str = "none", recompute: str = "none") -> Plan:
    return Plan(model="tiny", train=TrainSpec(seq_len=SEQ, global_batch=GB, precision="fp32", zero_stage=zero,
                                              offload=offload, recompute=recompute),  # type: ignore[arg-type]
                groups=[Group(replicas=n, stages=[Stage(accelerator="cpu", layers=1)]) for n in sizes])


def test_sharded_groups_run_in_place_and_other_sharded_plans_fall_back_with_one_line():
    for zero in (1, 2, 3):
        assert inplace_refusal(_plan(zero)) is None and _recovery_for("in-place", _plan(zero)) == "in-place"
    assert inplace_refusal(_plan(3, offload="optimizer+params")) == "offload optimizer+params inside a replica"
    assert inplace_refusal(_plan(1, (4,))) == (
        "ZeRO over one group (each group is a sharded replica: a loss would leave none)")
    assert inplace_refusal(_plan(1, (2, 1))) == "sharded replicas (groups) of different sizes"


def _fit(tmp_path, launcher, callbacks, zero: int = 1, recompute: str = "none"):
    torch.manual_seed(0)
    model = TinyLM() if zero == 1 else BlockLM()
    initial = copy.deepcopy(model)
    ranks = tuple(RankSpec(r, "cpu", "cpu", num_threads=1) for r in range(4))
    trainer = Trainer(Cluster(plan=_plan(zero, recompute=recompute), ranks=ranks), run_dir=tmp_path, lr=2e-2, warmup_steps=2, grad_clip=0.5,
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
    # each rank of the leader replica held AdamW's moments of a part of the parameters (ZeRO-1) or a shard of every
    # parameter's (FSDP2), the parts the whole
    held = [json.loads((tmp_path / f"moments{r}.json").read_text()) for r in (0, 1)]
    assert all(held) and sum(held) == 2 * sum(p.numel() for p in model.parameters()), held
    events = [json.loads(line) for line in (tmp_path / INPLACE_LOG).read_text().splitlines()]
    return res, events, ref_state


def test_a_lost_rank_loses_its_sharded_replica_the_other_finishes_exact(tmp_path):
    launcher = InplaceLauncher()
    res, events, _ = _fit(tmp_path, launcher, [KillReplicaMidStep(replica=3, step=3)])
    # rank 3 (replica 1, shard 1) killed; the launcher stopped its partner, rank 2
    assert [(x.error.rank, x.error.cause) for x in launcher.losses] == [(3, LossCause.SIGNAL), (2, LossCause.REPLICA)]
    assert res.shares_history[-1][1] == (GB // MB,), res.shares_history  # the survivor took the whole batch
    assert [e["lost"] for e in events if e["event"] == "members"] == [[1]], events
    assert res.ranks[0].tokens > 0 and res.ranks[1].tokens > 0  # both shards of the survivor computed


def test_a_lost_rank_loses_its_zero2_replica_the_other_finishes_exact_and_its_checkpoint_resumes(tmp_path):
    # FSDP2 inside each replica (its blocks recomputed): gradients reduce-scattered in the replica, each shard
    # summed across replicas; 3 micro-batches a replica over 2 ranks: one rank pads with a zero-weight pass
    launcher, ckpt = InplaceLauncher(), tmp_path / "ckpt"
    res, events, ref_state = _fit(tmp_path / "run", launcher, [
        KillReplicaMidStep(replica=3, step=3), CheckpointCallback(ckpt, interval_steps=100, async_save=False)],
        zero=2, recompute="full")
    assert [(x.error.rank, x.error.cause) for x in launcher.losses] == [(3, LossCause.SIGNAL), (2, LossCause.REPLICA)]
    assert res.shares_history[-1][1] == (GB // MB,), res.shares_history
    assert [e["lost"] for e in events if e["event"] == "members"] == [[1]], events
    blocks = json.loads((tmp_path / "run" / "blocks0.json").read_text())
    assert len(blocks) == 2 and all("CheckpointWrapper" in b and b.startswith("FSDP") for b in blocks), blocks
    # the leader replica's final checkpoint (a 2-rank DCP checkpoint of FSDP2 shards) resumes on one plain rank
    model, ranks = BlockLM(), (RankSpec(0, "cpu", "cpu", num_threads=1),)
    trainer = Trainer(Cluster(plan=local_plan(ranks, "tiny", 1, SEQ, GB, precision="fp32"), ranks=ranks),
                      run_dir=tmp_path / "dp", callbacks=[CheckpointCallback(tmp_path / "dp" / "ckpt", final_save=False)],
                      timeout_s=120, progress=False, tensorboard=False)
    res = trainer.fit(model, dataset=_tokens(), per_device_batch_size=MB, max_steps=STEPS, seq_len=SEQ,
                      global_batch=GB, resume_from=ckpt)
    assert res.steps == STEPS  # resumed at the last step: nothing left to train
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, ref_state[name], rtol=1e-5, atol=5e-5, msg=name)


@pytest.mark.parametrize("zero", [1, 3])
def test_a_replacement_sharded_replica_heals_shard_by_shard(tmp_path, zero):
    launcher = InplaceLauncher(replace_after_s=0.0)
    res, events, _ = _fit(tmp_path, launcher, [KillReplicaMidStep(replica=3, step=2),
                                              WaitForReplicas(replicas=2, after_step=2, pause_s=3.0)], zero)
    assert [x.error.rank for x in launcher.losses] == [3, 2]
    assert [(j.rank, j.warm) for j in launcher.joins] == [(2, False), (3, False)]
    sizes = [len(s) for _, s in res.shares_history]
    assert sizes[0] == 2 and sizes[-1] == 2, res.shares_history  # (a fast replacement may be in the redo quorum)
    assert res.ranks[2].tokens > 0 and res.ranks[3].tokens > 0  # the replacement's two shards trained
    assert [e["replica"] for e in events if e["event"] == "healed"] == [1], events  # once, from its first shard


ONE_LAYER = {
    "model_type": "llama", "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 256,
}
"""One layer: no pipeline can hold it in less memory, so what fits where ZeRO-0 replicas do not must shard."""
PLANNED_GB = 8
PLANNED_RANKS = tuple(RankSpec(r, "cpu", "cpu", num_threads=1) for r in range(4))


def _inplace_fits(memory_gb: float, **caps: Any) -> bool:
    """Whether the in-place planner with its caps changed by ``caps`` finds a plan when a ``cpu`` rank has
    ``memory_gb``."""
    narrowed = dataclasses.replace(executable_caps(PLANNED_RANKS, "in-place"), **caps)
    catalog = load_catalog().with_overrides({"cpu": {"memory_gb": memory_gb}})
    try:
        plan_for_devices(ONE_LAYER, {"cpu": 4}, train={"seq_len": SEQ, "global_batch": PLANNED_GB, "precision": "fp32"},
                         runtime_caps=narrowed, catalog=catalog, cpu_threads=1, model_name="one-layer")
    except InfeasiblePlanError:
        return False
    return True


def _tight_catalog(**caps: Any) -> Any:
    """The memory cap of test_accelerate_caps: the catalog's ``cpu`` memory just below what the in-place planner
    with ``caps`` needs (bisection on the planner's own answers)."""
    lo, hi = 0.5, 64.0
    assert not _inplace_fits(lo, **caps) and _inplace_fits(hi, **caps)
    while hi - lo > 1e-4:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if _inplace_fits(mid, **caps) else (mid, hi)
    return load_catalog().with_overrides({"cpu": {"memory_gb": lo}})


def test_the_planner_proposes_fsdp_replica_groups_where_zero1_groups_do_not_fit():
    # below what ZeRO-0 replicas and ZeRO-1 groups need: ZeRO-2/3 groups (FSDP2 inside each replica)
    tight = _tight_catalog(max_zero_stage=1)
    cluster = starverse.accelerate(model_id=ONE_LAYER, ranks=PLANNED_RANKS, recovery="in-place", catalog=tight,
                                   seq_len=SEQ, global_batch=PLANNED_GB)
    plan = cluster.plan
    assert plan.train.zero_stage in (2, 3) and [g.replicas for g in plan.groups] == [2, 2], cluster.notes
    assert inplace_refusal(plan) is None and cluster.estimate is not None and cluster.estimate.fits


def test_the_planner_proposes_sharded_replicas_where_zero0_replicas_do_not_fit_and_one_survives_a_sigkill(tmp_path):
    # the catalog's cpu memory just below what ZeRO-0 replicas (of one rank or one pipeline) need
    tight = _tight_catalog(sharded_replicas=False)
    cluster = starverse.accelerate(model_id=ONE_LAYER, ranks=PLANNED_RANKS, recovery="in-place", catalog=tight,
                                   seq_len=SEQ, global_batch=PLANNED_GB)
    plan = cluster.plan
    assert not any(n.startswith("planner: not used") for n in cluster.notes), cluster.notes
    assert plan.train.zero_stage == 1 and len(plan.groups) >= 2, cluster.notes
    assert len({g.replicas for g in plan.groups}) == 1 and plan.groups[0].replicas >= 2
    assert inplace_refusal(plan) is None and cluster.estimate is not None and cluster.estimate.fits
    # with room for ZeRO-0 replicas the planner keeps them (the simplest setting within 5 %)
    roomy = starverse.accelerate(model_id=ONE_LAYER, ranks=PLANNED_RANKS, recovery="in-place", seq_len=SEQ,
                                 global_batch=PLANNED_GB)
    assert roomy.plan.train.zero_stage == 0 and len(roomy.plan.groups) == 1, roomy.notes

    torch.manual_seed(0)
    with cluster.mixed_mesh():
        model = starverse.build_model(cluster.model_config)
    initial = copy.deepcopy(model)
    launcher = InplaceLauncher()
    opts = {"lr": 2e-2, "warmup_steps": 2, "grad_clip": 0.5, "timeout_s": 180, "collective_timeout_s": 30,
            "recovery": "in-place", "launcher": launcher, "progress": False, "tensorboard": False}
    sup = Supervisor(cluster, tmp_path, checkpoint=CheckpointCallback(interval_steps=100),
                     callbacks=lambda attempt: [KillReplicaMidStep(replica=3, step=3)] if attempt == 1 else [],
                     trainer_options=opts)
    out = sup.run(lambda c: model, _tokens(), per_device_batch_size=MB, max_steps=STEPS, seq_len=SEQ,
                  global_batch=PLANNED_GB)
    [attempt] = out.attempts  # survived in place: no restart
    assert attempt.outcome == "completed" and out.final_step == STEPS, out.attempts
    # rank 3 (replica 1, shard 1) killed; the launcher stopped its partner, rank 2; replica 0 finished alone
    assert [(x.error.rank, x.error.cause) for x in launcher.losses] == [(3, LossCause.SIGNAL), (2, LossCause.REPLICA)]
    assert out.fit.shares_history[-1][1] == (PLANNED_GB // MB,), out.fit.shares_history
    tokens = np.concatenate([t.numpy() for t in _tokens()]).astype(np.int32)
    trainer = Trainer(cluster, **{k: v for k, v in opts.items() if k != "launcher"})
    ref_losses, ref_state = reference_training(initial, trainer, PackedDataset(tokens, SEQ), STEPS, PLANNED_GB,
                                               batch_loss)
    torch.testing.assert_close(torch.tensor(out.fit.losses), torch.tensor(ref_losses))
    state = model.state_dict()
    assert any((state[k] - initial.state_dict()[k]).abs().max() > 1e-3 for k in state)  # it trained
    for name, value in state.items():
        torch.testing.assert_close(value, ref_state[name], rtol=1e-5, atol=5e-5, msg=name)
