"""planner.search: objectives, constraints, heterogeneous plans, spot overhead, alternatives, explanations."""

from __future__ import annotations

import math
import re

import pytest

from starverse.catalog import convert, load_catalog
from starverse.costmodel import estimate
from starverse.errors import InfeasiblePlanError
from starverse.models import load_model
from starverse.planner import job_from_dict, plan_for, pool_from_dict, search
from starverse.planner.hetero import split_layers
from starverse.planner.policy import spot_factor, spot_overhead
from starverse.planner.search import best_combinations


@pytest.fixture(scope="module")
def catalog():
    return load_catalog(profile="")


MIXED = {"currency": "USD", "cross_offer_gbps": 100, "offers": [
    {"accelerator": "rtx-4090", "count": 8, "price_per_hour": 0.69},
    {"accelerator": "a100-80gb-sxm", "count": 4, "price_per_hour": 2.45}]}
# heterogeneous pipelines off: these tests are about data parallelism across kinds (with pipelines on, a
# 4090 + A100 pipeline wins this case)
JOB7B = {"model": "llama-2-7b", "train": {"seq_len": 4096, "global_batch": 128, "tokens": 1e9},
         "objective": "throughput", "constraints": {"max_budget_per_hour": 20},
         "search": {"hetero_pipelines": False}}


@pytest.fixture(scope="module")
def mixed_result(catalog):
    return search(job_from_dict(JOB7B), pool_from_dict(MIXED, catalog), catalog, top=3)


def test_heterogeneous_dp_beats_single_kind_and_matches_estimate(mixed_result, catalog):
    best = mixed_result.best
    # throughput within $20/h: RTX 4090s next to A100s beat any single kind the budget allows
    assert best.kind == "hetero-dp"
    assert set(best.devices) == {"rtx-4090", "a100-80gb-sxm"}
    assert best.cost_per_hour <= 20 + 1e-9
    singles = [p for p in mixed_result.plans if p.kind == "single"]
    assert all(best.tokens_per_s > p.tokens_per_s for p in singles)
    # the numbers shown are the scalar cost model's on the emitted plan ...
    est = estimate(best.plan, catalog)
    assert best.tokens_per_s == pytest.approx(est.tokens_per_s, rel=1e-12)
    # ... and they agree with the batch-API figures the search ranked by
    job, pool = job_from_dict(JOB7B), pool_from_dict(MIXED, catalog)
    combos, _, _ = best_combinations(job, pool, catalog, load_model("llama-2-7b"), "full")
    assert combos[0].tps == pytest.approx(est.tokens_per_s, rel=1e-9)
    # batch shares are integer micro-batches per replica that add up to the global batch
    seqs = [g.sequences_per_step for g in est.groups]
    assert sum(seqs) == 128
    for g, plan_g in zip(est.groups, best.plan.groups, strict=True):
        assert g.sequences_per_step % (plan_g.replicas * plan_g.micro_batch) == 0


def test_objectives_rank_differently(catalog):
    pool = pool_from_dict(MIXED, catalog)
    base = {**JOB7B, "constraints": {}}
    by_obj = {}
    for obj in ("cost-performance", "throughput", "cost", "time"):
        r = search(job_from_dict({**base, "objective": obj}), pool, catalog, top=1)
        by_obj[obj] = r.best
    # throughput rents more than cost-performance does, and is faster
    assert by_obj["throughput"].tokens_per_s > by_obj["cost-performance"].tokens_per_s
    cp = by_obj["cost-performance"]
    assert cp.effective_tokens_per_s / cp.cost_per_hour >= (
        by_obj["throughput"].effective_tokens_per_s / by_obj["throughput"].cost_per_hour)
    assert by_obj["time"].hours <= by_obj["cost"].hours
    assert by_obj["cost"].total_cost <= by_obj["time"].total_cost


