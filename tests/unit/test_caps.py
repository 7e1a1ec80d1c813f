"""What the planner ranks on the devices it is given (``planner.devices``): the cost model prices CPU ranks'
collectives as gloo and DTensor run them, ties go to the simplest setting, and plans the runtime refuses are
left out."""

from __future__ import annotations

import dataclasses
import json

import pytest

from starverse.catalog import load_catalog
from starverse.costmodel import estimate
from starverse.errors import ConfigError, InfeasiblePlanError
from starverse.plan import Group, Plan, Stage, TrainSpec
from starverse.planner.devices import EXECUTABLE, RUNTIME_CAPS, cpu_rank_catalog, plan_for_devices, simplicity

MODEL = {
    "model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 8,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 128,
}
TRAIN = {"seq_len": 64, "global_batch": 8, "precision": "fp32"}


def _step_s(tmp_path, accelerator: str, tp: int = 1, zero: int = 0, catalog=None) -> float:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(MODEL))
    plan = Plan(model=str(cfg), train=TrainSpec(**TRAIN, zero_stage=zero),
                groups=[Group(replicas=2 // tp, micro_batch=2,
                              stages=[Stage(accelerator=accelerator, tp=tp, layers=8)])])
    return estimate(plan, catalog).step_time_s


def test_cpu_ranks_price_tp_and_zero3_as_gloo_runs_them(tmp_path, monkeypatch):
    # bench_parallel measures TP 2 at ~0.1x and ZeRO-3 at ~0.25-0.4x plain DP on 2 one-thread CPU ranks
    catalog = cpu_rank_catalog(load_catalog(), 1)
    dp = _step_s(tmp_path, "cpu", catalog=catalog)
    assert 0.05 < dp / _step_s(tmp_path, "cpu", tp=2, catalog=catalog) < 0.25
    assert 0.15 < dp / _step_s(tmp_path, "cpu", zero=3, catalog=catalog) < 0.6
    assert dp / _step_s(tmp_path, "cpu", zero=1, catalog=catalog) < 1.0  # ZeroRedundancyOptimizer's broadcasts
    # only CPU rows pay the measured per-call cost: a GPU's TP keeps NCCL's latency
    import starverse.costmodel.comm as comm

    before = (_step_s(tmp_path, "h100-80gb-sxm", tp=2), _step_s(tmp_path, "cpu", tp=2, catalog=catalog))
    monkeypatch.setattr(comm, "CPU_DTENSOR_COLLECTIVE_S", 10 * comm.CPU_DTENSOR_COLLECTIVE_S)
    after = (_step_s(tmp_path, "h100-80gb-sxm", tp=2), _step_s(tmp_path, "cpu", tp=2, catalog=catalog))
    assert after[0] == before[0] and after[1] > 5 * before[1]


def test_cpu_rank_catalog_scales_default_figures_and_keeps_measured_ones():
    base = load_catalog()
    one = cpu_rank_catalog(base, 1).accelerator("cpu")
    assert one.fp32_tflops == pytest.approx(base.accelerator("cpu").fp32_tflops / 5)
    assert "1/5 cores" in one.sources["fp32_tflops"]
    measured = base.with_overrides({"cpu": {"fp32_tflops": 0.9}})
    assert cpu_rank_catalog(measured, 1).accelerator("cpu").fp32_tflops == 0.9
    assert cpu_rank_catalog(base, 16).accelerator("cpu").fp32_tflops == base.accelerator("cpu").fp32_tflops


