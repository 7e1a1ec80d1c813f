"""``starverse.accelerate()`` plans the local devices with the planner (``plan_for_devices`` within what the
runtime executes), falls back to one group per device kind only on a planner error (saying why), and the
planner's plan runs on real gloo ranks."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import starverse
from starverse.plan import Group, Plan, Stage, TrainSpec, save_plan
from starverse.planner import plan_for_devices
from starverse.planner.devices import EXECUTABLE
from starverse.runtime import Trainer
from starverse.runtime.launch import RankSpec

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class TinyLM(torch.nn.Module):
    """A small causal LM in plain torch (ranks do not import transformers: the test stays fast)."""

    def __init__(self, vocab: int = 64, dim: int = 16):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(vocab, dim)
        self.out = torch.nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.emb(input_ids).cumsum(1)))


def _two_cpu_cluster():
    return starverse.accelerate(model_id="meta-llama/Llama-2-7b-hf", num_cpu_ranks=2, use_gpus=False, seq_len=32,
                                global_batch=8, max_params=3_000_000)


def test_accelerate_uses_the_planners_plan_with_its_estimate():
    cluster = _two_cpu_cluster()
    assert cluster.scaled  # a 7B model on CPU ranks: the planner plans the scaled copy really trained
    # what the runtime executes on CPU ranks: everything but offload; CPU compute priced per rank's threads
    expected = plan_for_devices(cluster.model_config, {"cpu": 2}, policy="cost-performance",
                                train={"seq_len": 32, "global_batch": 8, "precision": "fp32"},
                                model_name=cluster.plan.model, runtime_caps=replace(EXECUTABLE, offload="none"),
                                cpu_threads=cluster.ranks[0].num_threads).best
    assert cluster.plan == expected.plan
    assert cluster.estimate.step_time_s == pytest.approx(expected.estimate.step_time_s)
    g = cluster.plan.groups[0]
    assert (len(cluster.plan.groups), g.replicas, g.num_stages, g.stages[0].tp) == (1, 2, 1, 1)
    note = next(n for n in cluster.notes if n.startswith("plan:"))
    assert note == (
        f"plan: planned by the planner (objective throughput, for 'cost-performance'): {expected.layout()}; "
        f"estimate: step {expected.estimate.step_time_s:.4g} s, {expected.tokens_per_s:,.0f} tokens/s, "
        f"bottleneck {expected.estimate.bottleneck}")
    assert "planner: every device is owned (price 0)" in " ".join(cluster.notes)
    # the plan names the config really trained, so `starverse estimate` on it gives the same numbers (with the
    # catalog's CPU figures for ranks of this many threads, as the planner priced them)
    from starverse.catalog import load_catalog
    from starverse.costmodel import estimate
    from starverse.planner.devices import cpu_rank_catalog

    catalog = cpu_rank_catalog(load_catalog(), cluster.ranks[0].num_threads)
    assert estimate(cluster.plan, catalog).step_time_s == pytest.approx(cluster.estimate.step_time_s)


def test_a_batch_that_does_not_split_over_the_ranks_is_planned_as_a_pipeline():
    # 16 sequences cannot be split into whole micro-batches over 3 data-parallel replicas; since the runtime runs
    # pipelines, the planner's answer is one replica cut into 3 stages (it used to fall back per kind)
    cluster = starverse.accelerate(num_cpu_ranks=3, use_gpus=False, seq_len=32, global_batch=16)
    assert not any(n.startswith("planner: not used") for n in cluster.notes)
    (group,) = cluster.plan.groups
    assert group.replicas == 1 and sum(s.repeat for s in group.stages) == 3
    assert sum(s.layers * s.repeat for s in group.stages) == cluster.model_config["num_hidden_layers"]
    assert cluster.plan.train.global_batch == 16


def test_accelerate_falls_back_on_a_device_the_catalog_does_not_know(monkeypatch):
    import starverse.runtime.devices as devices

    monkeypatch.setattr(devices, "local_ranks", lambda n=None, g=None: [
        RankSpec(i, "cuda-mystery-gpu", "cpu", 1) for i in range(2)])
    cluster = starverse.accelerate(num_cpu_ranks=2, use_gpus=False, seq_len=32, global_batch=8)
    reason = next(n for n in cluster.notes if n.startswith("planner: not used"))
    assert reason.startswith("planner: not used (CatalogError: plan_for_devices: devices: unknown accelerator "
                             "'cuda-mystery-gpu'")
    assert [(g.replicas, g.stages[0].accelerator) for g in cluster.plan.groups] == [(2, "cuda-mystery-gpu")]


def test_an_explicit_plan_still_wins(tmp_path):
    plan = Plan(model="llama-tiny", train=TrainSpec(seq_len=32, global_batch=6, precision="fp32"),
                groups=[Group(replicas=2, micro_batch=1, stages=[Stage(accelerator="cpu", layers=4)])])
    save_plan(plan, tmp_path / "plan.yaml")
    cluster = starverse.accelerate(plan=tmp_path / "plan.yaml", num_cpu_ranks=2, use_gpus=False)
    assert cluster.plan == plan
    assert f"plan: given explicitly ({tmp_path / 'plan.yaml'})" in cluster.notes
    assert not any("planner" in n for n in cluster.notes)


@pytest.mark.slow
def test_the_planners_plan_runs_on_two_gloo_ranks(tmp_path):
    cluster = _two_cpu_cluster()
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 64, (2000,), generator=g).tolist() for _ in range(2)]
    res = Trainer(cluster, run_dir=tmp_path, rebalance_every=0, collective_timeout_s=30.0).fit(
        TinyLM(), data, per_device_batch_size=2, max_steps=2, seq_len=32)
    assert res.steps == 2 and res.global_batch == cluster.plan.train.global_batch == 8
    # equal CPU ranks in one planned group: the batch splits evenly, 2 micro-batches of 2 each
    assert [r.final_share for r in res.ranks] == [2, 2]
    assert all(torch.isfinite(torch.tensor(res.losses)))
