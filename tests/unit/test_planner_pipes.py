"""Heterogeneous pipelines in the exact search: the exact layer split, brute force over every pipeline of
small pools, and agreement with the scalar cost model.

The brute force shares nothing with the search's enumeration: plain loops over the offers used (one per
accelerator kind, at least two kinds), their order, TP and stage counts, replicas, micro-batch, memory
setting and every integer split of the layers; each pipeline is written as a Plan and priced by
``costmodel.estimate`` (the scalar model), then scored as the search scores (Young/Daly, billing, limits).
"""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from starverse.catalog import load_catalog
from starverse.costmodel import estimate
from starverse.models import load_model
from starverse.plan import Group, Plan
from starverse.planner import job_from_dict, pool_from_dict, space
from starverse.planner.build import network_for, pricing_for, rank_plan, train_spec
from starverse.planner.hetero import stage_runs
from starverse.planner.pipekinds import spot_factor_of
from starverse.planner.pipes import search as pipe_search
from starverse.planner.pipesplit import best_split, step_of
from starverse.planner.policy import billed_hours, score, within
from starverse.planner.result import SearchStats
from starverse.planner.search import _context, pipeline_plan, resolve_objective

KINDS = ("rtx-4090", "a100-80gb-sxm", "t4", "l40s")


@pytest.fixture(scope="module")
def catalog():
    return load_catalog(profile="")


def _random_table(rng: np.random.Generator, max_total: int) -> tuple[int, int, int, np.ndarray, np.ndarray,
                                                                     np.ndarray, np.ndarray, float]:
    """A random split problem: p stages, total layers (at most ``max_total``), per-stage step (s), exposed
    all-reduce (o) and extra (d) tables over 1..lmax layers, a layer cap per stage (memory), micro-batches m."""
    p = int(rng.integers(1, 5))
    total = int(rng.integers(p, max_total + 1))
    lmax = total - p + 1
    layers = np.arange(1, lmax + 1)
    s = rng.uniform(0, 1, p)[:, None] + rng.uniform(0.5, 2, p)[:, None] * layers[None, :]
    o = rng.uniform(0, 0.3, p)[:, None] * layers[None, :]
    d = np.abs(rng.normal(0, 1, (p, lmax)))
    cap = rng.integers(1, lmax + 1, p)
    s = np.where(layers[None, :] <= cap[:, None], s, np.inf)
    return p, total, lmax, s, o, d, cap, float(rng.integers(1, 10))


def test_exact_split_matches_enumeration():
    """Random tables (non-monotone exposed all-reduce, memory caps): the DP's step equals the best of every
    composition."""
    rng = np.random.default_rng(0)
    for _ in range(150):
        p, total, lmax, s, o, d, cap, m = _random_table(rng, max_total=8)
        best = math.inf
        for comp in itertools.product(range(1, lmax + 1), repeat=p):
            if sum(comp) == total and all(c <= k for c, k in zip(comp, cap, strict=True)):
                best = min(best, step_of(s, o, d, np.array(comp), m, 0.1))
        v, split = best_split(s, o, d, total, m, 0.1)
        if math.isinf(best):
            assert split is None
        else:
            assert v == pytest.approx(best, rel=1e-12)
            assert split is not None and split.sum() == total
            assert step_of(s, o, d, split, m, 0.1) == pytest.approx(v, rel=1e-12)



def test_any_split_is_none_exactly_when_the_exact_split_is():
    """``best_split(..., any_split=True)`` (a leaf the layout rule refuses: only "does a split beat the limit?"
    counts) answers None exactly when the exact split does, under every incumbent, and what it returns is a
    real split within the incumbent."""
    rng = np.random.default_rng(1)
    for _ in range(300):
        _, total, _, s, o, d, _, m = _random_table(rng, max_total=9)
        exact, _ = best_split(s, o, d, total, m, 0.1)
        for incumbent in (math.inf, exact * 1.05, exact, exact * (1 + 1e-12), exact * 0.95, 0.0):
            _, want = best_split(s, o, d, total, m, 0.1, incumbent=incumbent)
            v, got = best_split(s, o, d, total, m, 0.1, incumbent=incumbent, any_split=True)
            assert (got is None) == (want is None), (incumbent, exact)
            if got is not None:
                assert got.sum() == total and (got >= 1).all() and v <= incumbent
                assert step_of(s, o, d, got, m, 0.1) == pytest.approx(v, rel=1e-12)


