"""Why nothing fits, and what would: the reasons and suggestions of ``InfeasiblePlanError``.

Every suggestion is itself planned (a search on the changed job or pool) so it comes with its own numbers,
or is marked as not enough either.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

from starverse.errors import InfeasiblePlanError, StarverseError
from starverse.planner.hostmem import HOST_USABLE_FRACTION
from starverse.planner.job import Job
from starverse.planner.pool import Pool
from starverse.planner.result import RankedPlan

STATE_BYTES_PER_PARAM = {"full": 16.0, "lora": 2.0, "qlora": 0.5}
"""Weights + gradients + optimizer state per parameter: full = bf16 weights and gradients (2 + 2) + fp32
master copy and two Adam moments (12) — Rajbhandari et al. 2020 (ZeRO), §3.1; LoRA keeps a bf16 frozen
base (2); QLoRA a 4-bit base (0.5). Adapters and activations come on top."""


def _gb(x: float) -> str:
    return f"{x / 1e12:.3g} TB" if x >= 1e12 else f"{x / 1e9:,.0f} GB"


def _summary(rp: RankedPlan, currency: str) -> str:
    devs = " + ".join(f"{n}×{k}" for k, n in rp.devices.items())
    return f"{devs}: {rp.tokens_per_s:,.0f} tokens/s at {rp.cost_per_hour:,.2f} {currency}/h"


def _try(fn: Callable[[], list[RankedPlan]]) -> RankedPlan | None:
    try:
        ranked = fn()
    except StarverseError:
        return None
    return ranked[0] if ranked else None


def batch_sizes_that_split(job: Job, pool: Pool, spec: Any, up_to: int) -> list[int]:
    """Global batches ``1..up_to`` that a plan using every device (``search.use_all_devices``) can split: each
    offer's group takes a whole number of micro-batches on each of its equal replicas."""
    from starverse.planner import space

    so, t = job.search, job.train
    reach = {0}
    for o in pool.offers:
        grains: set[int] = set()
        for tp in space.tp_degrees(spec, o.devices_per_node, o.count):
            if so.max_tp is not None and tp > so.max_tp:
                continue
            max_pp = o.count // tp if so.max_pipeline_stages is None else min(o.count // tp, so.max_pipeline_stages)
            for pp in space.pp_depths(int(spec.num_layers), max_pp):
                if o.count % (tp * pp) == 0:
                    grains.update(o.count // (tp * pp) * mb for mb in ([t.micro_batch] if t.micro_batch
                                                                        else space.MICRO_BATCHES))
        shares = {k * g for g in grains for k in range(1, up_to // g + 1)}
        reach = {a + b for a in reach for b in shares if a + b <= up_to}
    return sorted(reach - {0})


def _unsplittable_batch(job: Job, pool: Pool, spec: Any) -> str | None:
    """Why a plan that must use every device cannot take the global batch, or None when it can."""
    b = job.train.global_batch
    ok = batch_sizes_that_split(job, pool, spec, 2 * b + 16)
    if b in ok:
        return None
    below = [x for x in ok if x < b][-1:]
    above = [x for x in ok if x > b][:1]
    devices = " + ".join(f"{o.count}×{o.name}" for o in pool.offers)
    near = " or ".join(str(x) for x in below + above)
    return (f"every device must be used ({devices}, one group per kind, equal replicas within a group, whole "
            f"micro-batches), and a global batch of {b} sequences cannot be split that way; to fix: a global batch "
            f"of {near}" + ("" if near else " (none up to twice this one works)") + ", or use fewer devices")


def _host_memory_short(job: Job, pool: Pool, plan: Callable[..., list[RankedPlan]]) -> str | None:
    """When host RAM is what is missing: a plan exists once the nodes have unlimited RAM, and it offloads.
    Says how much each node would need against what it has, and where that figure comes from."""
    if job.train.offload == "none":
        return None
    unlimited = replace(pool, offers=tuple(replace(o, host_memory_gb=math.inf) for o in pool.offers))
    best = _try(partial(plan, job, unlimited))
    if best is None or not best.host_memory_gb_per_node:
        return None
    parts = []
    for name, need in best.host_memory_gb_per_node.items():
        o = pool.offer(name)
        have = "unknown" if o.host_memory_gb is None else f"{o.host_memory_gb:,.0f} GB"
        parts.append(f"{name}: needs {need:,.0f} GB per node for the offloaded state, the nodes have {have} "
                     f"({o.host_memory_source or 'no figure'}; {HOST_USABLE_FRACTION:.0%} usable)")
    return ("host memory is what is missing: the best plan offloads to the CPU (" + best.plan.train.offload + ") "
            "and " + "; ".join(parts) + ". To fix: rent nodes with more RAM and give host_memory_gb: per offer "
            "in the pool file")


def infeasible(job: Job, pool: Pool, catalog: Any, spec: Any) -> InfeasiblePlanError:
    """Build the error for a job that has no plan on ``pool``: what is missing, per offer and in total,
    and what would make it feasible, each option with its own estimate."""
    from starverse.catalog import convert
    from starverse.planner.search import new_stats, search_mode

    if job.search.use_all_devices:
        why = _unsplittable_batch(job, pool, spec)
        if why is not None:  # nothing else matters until the batch splits over the devices
            return InfeasiblePlanError(f"no plan for {job.model} on {pool.source}:", [why])

    def plan(j: Job, p: Pool, mode: str | None = None) -> list[RankedPlan]:
        j = j.model_copy(update={"search": j.search.model_copy(update={"alternatives": False})})
        return search_mode(j, p, catalog, spec, mode or j.train.mode, 1, new_stats())

    mode = job.train.mode
    reasons: list[str] = []
    need = spec.num_params * STATE_BYTES_PER_PARAM[mode]
    have = sum(o.count * o.memory_gb * 1e9 for o in pool.offers)
    per_offer = ", ".join(f"{o.name}: {o.count}×{o.memory_gb:g} GB = {_gb(o.count * o.memory_gb * 1e9)}"
                          for o in pool.offers)
    what = {"full": "weights+gradients+Adam state", "lora": "frozen bf16 weights", "qlora": "4-bit weights"}[mode]
    memory_short = need > have
    if memory_short:
        reasons.append(f"{mode} training of {job.model} needs ≥ {_gb(need)} of {what}; the pool has {_gb(have)} "
                       f"of device memory ({per_offer})")
    else:
        reasons.append(f"{mode} training of {job.model} needs ≥ {_gb(need)} of {what} plus activations; the pool "
                       f"has {_gb(have)} ({per_offer}), but no layout found fits every device within the "
                       "constraints")
    c = job.constraints
    ccy = c.currency or pool.currency
    if c.max_budget_per_hour is not None:
        budget = convert(c.max_budget_per_hour, ccy, pool.currency, catalog=catalog)
        cheapest = min(o.price_per_hour for o in pool.offers)
        affordable = ", ".join(
            f"{o.name}: {min(o.count, math.floor(budget / o.price_per_hour + 1e-9)) if o.price_per_hour else o.count}"
            f" of {o.count}" for o in pool.offers)
        if budget < cheapest:
            reasons.append(f"the budget of {c.max_budget_per_hour:g} {ccy}/h excludes every offer (the cheapest "
                           f"device costs {cheapest:.3g} {pool.currency}/h)")
        else:
            reasons.append(f"the budget of {c.max_budget_per_hour:g} {ccy}/h rents at most: {affordable}")
    if c.max_power_kw is not None:
        reasons.append(f"the power cap is {c.max_power_kw:g} kW")
    if c.deadline_hours is not None:
        reasons.append(f"the deadline is {c.deadline_hours:g} h")
    if c.max_total_cost is not None:
        reasons.append(f"the job may cost at most {c.max_total_cost:g} {ccy}")

    host = _host_memory_short(job, pool, plan)
    if host is not None:
        reasons.append(host)
    suggestions: list[str] = []
    # more devices of one kind: from what the state alone needs, growing until a plan fits (activations,
    # reserve and the ZeRO/TP layout need more than the bare state)
    for o in pool.offers:
        base = math.ceil(need / (o.memory_gb * 1e9))
        if base <= o.count:
            continue
        found = None
        for factor in (1.25, 1.6, 2.0, 3.0):
            n = math.ceil(base * factor)
            bigger = replace(pool, offers=tuple(replace(x, count=max(n, x.count)) if x.name == o.name else x
                                                for x in pool.offers))
            best = _try(partial(plan, job, bigger))
            if best is not None:
                found = (n, best)
                break
        if found is not None:
            suggestions.append(f"rent up to {found[0]} {o.accelerator} (have {o.count}) → "
                               f"{_summary(found[1], pool.currency)}")
        else:
            suggestions.append(f"even {math.ceil(base * 3.0)} {o.accelerator} give no plan within the constraints")
    relaxed = job.model_copy(update={"constraints": job.constraints.model_copy(update={
        "max_budget_per_hour": None, "max_power_kw": None, "deadline_hours": None, "max_total_cost": None})})
    if relaxed.constraints != job.constraints:
        best = _try(lambda: plan(relaxed, pool))
        if best is not None:
            extra = f", {best.power_kw:.1f} kW" + (f", {best.hours:,.1f} h" if best.hours is not None else "")
            suggestions.append(f"drop the budget/power/deadline limits → {_summary(best, pool.currency)}{extra}")
    if job.train.zero_stage not in (None, 3) or job.train.offload not in (None, "optimizer+params"):
        free = job.model_copy(update={"train": job.train.model_copy(update={"zero_stage": None, "offload": None,
                                                                             "recompute": None})})
        best = _try(lambda: plan(free, pool))
        short = None if best else _host_memory_short(free, pool, plan)
        suggestions.append("let the planner choose ZeRO-3 and offload → " +
                           (_summary(best, pool.currency) if best else "not enough either"
                            + (f" ({short})" if short else "")))
    else:
        suggestions.append("ZeRO-3, full recompute and CPU offload were already searched: not enough")
    for alt in ("lora", "qlora"):
        if alt == mode or (mode == "qlora" and alt == "lora"):
            continue
        best = _try(partial(plan, job, pool, alt))
        suggestions.append(f"fine-tune with {alt.upper()} instead → " +
                           (_summary(best, pool.currency) if best else "does not fit either"))
    if job.train.seq_len > 512:
        shorter = job.model_copy(update={"train": job.train.model_copy(update={"seq_len": job.train.seq_len // 2})})
        best = _try(lambda: plan(shorter, pool))
        suggestions.append(f"train on sequences of {job.train.seq_len // 2} tokens → " +
                           (_summary(best, pool.currency) if best else "does not fit either"))
    return InfeasiblePlanError(
        f"no plan for {job.model} on {pool.source}:",
        [*reasons, "what would help: " + " | ".join(suggestions)],
    )