def test_power_cap_and_deadline(catalog):
    pool = pool_from_dict(MIXED, catalog)
    free = search(job_from_dict({**JOB7B, "constraints": {}}), pool, catalog, top=1).best
    capped = search(job_from_dict({**JOB7B, "constraints": {"max_power_kw": 1.5}}), pool, catalog, top=1).best
    assert free.power_kw > 1.5 >= capped.power_kw
    with pytest.raises(InfeasiblePlanError, match="the deadline is 1 h") as e:
        search(job_from_dict({**JOB7B, "constraints": {"deadline_hours": 1}}), pool, catalog)
    # the remedy comes with its own numbers: without the deadline the job takes longer than 1 h
    m = re.search(r"drop the budget/power/deadline limits → .*?, ([\d.,]+) h", str(e.value))
    assert m and float(m.group(1).replace(",", "")) > 1
    # contradictory limits: a deadline that needs a fast plan and a total-cost cap that forbids it
    with pytest.raises(InfeasiblePlanError, match="the job may cost at most 1 USD"):
        search(job_from_dict({**JOB7B, "constraints": {"deadline_hours": 100, "max_total_cost": 1}}), pool,
               catalog)


def test_budget_in_another_currency(catalog):
    pool = pool_from_dict({**MIXED, "currency": "CNY", "offers": [
        {"accelerator": "rtx-4090", "count": 8, "price_per_hour": 5.0},
        {"accelerator": "a100-80gb-sxm", "count": 4, "price_per_hour": 18.0}]}, catalog)
    job = job_from_dict({**JOB7B, "constraints": {"max_budget_per_hour": 5, "currency": "USD"}})
    r = search(job, pool, catalog, top=3)
    limit_cny = convert(5, "USD", "CNY")
    assert r.currency == "CNY"
    assert all(p.cost_per_hour <= limit_cny + 1e-9 for p in r.plans)
    assert r.best.cost_per_hour > 0.7 * limit_cny  # the budget binds: most of it is used


def test_budget_that_excludes_everything(catalog):
    job = job_from_dict({**JOB7B, "constraints": {"max_budget_per_hour": 0.5}})
    with pytest.raises(InfeasiblePlanError) as e:
        search(job, pool_from_dict(MIXED, catalog), catalog)
    assert "the budget of 0.5 USD/h excludes every offer (the cheapest device costs 0.69 USD/h)" in str(e.value)


def test_young_daly_formula():
    # C = 60 s, one interruption per hour: M = 3600 s; the planner uses the supervisor's interval (Daly's
    # form of Young's sqrt(2*60*3600) = 657 s): r = C/2M, tau = sqrt(2CM)(1 + sqrt(r)/3 + r/9) - C
    o = spot_overhead(1.0, 60.0, 300.0)
    r = 60 / 7200
    tau = math.sqrt(2 * 60 * 3600) * (1 + math.sqrt(r) / 3 + r / 9) - 60
    assert o.interval_s == pytest.approx(tau)
    assert o.factor == pytest.approx(1 + 60 / tau + (tau / 2 + 300) / 3600)
    assert o.factor == pytest.approx(1 + math.sqrt(2 * 60 / 3600) + 300 / 3600, rel=2e-3)  # Young, first order
    assert float(spot_factor(0.0, 60.0, 300.0)) == 1.0
    # checkpointing longer than half the interval: no progress possible
    assert math.isinf(float(spot_factor(100.0, 60.0, 300.0)))


def test_unstable_spot_offer_is_not_over_rated(catalog):
    offers = [{"accelerator": "a100-80gb-sxm", "count": 4, "price_per_hour": 2.45},
              {"accelerator": "rtx-4090", "count": 8, "name": "4090-spot", "pricing": "spot",
               "spot_price_per_hour": 0.2}]
    job = job_from_dict({**JOB7B, "objective": "cost-performance", "constraints": {}})
    stable = search(job, pool_from_dict({"offers": offers}, catalog), catalog, top=1).best
    assert "4090-spot" in stable.devices and stable.spot_factor == 1.0
    offers[1]["interruptions_per_hour"] = 3.0
    shaky = search(job, pool_from_dict({"offers": offers}, catalog), catalog, top=1).best
    # three losses per device-hour: every spot device adds to the job's interruption rate, so the plan
    # rents fewer of them, and is worth less than on stable devices
    assert shaky.devices.get("4090-spot", 0) < stable.devices["4090-spot"]
    assert shaky.spot_factor > 1.2
    assert shaky.objective_value < stable.objective_value
    offers[1]["interruptions_per_hour"] = 0.02
    mild = search(job, pool_from_dict({"offers": offers}, catalog), catalog, top=1).best
    assert mild.spot_factor > 1.0
    assert mild.effective_tokens_per_s == pytest.approx(mild.tokens_per_s / mild.spot_factor)
    assert any("spot overhead" in n for n in mild.notes)


