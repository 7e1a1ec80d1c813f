"""The planner's public entry points: :func:`search` (job + pool -> ranked plans), :func:`plan_for` (the API
behind ``starverse.accelerate``). The search itself is in :mod:`~starverse.planner.search`."""

from __future__ import annotations

import time
from typing import Any

from starverse.errors import ConfigError, InfeasiblePlanError
from starverse.planner.job import Job, Objective
from starverse.planner.pool import Pool
from starverse.planner.result import PlanResult, pareto_frontier
from starverse.planner.search import new_stats, resolve_objective, search_mode


def search(job: Job, pool: Pool, catalog: Any = None, top: int = 5, spec: Any = None) -> PlanResult:
    """Ranked plans for ``job`` on ``pool`` (best first), or ``InfeasiblePlanError`` saying why and what
    would help. Pure numpy (no torch). ``spec``: the model's ``ModelSpec`` when ``job.model`` only names it
    (e.g. a config dict given to :func:`~starverse.planner.devices.plan_for_devices`)."""
    from starverse.catalog import load_catalog
    from starverse.models import load_model
    from starverse.planner import explain

    t0 = time.perf_counter()
    catalog = catalog if catalog is not None else load_catalog()
    spec = spec if spec is not None else load_model(job.model)
    job, objective_note = resolve_objective(job, pool)
    stats = new_stats()
    ranked = search_mode(job, pool, catalog, spec, job.train.mode, top, stats)
    notes: list[str] = [objective_note] if objective_note else []
    if not ranked and job.train.mode == "full" and job.search.alternatives:
        for alt in ("lora", "qlora"):
            alt_ranked = search_mode(job, pool, catalog, spec, alt, top, stats)
            if alt_ranked:
                ranked.extend(alt_ranked)
        if ranked:
            ranked.sort(key=lambda r: -r.objective_value)
            ranked = ranked[:top]
            notes.append(
                f"full training of {job.model} cannot run on this pool within the constraints; the plans below "
                "are fine-tuning ALTERNATIVES (LoRA/QLoRA), not full training"
            )
    refused = "; ".join(f"{why} ({n} plans)" for why, n in sorted(stats.layout_refused.items()))
    refused = refused and f"runtime layout rule (planner.policy.runtime_layout_rule): {refused}"
    if not ranked:
        err = explain.infeasible(job, pool, catalog, spec)
        if refused:  # name the rule: plans that fit were left out because the runtime does not run them
            err = InfeasiblePlanError(err.message, [*err.reasons, f"left out by the {refused}"])
        raise err
    if refused:
        notes.append(f"left out by the {refused}")
    for r in ranked:
        if r.kind == "hetero-pipeline" and r.hours is not None and r.total_cost is not None:
            stats.frontier_points.append((r.hours, r.total_cost, "hetero-pipeline"))
    stats.seconds = time.perf_counter() - t0
    return PlanResult(
        plans=tuple(ranked), objective=job.objective, currency=pool.currency, model=job.model, stats=stats,
        frontier=pareto_frontier(stats.frontier_points), per_job=job.train.total_tokens is not None,
        notes=tuple(notes),
    )


def plan_for(model_id: str, policy: str | Objective = Objective.COST_PERFORMANCE,
             max_budget_per_hour: float | None = None, pool: Any = None, job_overrides: dict[str, Any] | None = None,
             catalog: Any = None, top: int = 5) -> PlanResult:
    """Python API behind ``starverse.accelerate(model_id=..., policy=..., max_budget=..., pool=...)``.

    ``policy`` is the objective; ``max_budget_per_hour`` the budget per hour in the pool's currency; ``pool``
    a :class:`Pool`, a path to ``pool.yaml`` or a mapping in its format; ``job_overrides`` is merged into the
    job (e.g. ``{"train": {"seq_len": 2048, "global_batch": 64}}``).
    """
    from starverse.catalog import load_catalog
    from starverse.planner.job import job_from_dict
    from starverse.planner.pool import load_pool, pool_from_dict

    catalog = catalog if catalog is not None else load_catalog()
    if pool is None:
        raise ConfigError("plan_for: no pool given; pass pool= a pool.yaml path, a mapping in its format or a Pool")
    if isinstance(pool, Pool):
        pool_obj = pool
    elif isinstance(pool, dict):
        pool_obj = pool_from_dict(pool, catalog)
    else:
        pool_obj = load_pool(pool, catalog)
    data: dict[str, Any] = {"model": model_id, "train": {"seq_len": 2048, "global_batch": 64},
                            "objective": str(policy)}
    for k, v in (job_overrides or {}).items():
        data[k] = {**data[k], **v} if isinstance(v, dict) and isinstance(data.get(k), dict) else v
    if max_budget_per_hour is not None:
        data.setdefault("constraints", {})
        data["constraints"] = {**data["constraints"], "max_budget_per_hour": max_budget_per_hour}
    return search(job_from_dict(data, "<plan_for>"), pool_obj, catalog, top)



__all__ = ["plan_for", "resolve_objective", "search"]