def test_ties_go_to_the_simplest_setting_and_refused_plans_are_left_out():
    caps = dataclasses.replace(EXECUTABLE, offload="none", max_pipeline_stages=1)
    result = plan_for_devices(MODEL, {"cpu": 2}, train=TRAIN, runtime_caps=caps, cpu_threads=1, model_name="m")
    best = result.best
    assert simplicity(best.plan) == (0, 0, 0, 0)  # plain DP: ZeRO-0, TP 1, no recompute, no offload
    assert all(rp.objective_value <= best.objective_value * 1.05 for rp in result.plans)
    # the runtime refuses ZeRO-0 (say): the next plan is taken, and the refusal is named in the notes

    def no_zero0(plan):
        if plan.train.zero_stage == 0:
            raise ConfigError("zero_stage 0 refused")

    picked = plan_for_devices(MODEL, {"cpu": 2}, train=TRAIN, runtime_caps=caps, cpu_threads=1, model_name="m",
                              runnable=no_zero0)
    assert picked.best.plan.train.zero_stage > 0
    assert any("not run by the runtime" in n and "zero_stage 0 refused" in n for n in picked.notes)

    def nothing(plan):
        raise ConfigError("nothing runs")

    with pytest.raises(InfeasiblePlanError, match="the runtime runs none of the planner's plans"):
        plan_for_devices(MODEL, {"cpu": 2}, train=TRAIN, runtime_caps=caps, model_name="m", runnable=nothing)


def test_fixed_caps_search_once_as_before():
    result = plan_for_devices(MODEL, {"cpu": 2}, train=TRAIN, runtime_caps=RUNTIME_CAPS, model_name="m")
    assert simplicity(result.best.plan) == (0, 0, 0, 0) and len(result.plans) == 1


def test_sharded_replica_group_sizes_divide_every_kind_and_leave_two_groups():
    from starverse.planner.replicas import group_sizes

    assert group_sizes({"cpu": 4}) == [2] and group_sizes({"cpu": 6}) == [2, 3] and group_sizes({"cpu": 8}) == [2, 4]
    assert group_sizes({"cpu": 3}) == [] and group_sizes({"cpu": 2}) == []  # a group of all would be one replica
    assert group_sizes({"cpu": 4, "cpu-b": 2}) == [2]


def test_sharded_replicas_are_priced_and_lose_to_zero0_replicas_that_fit_and_are_faster():
    caps = dataclasses.replace(RUNTIME_CAPS, sharded_replicas=True)
    result = plan_for_devices(MODEL, {"cpu": 4}, train=TRAIN, runtime_caps=caps, cpu_threads=1, model_name="m")
    best = result.best
    assert best.plan.train.zero_stage == 0 and [g.replicas for g in best.plan.groups] == [4]
    [sharded] = [rp for rp in result.plans if rp.plan.train.zero_stage == 1]
    assert [g.replicas for g in sharded.plan.groups] == [2, 2] and sharded.objective_value < best.objective_value
    assert any("sharded replicas for in-place recovery: 2 groups of 2 ranks" in n for n in sharded.notes)
    # the cost model prices it: a 1/2 optimizer shard, ZeRO-1's broadcast inside the group, the joint ring of the
    # whole gradient over all 4 ranks across groups; the plan as written estimates to the same figures
    plain, split = best.estimate, sharded.estimate
    assert split.groups[0].stages[0].optimizer_gb == pytest.approx(plain.groups[0].stages[0].optimizer_gb / 2)
    assert split.breakdown["cross_group_sync"] > 0 and split.step_time_s > plain.step_time_s
    from starverse.models import load_model

    again = estimate(sharded.plan, cpu_rank_catalog(load_catalog(), 1), load_model(MODEL))
    assert again.step_time_s == pytest.approx(split.step_time_s)
    # ZeRO-2 inside the groups (FSDP2): gradients on a 1/2 shard too
    [fsdp] = [rp for rp in result.plans if rp.plan.train.zero_stage == 2]
    assert [g.replicas for g in fsdp.plan.groups] == [2, 2]
    assert fsdp.estimate.groups[0].stages[0].grads_gb == pytest.approx(plain.groups[0].stages[0].grads_gb / 2)
    # a model without blocks (max_zero_stage 1: no FSDP2 unit) gets ZeRO-1 groups only
    ones = plan_for_devices(MODEL, {"cpu": 4}, train=TRAIN, runtime_caps=dataclasses.replace(caps, max_zero_stage=1),
                            cpu_threads=1, model_name="m")
    assert {rp.plan.train.zero_stage for rp in ones.plans} == {0, 1}
    # the plain search's caps never see them
    assert all(rp.plan.train.zero_stage == 0 for rp in plan_for_devices(
        MODEL, {"cpu": 4}, train=TRAIN, runtime_caps=RUNTIME_CAPS, cpu_threads=1, model_name="m").plans)