SCEN1_POOL = {"currency": "CNY", "cross_offer_gbps": 25, "offers": [
    {"accelerator": "rtx-4090", "count": 16, "price_per_hour": 1.2},
    {"accelerator": "tpu-v5e", "count": 3, "price_per_hour": 2.8}]}


SCEN1_POOL_BIG_HOSTS = {**SCEN1_POOL, "offers": [{**SCEN1_POOL["offers"][0], "host_memory_gb": 1024},
                                                 SCEN1_POOL["offers"][1]]}
"""Scenario 1 with 4090 nodes of 1 TB of RAM: enough for CPU offload of the 70B's optimizer state."""


def test_offloaded_plan_needs_and_reports_host_memory(catalog):
    """Full 70B on 16x4090 fits only by offloading ~0.8 TB to the hosts of two nodes: refused on the catalog's
    256 GB nodes (the reason names host memory), planned on 1 TB nodes with the RAM it needs reported."""
    from starverse.cli.plan import result_to_json
    from starverse.planner.hostmem import HOST_USABLE_FRACTION

    job = job_from_dict({"model": "llama-2-70b", "train": {"seq_len": 4096, "global_batch": 32},
                         "search": {"alternatives": False}})
    with pytest.raises(InfeasiblePlanError) as e:
        search(job, pool_from_dict(SCEN1_POOL, catalog), catalog)
    assert re.search(r"host memory is what is missing: the best plan offloads .* rtx-4090: needs [\d,]+ GB per "
                     r"node for the offloaded state, the nodes have 256 GB \(catalog: ", str(e.value))
    result = search(job, pool_from_dict(SCEN1_POOL_BIG_HOSTS, catalog), catalog, top=3)
    best = result.best
    assert best.plan.train.offload != "none"
    need = best.host_memory_gb_per_node["rtx-4090"]
    # 70B x (12 B Adam state + 2 B gradients) over 16 devices, 8 devices a node: about 490 GB, within 1 TB
    assert 400 < need <= 1024 * HOST_USABLE_FRACTION
    doc = result_to_json(result)
    assert doc["plans"][0]["host_memory_gb_per_node"] == {"rtx-4090": pytest.approx(need)}
    for rp in result.plans:  # every plan that does not offload needs no host memory
        assert bool(rp.host_memory_gb_per_node) == (rp.plan.train.offload != "none")


def test_infeasible_explains_memory_and_suggests(catalog):
    job = job_from_dict({"model": "llama-2-70b", "train": {"seq_len": 4096, "global_batch": 32, "offload": "none"},
                         "search": {"alternatives": False}})
    with pytest.raises(InfeasiblePlanError) as e:
        search(job, pool_from_dict(SCEN1_POOL, catalog), catalog)
    msg = str(e.value)
    assert "full training of llama-2-70b needs ≥ 1.1 TB of weights+gradients+Adam state; the pool has 432 GB" in msg
    assert "rtx-4090: 16×24 GB = 384 GB" in msg and "tpu-v5e: 3×16 GB = 48 GB" in msg
    # (with more 4090s, a pipeline over them and the TPUs may beat the 4090s alone)
    assert re.search(r"rent up to \d+ rtx-4090 \(have 16\) → \d+×rtx-4090( \+ \d+×tpu-v5e)?: [\d,]+ tokens/s at "
                     r"[\d.]+ CNY/h", msg)
    # offloading would hold the state, but the 4090 nodes lack the RAM: the explanation names host memory
    assert re.search(r"let the planner choose ZeRO-3 and offload → not enough either \(host memory is what is "
                     r"missing: .* rtx-4090: needs [\d,]+ GB per node for the offloaded state, the nodes have 256 GB",
                     msg)
    assert "fine-tune with LORA instead → " in msg and "tokens/s" in msg
    assert "train on sequences of 2048 tokens → " in msg
    assert "\n" not in msg


