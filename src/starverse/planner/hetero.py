"""Heterogeneous pipelines: one pipeline whose stages run on different accelerators.

Used when no single accelerator kind of the pool holds the model on its own (the brief's "one job across
three architectures"). The space here is deliberately small and built, not enumerated: for each set of
2-3 offers, every offer contributes as many TP groups (its largest valid TP degree) as it has devices per
replica; the layers are split unevenly — in proportion to each stage's memory, to its compute, or to the
mean of both — and each candidate is priced by the scalar cost model (``costmodel.estimate``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from starverse.errors import StarverseError
from starverse.plan import Group, Plan, Stage
from starverse.planner import space
from starverse.planner.job import Job
from starverse.planner.pool import Pool
from starverse.planner.result import RankedPlan

SETTINGS = (space.Setting(1, 2, 0), space.Setting(1, 2, 1), space.Setting(0, 2, 0), space.Setting(1, 1, 0))
"""(ZeRO, recompute, offload) tried: full recompute first — a pipeline built for memory needs it."""
MAX_REPLICAS = 8
"""Most data-parallel replicas of a heterogeneous pipeline tried."""


def split_layers(weights: Sequence[float], num_layers: int) -> list[int]:
    """Integer layers per stage ∝ ``weights`` (largest remainder), every stage at least one layer."""
    n = len(weights)
    total = sum(weights)
    raw = [max(w / total * num_layers, 1.0) for w in weights]
    scale = num_layers / sum(raw)
    raw = [r * scale for r in raw]
    out = [max(1, int(r)) for r in raw]
    while sum(out) < num_layers:
        i = max(range(n), key=lambda j: raw[j] - out[j])
        out[i] += 1
    while sum(out) > num_layers:
        i = max((j for j in range(n) if out[j] > 1), key=lambda j: out[j] - raw[j])
        out[i] -= 1
    return out


def _stage_runs(accs: Sequence[str], tps: Sequence[int], layers: Sequence[int]) -> list[Stage]:
    """Consecutive identical stages folded with ``repeat``."""
    out: list[Stage] = []
    for a, t, lay in zip(accs, tps, layers, strict=True):
        if out and out[-1].accelerator == a and out[-1].tp == t and out[-1].layers == lay:
            out[-1] = out[-1].model_copy(update={"repeat": out[-1].repeat + 1})
        else:
            out.append(Stage(accelerator=a, tp=t, layers=lay))
    return out


def search_pipelines(job: Job, pool: Pool, catalog: Any, spec: Any, mode: str, top: int,
                     alternative: bool) -> list[RankedPlan]:
    """Best heterogeneous-pipeline plans (empty if none fits or meets the constraints)."""
    num_layers = int(spec.num_layers)
    batch = job.train.global_batch
    t = job.train
    settings = []
    for st in SETTINGS:  # the job may fix some of the three; the others keep the defaults above
        fixed = space.Setting(
            st.zero_stage if t.zero_stage is None else min(t.zero_stage, 1),
            st.recompute if t.recompute is None else space.RECOMPUTE_CODES[t.recompute],
            st.offload if t.offload is None else space.OFFLOAD_CODES[t.offload],
        )
        if fixed.offload <= 1 and not (fixed.offload == 1 and fixed.zero_stage < 1) and fixed not in settings:
            settings.append(fixed)
    out: list[RankedPlan] = []
    offers = list(pool.offers)
    for g in range(2, min(3, len(offers)) + 1):
        for combo in itertools.combinations(offers, g):
            if len({o.accelerator for o in combo}) < g:
                continue
            # 1F1B keeps the most micro-batches in flight on the first stages: try the big memories first
            # and last (layers are split by memory too, so either can be the one that fits)
            for subset in (sorted(combo, key=lambda o: -o.memory_gb), sorted(combo, key=lambda o: o.memory_gb)):
                accs = [catalog.accelerator(o.accelerator) for o in subset]
                choices = []
                for o in subset:
                    valid = [tp for tp in space.tp_degrees(spec, o.devices_per_node, o.count)
                             if job.search.max_tp is None or tp <= job.search.max_tp]
                    # the TP degrees that leave the fewest devices idle (then the wider one: fewer stages)
                    count = o.count
                    valid.sort(key=lambda tp: (-(count // tp) * tp, -tp))
                    choices.append(valid[:2])
                for tps in itertools.product(*choices):
                    out.extend(_pipelines(job, pool, catalog, spec, mode, alternative, subset, accs, list(tps),
                                          settings, num_layers, batch))
    out.sort(key=lambda r: -r.objective_value)
    return out[:top]


def _pipelines(job: Job, pool: Pool, catalog: Any, spec: Any, mode: str, alternative: bool,
               subset: Sequence[Any], accs: Sequence[Any], tps: list[int], settings: list[space.Setting],
               num_layers: int, batch: int) -> list[RankedPlan]:
    """Pipelines over the offers of ``subset`` with TP degrees ``tps``, for each replica count."""

    out: list[RankedPlan] = []
    budget = None
    if job.constraints.max_budget_per_hour is not None:
        from starverse.catalog import convert

        budget = convert(job.constraints.max_budget_per_hour, job.constraints.currency or pool.currency,
                         pool.currency, catalog=catalog)
    for r in [d for d in space.divisors(batch) if d <= MAX_REPLICAS]:
        full = [o.count // tp // r for o, tp in zip(subset, tps, strict=True)]
        variants = [full]
        price = sum(s * tp * r * o.price_per_hour for o, s, tp in zip(subset, full, tps, strict=True))
        if budget is not None and price > budget:
            # also the same mix scaled down to what the budget rents
            scale = budget / price
            variants.append([max(1, int(s * scale)) for s in full])
        for stages_per in variants:
            out.extend(_one_pipeline(job, pool, catalog, spec, mode, alternative, subset, accs, tps, settings,
                                     num_layers, r, stages_per))
    return out


def _one_pipeline(job: Job, pool: Pool, catalog: Any, spec: Any, mode: str, alternative: bool,
                  subset: Sequence[Any], accs: Sequence[Any], tps: list[int], settings: list[space.Setting],
                  num_layers: int, r: int, stages_per: list[int]) -> list[RankedPlan]:
    """Plans for ``r`` replicas of one pipeline with ``stages_per[i]`` stages on offer ``subset[i]``."""
    from starverse.planner.build import network_for, pricing_for, rank_plan, train_spec

    out: list[RankedPlan] = []
    if any(s < 1 for s in stages_per) or sum(stages_per) > num_layers:
        return out
    if job.search.max_pipeline_stages is not None and sum(stages_per) > job.search.max_pipeline_stages:
        return out
    per_stage = [(o.accelerator, tp, a) for o, tp, a, s in zip(subset, tps, accs, stages_per, strict=True)
                 for _ in range(s)]
    mem = [a.memory_gb * tp for _, tp, a in per_stage]
    flops = [a.peak_tflops(job.train.precision) * tp for _, tp, a in per_stage]
    blend = [m / sum(mem) + f / sum(flops) for m, f in zip(mem, flops, strict=True)]
    splits = {tuple(split_layers(w, num_layers)) for w in (mem, flops, blend)}
    devices = {o.name: s * tp * r for o, s, tp in zip(subset, stages_per, tps, strict=True)}
    for layers, setting in itertools.product(sorted(splits), settings):
        plan = Plan(
            model=job.model,
            train=train_spec(job, mode, setting, any(tp > 1 for tp in tps)),
            groups=[Group(replicas=r, micro_batch=1, stages=_stage_runs(
                [a for a, _, _ in per_stage], [tp for _, tp, _ in per_stage], list(layers)))],
            network=network_for(pool, list(devices)), pricing=pricing_for(pool, list(devices)),
        )
        try:
            rp = rank_plan(job, pool, catalog, spec, plan, devices, "hetero-pipeline", alternative,
                           ("stages on different accelerators, layers split unevenly",))
        except StarverseError:
            continue
        if rp is not None:
            out.append(rp)
    return out