def test_the_layout_rule_never_reads_a_one_group_pipelines_layer_counts():
    """The leaf evaluation decides "refused whatever the split" from layer counts of 1 (``pipeleaf``): for one
    group, the rule's answer is the same for every split of the layers."""
    from starverse.planner.policy import Layout, runtime_layout_rule

    rng = random.Random(2)
    for _ in range(500):
        p = rng.randint(2, 5)
        tps = [rng.choice((1, 2, 4)) for _ in range(p)]
        backends = [rng.choice(("nccl", "rccl", "xla", "cpu")) for _ in range(p)]
        zero, offload, mode = rng.choice((0, 1, 2, 3)), rng.random() < 0.5, rng.choice(("full", "lora", "qlora"))
        split = [rng.randint(1, 9) for _ in range(p)]
        ones = Layout((tuple((1, t, b) for t, b in zip(tps, backends, strict=True)),), zero, offload, mode)
        real = Layout((tuple(zip(split, tps, backends, strict=True)),), zero, offload, mode)
        assert runtime_layout_rule(ones) == runtime_layout_rule(real)


def brute_force(job, pool, catalog, spec) -> float:
    """Best objective over every heterogeneous pipeline of the pool (plain loops, scalar cost model)."""
    job, _ = resolve_objective(job, pool)
    ctx = _context(job, pool, catalog, spec, job.train.mode)
    b, total = job.train.global_batch, spec.num_layers
    mbs = [job.train.micro_batch] if job.train.micro_batch else [m for m in space.MICRO_BATCHES if m <= b]
    offers = pool.offers
    best = -math.inf
    for n in range(2, len(offers) + 1):
        for subset in itertools.permutations(range(len(offers)), n):
            if len({offers[o].accelerator for o in subset}) < n:
                continue
            tps = [[t for t in range(1, offers[o].count + 1) if spec.num_heads % t == 0
                    and spec.num_kv_heads % t == 0 and t <= offers[o].devices_per_node] for o in subset]
            for tp in itertools.product(*tps):
                if len(set(tp)) > 1:
                    continue  # the runtime layout rule (planner.policy): one tp in every pipeline stage
                for ks in itertools.product(*[range(1, total + 1)] * n):
                    p = sum(ks)
                    if p > total:
                        continue
                    for mb in mbs:
                        for r in range(1, b // mb + 1):
                            if b % (r * mb) or any(r * t * k > offers[o].count
                                                   for o, t, k in zip(subset, tp, ks, strict=True)):
                                continue
                            for si, st in enumerate(ctx.settings):
                                if st.zero_stage > 1:
                                    continue
                                for split in itertools.product(range(1, total + 1), repeat=p):
                                    if sum(split) != total:
                                        continue
                                    for sched in schedules(split, b // (r * mb), job.search.max_virtual_stages):
                                        v = _value(ctx, catalog, spec, subset, tp, ks, r, mb, si, split, sched)
                                        best = max(best, v)
    return best


def schedules(split, m, most) -> list[tuple[str, int]]:
    """Every schedule the runtime runs for this split and micro-batch count: 1F1B, GPipe, and interleaved
    1F1B with ``v`` chunks per device where ``v`` divides every stage's layers and the micro-batches are a
    multiple of the stages (torch's ScheduleInterleaved1F1B), up to ``most`` chunks."""
    out = [("1f1b", 1), ("gpipe", 1)]
    if m % len(split) == 0:
        out += [("interleaved", v) for v in range(2, min(min(split), most) + 1) if all(x % v == 0 for x in split)]
    return out



def _value(ctx, catalog, spec, subset, tp, ks, r, mb, si, split, sched) -> float:
    offers = ctx.pool.offers
    accs = [offers[o].accelerator for o, k in zip(subset, ks, strict=True) for _ in range(k)]
    tps = [t for t, k in zip(tp, ks, strict=True) for _ in range(k)]
    names = [offers[o].name for o in subset]
    train = train_spec(ctx.job, ctx.mode, ctx.settings[si], any(t > 1 for t in tps))
    plan = Plan(model=ctx.job.model, train=train.model_copy(update={"schedule": sched[0], "virtual_stages": sched[1]}),
                groups=[Group(replicas=r, micro_batch=mb, stages=stage_runs(accs, tps, list(split)))],
                network=network_for(ctx.pool, names), pricing=pricing_for(ctx.pool, names))
    est = estimate(plan, catalog, spec)
    if not est.fits:
        return -math.inf
    n = {o: r * t * k for o, t, k in zip(subset, tp, ks, strict=True)}
    lam = sum(c * offers[o].interruptions_per_hour for o, c in n.items())
    nodes = sum(math.ceil(c / offers[o].devices_per_node) for o, c in n.items())
    factor = float(spot_factor_of(ctx, lam, nodes))
    tps_eff = ctx.batch * ctx.seq_len / est.step_time_s / factor
    price = sum(c * offers[o].price_per_hour for o, c in n.items())
    hours = ctx.tokens / tps_eff / 3600
    total = sum(c * offers[o].price_per_hour * float(billed_hours(np.asarray(hours), offers[o].billing_granularity_s))
                for o, c in n.items())
    if not within(ctx.limits, price, est.power_kw, hours, total):
        return -math.inf
    return float(score(ctx.job.objective, np.asarray(tps_eff), np.asarray(price), np.asarray(total), np.asarray(hours)))


def random_case(seed: int):
    rng = random.Random(seed)
    kinds = rng.sample(KINDS, rng.choice([2, 2, 3]))
    offers = [{"accelerator": k, "count": rng.randint(1, 3), "price_per_hour": round(rng.uniform(0.2, 3.0), 2),
               "billing_granularity_s": rng.choice([1, 3600])} for k in kinds]
    if rng.random() < 0.3:
        offers[0].update(pricing="spot", spot_price_per_hour=round(offers[0]["price_per_hour"] * 0.5, 2),
                         interruptions_per_hour=0.1)
    pool = {"currency": "USD", "offers": offers, "cross_offer_gbps": rng.choice([25, 100, 400])}
    if rng.random() < 0.4:  # a measured link between two offers replaces cross_offer_gbps for that pair
        pool["network"] = {"links": {f"{kinds[0]}/{kinds[1]}": rng.choice([10, 50, 800])}}
    train = {"seq_len": rng.choice([1024, 2048]), "global_batch": rng.choice([2, 4]), "tokens": 1e8,
             "zero_stage": rng.choice([0, 1]), "recompute": rng.choice(["none", "full"]), "offload": "none",
             "micro_batch": 1}
    job = {"model": "llama-tiny", "train": train,
           "objective": rng.choice(["cost-performance", "throughput", "cost", "time"])}
    if rng.random() < 0.3:
        job["constraints"] = {"max_budget_per_hour": round(sum(o["price_per_hour"] for o in offers) * 1.5, 2)}
    return job, pool


# seeds 14, 28, 58, 73: a measured link slower than cross_offer_gbps between the two (58: three) kinds, the
# pools where the bound's least send time comes from the links between offers of different accelerators
@pytest.mark.parametrize("seed", [*range(12), 14, 28, 58, 73])
def test_pipelines_match_brute_force(seed, catalog):
    job_d, pool_d = random_case(seed)
    job, pool = job_from_dict(job_d), pool_from_dict(pool_d, catalog)
    spec = load_model(job.model)
    expected = brute_force(job, pool, catalog, spec)
    job_r, _ = resolve_objective(job, pool)
    ctx = _context(job_r, pool, catalog, spec, job.train.mode)
    stats = SearchStats()
    found = pipe_search(ctx, -math.inf, stats)
    assert stats.pipelines_proven
    if not math.isfinite(expected):
        assert found is None
        return
    assert found is not None, f"brute force found {expected}, the search nothing"
    assert found.value == pytest.approx(expected, rel=1e-9)
    # the plan written for it is what the scalar model prices: same objective through rank_plan
    rp = rank_plan(job_r, pool, catalog, spec, pipeline_plan(ctx, found),
                   {pool.offers[o].name: c for o, c in found.devices().items()}, "hetero-pipeline", False)
    assert rp is not None and rp.objective_value == pytest.approx(found.value, rel=1e-9)


def test_claim_names_the_cap_when_the_pipeline_bound_does_not_close(catalog, monkeypatch):
    """A search stopped by the pipeline caps is not called proven; with room it is."""
    from starverse.cli.plan import optimality_claim
    from starverse.planner import pipes, search

    job = job_from_dict({"model": "llama-tiny", "train": {"seq_len": 1024, "global_batch": 4, "micro_batch": 1},
                         "objective": "throughput"})
    pool = pool_from_dict({"offers": [{"accelerator": "rtx-4090", "count": 2, "price_per_hour": 0.5},
                                      {"accelerator": "t4", "count": 2, "price_per_hour": 0.2}]}, catalog)
    full = search(job, pool, catalog, top=1)
    assert full.stats.pipelines_searched and full.stats.pipelines_proven
    assert optimality_claim(full).startswith("proven optimal") and "heterogeneous pipelines" in optimality_claim(full)
    monkeypatch.setattr(pipes, "MAX_NODES", 1)
    cut = search(job, pool, catalog, top=1)
    claim = optimality_claim(cut)
    assert not cut.stats.pipelines_proven and claim.startswith("NOT proven optimal")
    assert "caps of the heterogeneous-pipeline search" in claim and "bound gap" in claim


def test_interleaved_options_follow_the_runtime():
    """Interleaved 1F1B only where torch's ScheduleInterleaved1F1B runs it: micro-batches a multiple of the
    stages, every stage a multiple of v layers; the bounds' v is the largest of any deeper pipeline's."""
    from starverse.planner.pipekinds import interleave_options, interleave_vmax

    assert interleave_options(8, 4, 2, 64) == [2, 4]
    assert interleave_options(8, 4, 4, 64) == [2]
    assert interleave_options(8, 3, 2, 64) == [] and interleave_options(8, 4, 1, 64) == []
    assert interleave_options(12, 6, 2, 64) == [2, 3, 4, 6] and interleave_options(12, 6, 2, 3) == [2, 3]
    assert interleave_options(8, 4, 2, 1) == []  # search.max_virtual_stages: 1 turns interleaving off
    assert interleave_vmax(8, 4, 3, 64) == 2  # 3 stages do not divide 4 micro-batches: 4 stages, v ≤ 2
    assert interleave_vmax(8, 1, 2, 64) == 1 and interleave_vmax(8, 4, 5, 64) == 1


def test_interleaved_pipeline_is_written_as_the_runtime_runs_it(catalog):
    """Where interleaving wins (the brute force agrees above), the plan says so and satisfies the runtime."""
    job_d, pool_d = random_case(0)
    job, pool = job_from_dict(job_d), pool_from_dict(pool_d, catalog)
    spec = load_model(job.model)
    job_r, _ = resolve_objective(job, pool)
    ctx = _context(job_r, pool, catalog, spec, job.train.mode)
    found = pipe_search(ctx, -math.inf, SearchStats())
    assert found is not None and found.schedule == "interleaved" and found.virtual_stages >= 2
    plan = pipeline_plan(ctx, found)
    assert plan.train.schedule == "interleaved" and plan.train.virtual_stages == found.virtual_stages
    stages = plan.groups[0].expanded_stages()
    assert all(s.layers % found.virtual_stages == 0 for s in stages)
    assert (ctx.batch // (found.replicas * found.micro_batch)) % len(stages) == 0
    assert estimate(plan, catalog, spec).step_time_s == pytest.approx(found.step_time_s, rel=1e-9)
    rp = rank_plan(job_r, pool, catalog, spec, plan, {pool.offers[o].name: c for o, c in found.devices().items()},
                   "hetero-pipeline", False)
    assert rp is not None and rp.layout().endswith(f"interleaved v{found.virtual_stages}")
    # search.max_virtual_stages: 1 turns interleaving off: 1F1B, and no better than with it
    job_1 = job_from_dict({**job_d, "search": {"max_virtual_stages": 1}})
    job_1r, _ = resolve_objective(job_1, pool)
    plain = pipe_search(_context(job_1r, pool, catalog, spec, job.train.mode), -math.inf, SearchStats())
    assert plain is not None and plain.schedule == "1f1b" and plain.value < found.value


def test_a_qlora_search_evaluates_no_pipeline_the_runtime_rule_refuses(catalog):
    """QLoRA runs one stage per group (the runtime layout rule): on two CUDA kinds, where a pipeline over them
    would be evaluated in any other mode, the QLoRA search evaluates none and still calls its answer proven."""
    job_d = {"model": "llama-tiny", "train": {"seq_len": 1024, "global_batch": 4, "micro_batch": 1},
             "objective": "throughput"}
    pool = pool_from_dict({"offers": [{"accelerator": "rtx-4090", "count": 2, "price_per_hour": 0.5},
                                      {"accelerator": "a100-80gb-sxm", "count": 2, "price_per_hour": 1.5}]}, catalog)
    spec = load_model("llama-tiny")
    leaves = {}
    for mode in ("lora", "qlora"):
        job_r, _ = resolve_objective(job_from_dict({**job_d, "train": {**job_d["train"], "mode": mode}}), pool)
        stats = SearchStats()
        found = pipe_search(_context(job_r, pool, catalog, spec, mode), -math.inf, stats)
        assert stats.pipelines_proven
        leaves[mode] = (stats.pipeline_leaves, found is not None)
    assert leaves["lora"][0] > 0 and leaves["lora"][1]  # the same pool and job in LoRA: pipelines are evaluated
    assert leaves["qlora"] == (0, False)