def test_lora_alternatives_are_labelled(catalog):
    job = job_from_dict({"model": "llama-2-70b", "train": {"seq_len": 4096, "global_batch": 32, "offload": "none"}})
    r = search(job, pool_from_dict(SCEN1_POOL, catalog), catalog, top=3)
    assert r.plans and all(p.alternative and p.mode in ("lora", "qlora") for p in r.plans)
    assert any("ALTERNATIVES (LoRA/QLoRA), not full training" in n for n in r.notes)
    assert r.best.plan.train.mode in ("lora", "qlora")


def test_hetero_pipeline_when_no_single_kind_holds_the_model(catalog):
    # 7 RTX 4090 cannot hold llama-2-13b for full training without offload; 3 A100-40G cannot either;
    # one pipeline over both can
    pool = pool_from_dict({"offers": [
        {"accelerator": "rtx-4090", "count": 7, "price_per_hour": 0.69},
        {"accelerator": "a100-40gb-sxm", "count": 3, "price_per_hour": 1.6}]}, catalog)
    job = job_from_dict({"model": "llama-2-13b", "train": {"seq_len": 2048, "global_batch": 16, "offload": "none"},
                         "search": {"alternatives": False}})
    r = search(job, pool, catalog, top=3)
    best = r.best
    assert best.kind == "hetero-pipeline"
    stages = best.plan.groups[0].expanded_stages()
    assert {s.accelerator for s in stages} == {"rtx-4090", "a100-40gb-sxm"}
    assert sum(s.layers for s in stages) == 40
    assert len({s.layers for s in stages}) > 1  # uneven split
    assert re.fullmatch(r"\d+×\[(rtx-4090|a100-40gb-sxm) tp\d .+ → (rtx-4090|a100-40gb-sxm) tp\d .+\] mb\d \| .+",
                        best.layout())
    assert estimate(best.plan, catalog).fits
    # the chosen plan does not depend on how many are shown; the pipeline search closed its bound
    one = search(job, pool, catalog, top=1).best
    assert (one.plan, one.objective_value) == (best.plan, best.objective_value)
    from starverse.cli.plan import optimality_claim, result_to_json

    assert r.stats.pipelines_proven and r.stats.pipelines_searched
    assert optimality_claim(r).startswith("proven optimal") and "heterogeneous pipelines" in optimality_claim(r)
    assert result_to_json(r)["stats"]["claim"] == optimality_claim(r)
    assert r.stats.hetero_pipelines > 0


def test_best_plan_does_not_depend_on_top(catalog):
    """Mixed pools where a heterogeneous-DP plan wins: heterogeneous pipelines are always searched against
    the best plan, so top=1 and top=5 choose the same plan (it used to depend on the plans shown)."""
    for job_d in ({"model": "llama-2-7b", "train": {"seq_len": 4096, "global_batch": 128}, "objective": "throughput",
                   "constraints": {"max_budget_per_hour": 20}},
                  {"model": "llama-2-13b", "train": {"seq_len": 2048, "global_batch": 64}, "objective": "throughput"}):
        job = job_from_dict(job_d)
        pool = pool_from_dict(MIXED, catalog)
        a, b = search(job, pool, catalog, top=1), search(job, pool, catalog, top=5)
        assert (a.best.plan, a.best.objective_value) == (b.best.plan, b.best.objective_value)
        assert [p.objective_value for p in b.plans] == sorted((p.objective_value for p in b.plans), reverse=True)


def test_split_layers():
    assert split_layers([1, 1, 2], 8) == [2, 2, 4]
    assert sum(split_layers([24, 24, 80, 80], 80)) == 80
    assert min(split_layers([1, 1000], 10)) == 1


def test_plan_for_python_api(catalog):
    r = plan_for("llama-2-7b", policy="throughput", max_budget_per_hour=20, pool=MIXED,
                 job_overrides={"train": {"seq_len": 4096, "global_batch": 128}}, catalog=catalog)
    assert r.objective == "throughput"
    # both kinds mixed (a pipeline over them wins since pipelines are in the exact search)
    assert r.best.kind in ("hetero-dp", "hetero-pipeline") and r.best.cost_per_hour <= 20
    assert set(r.best.devices) == {"rtx-4090", "a100-80gb-sxm"}


