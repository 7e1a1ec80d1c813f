"""Whatever ``starverse plan`` writes, the runtime runs: random mixed GPU pools, every ranked plan passes the
runtime's own check (``check_runnable``: the plan against CUDA ranks of its devices, without launching).

The planner keeps out what the runtime refuses through one rule (``planner.policy.runtime_layout_rule``, applied
by its constraint function ``within``): TP inside pipelines of different degrees, ZeRO-2/3 or offload over groups
whose pipelines split the layers differently, ZeRO over device types. The cases below are ones where the rule
bites (the search notes name it), so the check is not of plans that could never be refused.
"""

from __future__ import annotations

import random

from starverse.catalog import load_catalog
from starverse.planner import job_from_dict, pool_from_dict, search
from starverse.runtime.cluster import check_runnable
from starverse.runtime.launch import RankSpec
from starverse.runtime.parallel.pipeline_layout import PipelineLayout

GPUS = ("rtx-4090", "a100-80gb-sxm", "h100-80gb-sxm", "l40s", "rtx-3090", "a100-40gb-pcie")


def _case(rng: random.Random) -> tuple[dict, dict]:
    kinds = rng.sample(GPUS, rng.choice([2, 3]))
    offers = [{"accelerator": k, "count": rng.choice([2, 4, 8]), "devices_per_node": 8,
               "price_per_hour": round(rng.uniform(0.3, 4.0), 2)} for k in kinds]
    job = {"model": rng.choice(["llama-2-7b", "llama-2-13b", "mistral-7b"]),
           "train": {"seq_len": 2048, "global_batch": rng.choice([32, 64]), "tokens": 1e8},
           "objective": rng.choice(["cost-performance", "throughput"])}
    return job, {"currency": "USD", "offers": offers, "cross_offer_gbps": 25}


def test_plans_of_mixed_gpu_pools_pass_the_runtime_check():
    catalog = load_catalog()
    rng = random.Random(0)  # its first two cases: the TP rule bites, then the ZeRO one
    checked, notes = 0, []
    for _ in range(2):
        job_d, pool_d = _case(rng)
        result = search(job_from_dict(job_d, "<job>"), pool_from_dict(pool_d, catalog, source="<pool>"), catalog, top=5)
        notes.extend(n for n in result.notes if "left out by the runtime layout rule" in n)
        for rp in result.plans:
            places = PipelineLayout.from_plan(rp.plan).places
            check_runnable(rp.plan, [RankSpec(i, p.accelerator, "cuda:0", 1) for i, p in enumerate(places)])
            checked += 1
    assert checked >= 10
    # the rule bit (the cases would catch a planner that ignores it), and its note names it
    assert any("pipeline stages of different tp" in n for n in notes), notes
    assert any("offload over groups whose pipelines split the layers differently" in n for n in notes), notes


def test_the_rule_mirrors_the_runtime_refusals():
    """Each refusal of the rule on a small shape, and the shapes the runtime runs (ZeRO over CUDA kinds, FSDP over
    pipelines split alike, ZeRO-1 proper over pipelines split differently)."""
    from starverse.planner.policy import Layout, runtime_layout_rule

    def rule(groups, zero=0, offload=False):
        return runtime_layout_rule(Layout(tuple(tuple(g) for g in groups), zero, offload))

    a, b = [(8, 1, "nccl"), (8, 1, "nccl")], [(4, 1, "nccl"), (12, 1, "nccl")]
    assert rule([a, b], zero=1) is None  # ZeRO-1 proper: optimizer sharded inside each group
    assert "split the layers differently" in rule([a, b], zero=1, offload=True)
    assert "split the layers differently" in rule([a, b], zero=2)
    assert rule([a, a], zero=2) is None  # one FSDP2 mesh per stage over both groups
    assert rule([[(16, 1, "nccl")], [(16, 1, "rccl")]], zero=3) is None  # ROCm is torch's cuda device too
    assert "several device types" in rule([[(16, 1, "nccl")], [(16, 1, "xla")]], zero=1)
    assert "several device types" in rule([a, [(8, 1, "nccl"), (8, 1, "xla")]], zero=2)
    assert "different tp" in rule([[(8, 2, "nccl"), (8, 1, "nccl")]])
    assert "several data-parallel groups" in rule([[(16, 2, "nccl")], [(16, 2, "nccl")]])
    assert rule([[(8, 2, "nccl"), (8, 2, "xla")]], zero=1, offload=True) is None  # one group: per-stage meshes


def test_the_rule_keeps_qlora_where_the_runtime_runs_it():
    """QLoRA (bitsandbytes' 4-bit base) runs on CUDA, one stage per group, TP 1, ZeRO 0-1 without offload."""
    from starverse.planner.policy import Layout, runtime_layout_rule

    def rule(groups, zero=0, offload=False, mode="qlora"):
        return runtime_layout_rule(Layout(tuple(tuple(g) for g in groups), zero, offload, mode))

    one = [(16, 1, "nccl")]
    assert rule([one, one], zero=1) is None
    assert "without CUDA" in rule([one, [(16, 1, "xla")]])
    assert "pipeline stages" in rule([[(8, 1, "nccl"), (8, 1, "nccl")]])
    assert "tensor parallelism" in rule([[(16, 2, "nccl")]])
    assert "ZeRO-2/3 or offload" in rule([one], zero=1, offload=True)
    assert rule([[(8, 1, "nccl"), (8, 1, "xla")]], mode="lora") is None  # LoRA runs in pipelines over kinds


def test_a_qlora_job_on_tpus_only_says_the_rule_left_its_plans_out():
    import pytest

    from starverse.errors import InfeasiblePlanError

    catalog = load_catalog()
    job = job_from_dict({"model": "llama-2-7b", "objective": "throughput",
                         "train": {"seq_len": 2048, "global_batch": 32, "tokens": 1e8, "mode": "qlora"}}, "<job>")
    pool = pool_from_dict({"currency": "USD", "offers": [{"accelerator": "tpu-v5p", "count": 4, "devices_per_node": 4,
                                                          "price_per_hour": 4.2}]}, catalog, source="<pool>")
    with pytest.raises(InfeasiblePlanError) as e:
        search(job, pool, catalog, top=3)
    assert e.value.reasons[-1].startswith("left out by the runtime layout rule")
    assert "; left out by the runtime layout rule" in str(e.value) and "without CUDA" in str(e.value)
