"""``accelerate()`` and the supervisor's re-plan plan with what the runtime executes (TP, ZeRO, recompute,
pipelines; issue 10 item 7): a model that does not fit plain data parallelism gets a sharded plan that trains,
the demo's plan stays plain data parallelism, in-place recovery keeps ZeRO-0 / TP 1 (ZeRO-1 only inside equal
replica groups: tests/dist/test_inplace_shard.py), and a re-plan after a loss
may change layout and resumes from the checkpoint.

"Does not fit" is made on purpose: the catalog's ``cpu`` memory is set (``Catalog.with_overrides``) between what
plain data parallelism needs and what ZeRO needs, found by bisection on the planner's own answers, so the test
does not depend on the cost model's exact figures.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from test_elastic_recovery import FIT, GLOBAL_BATCH, OPTS, KillAfterCommit, _data

import starverse
from starverse.catalog import load_catalog
from starverse.checkpoint import CheckpointCallback
from starverse.elastic.preemption import PreemptionCallback
from starverse.elastic.supervisor import Supervisor
from starverse.errors import InfeasiblePlanError
from starverse.plan import Group, Plan, Stage, TrainSpec
from starverse.planner.devices import RUNTIME_CAPS, plan_for_devices
from starverse.runtime import Trainer
from starverse.runtime.cluster import Cluster, executable_caps
from starverse.runtime.launch import RankSpec
from starverse.runtime.trainer import inplace_refusal

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SMALL = {
    "model_type": "llama", "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 256,
}
ONE_LAYER = {**SMALL, "num_hidden_layers": 1}
"""Cannot be cut into pipeline stages: what fits must shard or recompute (with 2 layers a pipeline fits first)."""


def _plain_fits(memory_gb: float, devices: dict[str, int], train: dict, model: dict) -> bool:
    catalog = load_catalog().with_overrides({"cpu": {"memory_gb": memory_gb}})
    plain = dataclasses.replace(RUNTIME_CAPS, max_pipeline_stages=1)
    try:
        plan_for_devices(model, devices, train=train, runtime_caps=plain, catalog=catalog, cpu_threads=1,
                         model_name="small")
    except InfeasiblePlanError:
        return False
    return True


def _tight_catalog(devices: dict[str, int], train: dict, model: dict = SMALL):
    """The catalog with the ``cpu`` memory just below what plain data parallelism of ``model`` needs (bisection)."""
    lo, hi = 0.5, 64.0  # plain DP does not fit at lo, fits at hi
    assert not _plain_fits(lo, devices, train, model) and _plain_fits(hi, devices, train, model)
    while hi - lo > 1e-4:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if _plain_fits(mid, devices, train, model) else (mid, hi)
    return load_catalog().with_overrides({"cpu": {"memory_gb": lo}})


def _is_plain(plan: Plan) -> bool:
    t = plan.train
    return (t.zero_stage, t.recompute, t.offload, max(s.tp for g in plan.groups for s in g.stages),
            max(g.num_stages for g in plan.groups)) == (0, "none", "none", 1, 1)


def test_the_demos_plan_stays_plain_data_parallelism():
    # the demo's call (starverse demo): Llama-2-7B scaled to 3M parameters on 2 CPU ranks
    cluster = starverse.accelerate(model_id="meta-llama/Llama-2-7b-hf", num_cpu_ranks=2, use_gpus=False,
                                   seq_len=128, global_batch=16, max_params=3_000_000)
    assert _is_plain(cluster.plan) and [g.replicas for g in cluster.plan.groups] == [2]
    assert not any(n.startswith("planner: not used") for n in cluster.notes)


def test_in_place_recovery_keeps_zero0_and_tp1():
    caps = executable_caps([RankSpec(i, "cpu", "cpu", 1) for i in range(2)], recovery="in-place")
    everything = executable_caps([RankSpec(i, "cpu", "cpu", 1) for i in range(2)])
    # pipelines: a replica may be one (runtime/ft_pipe.py), over one device kind (all replicas cut alike)
    assert (caps.max_tp, caps.max_pipeline_stages, caps.zero_stage, caps.offload) == \
        (1, everything.max_pipeline_stages, 0, "none")
    mixed = executable_caps([RankSpec(0, "cpu", "cpu", 1), RankSpec(1, "cpu-b", "cpu", 1)], recovery="in-place")
    assert (mixed.max_tp, mixed.max_pipeline_stages, mixed.zero_stage) == (1, 1, 0)
    # ZeRO only inside equal replica groups (runtime/ft_shard.py), on CPU ranks (a replica's own world is gloo)
    assert caps.sharded_replicas and mixed.sharded_replicas and not everything.sharded_replicas
    types = executable_caps([RankSpec(0, "cpu", "cpu", 1), RankSpec(1, "rtx-4090", "cuda:0", 1)], recovery="in-place")
    gpus = executable_caps([RankSpec(i, "rtx-4090", f"cuda:{i}", 1) for i in range(4)], recovery="in-place")
    assert not types.sharded_replicas and not gpus.sharded_replicas
    caps = executable_caps([RankSpec(i, "cpu", "cpu", 1) for i in range(2)])
    assert (caps.max_tp, caps.zero_stage, caps.recompute, caps.offload) == (None, None, None, "none")
    train = {"seq_len": 32, "global_batch": 8}
    tight = _tight_catalog({"cpu": 2}, {**train, "precision": "fp32"})
    cluster = starverse.accelerate(model_id=SMALL, num_cpu_ranks=2, use_gpus=False, recovery="in-place",
                                   catalog=tight, **train)
    t = cluster.plan.train
    # the model does not fit plain data parallelism here: the plan is a pipeline, which in-place recovery runs
    assert (t.zero_stage, t.offload, cluster.plan.groups[0].stages[0].tp) == (0, "none", 1)
    assert inplace_refusal(cluster.plan) is None


@pytest.mark.slow
def test_a_model_that_does_not_fit_data_parallelism_gets_a_sharded_plan_that_trains(tmp_path):
    train = {"seq_len": 32, "global_batch": 8}
    tight = _tight_catalog({"cpu": 2}, {**train, "precision": "fp32"}, ONE_LAYER)
    cluster = starverse.accelerate(model_id=ONE_LAYER, num_cpu_ranks=2, use_gpus=False, catalog=tight, **train)
    assert not any(n.startswith("planner: not used") for n in cluster.notes), cluster.notes
    t, (group,) = cluster.plan.train, cluster.plan.groups
    assert group.num_stages == 1 and group.replicas * group.stages[0].tp == 2
    assert t.zero_stage >= 1 or t.recompute != "none" or group.stages[0].tp > 1, cluster.notes
    with cluster.mixed_mesh():
        model = starverse.build_model(cluster.model_config)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 64, (2000,), generator=g).tolist() for _ in range(2)]
    res = Trainer(cluster, run_dir=tmp_path, rebalance_every=0, collective_timeout_s=30.0, progress=False).fit(
        model, data, per_device_batch_size=2, max_steps=2, seq_len=32, tokenizer="bytes")
    assert res.steps == 2 and all(np.isfinite(res.losses))


class BlockLM(torch.nn.Module):
    """A small causal LM in plain torch whose layers are an ``nn.ModuleList`` (an FSDP2 unit each)."""

    def __init__(self, vocab: int = 64, dim: int = 32):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(2))
        self.out = torch.nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(input_ids)
        h = h.cumsum(1) / torch.arange(1, h.shape[1] + 1).view(1, -1, 1)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.out(h)


@pytest.mark.slow
def test_a_replan_after_a_loss_may_change_layout_and_resumes_from_the_checkpoint(tmp_path):
    train = {"seq_len": FIT["seq_len"], "global_batch": GLOBAL_BATCH, "precision": "fp32"}
    tight = _tight_catalog({"cpu": 2}, train)
    # before the loss: plain data parallelism on 3 ranks (as given), checkpointed under that layout
    plan = Plan(model="small", train=TrainSpec(**train),
                groups=[Group(replicas=3, micro_batch=2, stages=[Stage(accelerator="cpu", layers=2)])])
    ranks = tuple(RankSpec(i, "cpu", "cpu", 1) for i in range(3))
    cluster = Cluster(plan=plan, ranks=ranks, model_config=dict(SMALL), catalog=tight)
    # the reference: one rank, the same global batch (the trajectory does not depend on the layout)
    one = Cluster(plan=plan.model_copy(update={"groups": [plan.groups[0].model_copy(update={"replicas": 1})]}),
                  ranks=ranks[:1], model_config=dict(SMALL))
    ref = Trainer(one, run_dir=tmp_path / "ref", **OPTS).fit(BlockLM(), _data(), **FIT)
    sup = Supervisor(
        cluster, tmp_path / "run", checkpoint=CheckpointCallback(interval_steps=2), preemption=PreemptionCallback(),
        callbacks=lambda attempt: [KillAfterCommit(rank=2, step=3, committed=2)] if attempt == 1 else [],
        trainer_options=OPTS,
    )
    out = sup.run(lambda c: BlockLM(), _data(), **FIT)
    assert [a.outcome for a in out.attempts] == ["lost", "completed"]
    assert out.attempts[1].resumed_from == 2
    new = sup.cluster.plan
    assert not _is_plain(new) and new.train.global_batch == GLOBAL_BATCH, sup.cluster.notes[-1]
    # same global batch, a sharded layout restored from the data-parallel checkpoint: the trajectory continues
    np.testing.assert_allclose(out.fit.losses, ref.losses[2:], rtol=1e-4)