def test_memory_never_grows_with_replicas(catalog):
    """The screening pass tests each configuration at its largest replica count only; that is exact only
    if memory per device never grows with the replica count. Check it on every row of a real space."""
    import numpy as np

    from starverse.planner import space
    from starverse.planner.search import _context

    job = job_from_dict({"model": "llama-2-70b", "train": {"seq_len": 4096, "global_batch": 256}})
    pool = pool_from_dict({"offers": [{"accelerator": a, "count": 64, "price_per_hour": 1.0}
                                      for a in ("rtx-4090", "a100-80gb-sxm", "tpu-v5e")]}, catalog)
    spec = load_model("llama-2-70b")
    ctx = _context(job, pool, catalog, spec, "full")
    opts = space.enumerate_options(spec, 256, pool.offers, ctx.settings, None, None, 8, 1.5)
    est, _ = space.evaluate_full_share(ctx.model, ctx.train, ctx.devices, opts, ctx.settings, 256)
    base = np.stack([opts.offer, opts.tp, opts.pp, opts.micro_batch, opts.setting], axis=1)
    mem = np.asarray(est.memory_gb)
    for key in np.unique(base, axis=0)[::7]:
        rows = np.flatnonzero((base == key).all(axis=1))
        order = rows[np.argsort(opts.replicas[rows])]
        assert np.all(np.diff(mem[order]) <= 1e-9)
    assert 0 < int(np.sum(est.fits)) < len(opts)  # the space has both fitting and non-fitting rows


def test_plan_for_needs_a_pool(catalog):
    from starverse.errors import ConfigError

    with pytest.raises(ConfigError, match=r"plan_for: no pool given; pass pool= a pool\.yaml path"):
        plan_for("llama-2-7b", catalog=catalog)


def test_layer_runs_in_layouts():
    from starverse.planner.result import _layers

    assert _layers([10] * 8) == "10L"
    assert _layers([11, 11, 10]) == "11+11+10"
    assert _layers([3] * 24 + [2] * 8) == "3L×24+2L×8"


def test_json_output_has_no_infinities():
    from starverse.cli.plan import _finite

    assert _finite({"gap": math.inf, "plans": [{"x": 1.5, "y": math.nan}], "n": 3}) == {
        "gap": None, "plans": [{"x": 1.5, "y": None}], "n": 3}


def test_infeasible_budget_and_power_reasons(catalog):
    job = job_from_dict({"model": "llama-2-70b", "train": {"seq_len": 4096, "global_batch": 32},
                         "constraints": {"max_budget_per_hour": 3, "max_power_kw": 5},
                         "search": {"alternatives": False}})
    with pytest.raises(InfeasiblePlanError) as e:
        search(job, pool_from_dict(SCEN1_POOL_BIG_HOSTS, catalog), catalog)
    msg = str(e.value)
    assert "the budget of 3 CNY/h rents at most: rtx-4090: 2 of 16, tpu-v5e: 1 of 3" in msg
    assert "the power cap is 5 kW" in msg
    assert re.search(r"even \d+ rtx-4090 give no plan within the constraints", msg)
    assert "ZeRO-3, full recompute and CPU offload were already searched: not enough" in msg
    assert re.search(r"drop the budget/power/deadline limits → \d+×rtx-4090", msg)


def test_a_jobs_optimizer_reaches_the_plan_and_its_memory(catalog):
    # train.optimizer: sgd is searched with SGD's one moment and emitted in the plan the runtime runs; the batch
    # figures the search ranked by agree with the scalar estimate of that plan
    single = {"currency": "USD", "offers": [{"accelerator": "a100-80gb-sxm", "count": 8, "price_per_hour": 2.45}]}
    job = job_from_dict({**JOB7B, "train": {**JOB7B["train"], "optimizer": "sgd"}})
    pool = pool_from_dict(single, catalog)
    best = search(job, pool, catalog, top=1).best
    assert best.plan.train.optimizer == "sgd"
    est = estimate(best.plan, catalog)
    assert best.tokens_per_s == pytest.approx(est.tokens_per_s, rel=1e-12)
    combos, _, _ = best_combinations(job, pool, catalog, load_model("llama-2-7b"), "full")
    assert combos[0].tps == pytest.approx(est.tokens_per_s, rel=1e-9)
    adam = estimate(best.plan.model_copy(update={"train": best.plan.train.model_copy(update={"optimizer": "adamw"})}),
                    catalog)
    assert est.memory_gb < adam.memory_gb
