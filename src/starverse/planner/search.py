"""``planner.search(job, pool, catalog)``: the device mix and parallel plan that maximise the objective.

Outline (details in ``docs/planner.md``):

1. Enumerate group options per offer (:mod:`~starverse.planner.space`): TP, pipeline depth, replicas,
   micro-batch and memory settings, within the offer's count and the budget.
2. Evaluate each at its full batch share with the vectorised cost model; drop what does not fit.
   Small spaces keep every option; large ones keep, per offer and setting, the options on the
   (devices ↑, rate ↑) Pareto front, thinned (``SearchStats.screened``).
3. Compute the kept options' time tables ``T[s]`` (step time for ``s`` sequences of the batch).
4. Branch and bound over combinations of options of distinct offers sharing one setting (one group = a
   single-accelerator plan, several = heterogeneous data parallelism), with the rate bound of
   :mod:`~starverse.planner.combine`, each evaluated exactly (integer batch split, cross-group sync, spot
   overhead, constraints).
5. Heterogeneous pipelines (:mod:`~starverse.planner.pipes`): branch and bound over offer blocks, TP,
   replicas, micro-batch and settings, with the exact integer layer split (:mod:`~starverse.planner.pipesplit`),
   against the best plan of step 4 — always, so the answer never depends on ``top``.
6. The top plans are built as :class:`~starverse.plan.Plan` and re-estimated with the scalar
   ``costmodel.estimate`` — the numbers reported are the ones ``starverse estimate`` prints for the plan.

The search context and exact evaluation are in :mod:`~starverse.planner.searchctx`, the options and
combinations (steps 1-4's candidates) in :mod:`~starverse.planner.candidates`; this module is the driver.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

from starverse.planner import combine, pipes, space
from starverse.planner.build import NOMINAL_TOKENS, rank_plan
from starverse.planner.candidates import candidate_options, combinations, single_frontier
from starverse.planner.job import Job
from starverse.planner.policy import resolve_objective
from starverse.planner.pool import Pool
from starverse.planner.result import RankedPlan, SearchStats
from starverse.planner.searchctx import (
    Combo,
    SearchContext,
    combo_plan,
    evaluate_combo,
    limits_of,
    pipe_devices,
    pipeline_plan,
    search_context,
)
from starverse.planner.searchctx import host_fits as _host_fits
from starverse.planner.searchctx import search_context as _context
from starverse.planner.searchctx import spot_factor as _spot_factor
from starverse.planner.searchctx import sync_s as _sync_s

FloatArray = npt.NDArray[np.float64]

MAX_EXACT_EVALUATIONS = 4_000
"""Branch and bound stops after this many exact evaluations (then ``proven_optimal`` is False)."""


def _branch_and_bound(ctx: SearchContext, opts: space.Options, tables: FloatArray, power: FloatArray, top: int,
                      stats: SearchStats) -> list[Combo]:
    """Exact evaluation of combinations in decreasing bound order until the bound closes."""
    single_frontier(ctx, opts, tables, power, stats)
    rate = combine.rate_bound(tables)
    t_min = tables.min(axis=1)
    members, sets, bound = combinations(ctx, opts, rate, t_min, power, stats)
    stats.combinations += len(bound)
    order = np.argsort(-bound, kind="stable")
    # best plan per rented device set: the top list shows different device mixes, not the same mix with a
    # memory setting that happens to tie
    best: dict[tuple[tuple[int, int], ...], tuple[float, int, Combo]] = {}
    kth = -math.inf
    evaluated = 0
    for rank, ci in enumerate(order):
        if len(best) >= top and bound[ci] <= kth + 1e-12 * abs(kth):
            break
        if evaluated >= MAX_EXACT_EVALUATIONS:
            stats.proven_optimal = False
            stats.bound_gap = float(abs(bound[ci] - kth) / abs(kth)) if math.isfinite(kth) and kth else math.inf
            break
        m = [int(i) for i in members[ci] if i >= 0]
        combo = evaluate_combo(ctx, opts, tables, power, int(sets[ci]), m, stats.layout_refused)
        evaluated += 1
        if combo is None:
            continue
        label = "+".join(f"{int(opts.num_devices[i])}×{ctx.pool.offers[int(opts.offer[i])].name}" for i in m)
        stats.frontier_points.append((combo.hours, combo.total_cost, label))
        key = tuple(sorted((int(opts.offer[i]), int(opts.num_devices[i])) for i in m))
        if key not in best or combo.value > best[key][0]:
            best[key] = (combo.value, -rank, combo)
            if len(best) >= top:
                kth = sorted((v[0] for v in best.values()), reverse=True)[top - 1]
    stats.exact_evaluations += evaluated
    ranked = sorted(best.values(), key=lambda x: (-x[0], -x[1]))
    return [c for _, _, c in ranked[:top]]


def best_combinations(job: Job, pool: Pool, catalog: Any, spec: Any, mode: str, top: int = 1
                      ) -> tuple[list[Combo], space.Options, SearchStats]:
    """The search core without the final scalar re-estimate: best combinations, the options they index,
    and the statistics (used by :func:`search_mode` and by the exactness test against brute force)."""
    stats: SearchStats = new_stats()
    job, _ = resolve_objective(job, pool)
    _, opts, combos = _best(job, pool, catalog, spec, mode, top, stats)
    return combos, opts, stats


def _best(job: Job, pool: Pool, catalog: Any, spec: Any, mode: str, top: int, stats: SearchStats
          ) -> tuple[SearchContext, space.Options, list[Combo]]:
    """Options of the space and the ``top`` best combinations of them (branch and bound)."""
    ctx = search_context(job, pool, catalog, spec, mode)
    opts, tables, power = candidate_options(ctx, stats)
    combos = _branch_and_bound(ctx, opts, tables, power, max(top, 1), stats) if len(opts) else []
    return ctx, opts, combos


def new_stats() -> SearchStats:
    """Fresh counters for one search."""
    return SearchStats()


def search_mode(job: Job, pool: Pool, catalog: Any, spec: Any, mode: str, top: int,
                stats: SearchStats) -> list[RankedPlan]:
    """Search one training mode; ranked plans (possibly empty)."""
    ctx, opts, combos = _best(job, pool, catalog, spec, mode, top, stats)
    ranked: list[RankedPlan] = []
    alternative = mode != job.train.mode
    for combo in combos:
        plan, devices = combo_plan(ctx, opts, combo)
        kind = "single" if len(combo.options) == 1 else "hetero-dp"
        rp = rank_plan(job, pool, catalog, spec, plan, devices, kind, alternative)
        if rp is not None:
            ranked.append(rp)
    so = job.search
    pipelines_allowed = not so.use_all_devices and (so.max_pipeline_stages is None or so.max_pipeline_stages > 1)
    if so.hetero_pipelines and pipelines_allowed:
        # always searched (branch and bound against the best plan above): the answer never depends on `top`
        stats.pipelines_searched = True
        incumbent = combos[0].value if combos else -math.inf
        best = pipes.search(ctx, incumbent, stats)
        if best is not None:
            rp = rank_plan(job, pool, catalog, spec, pipeline_plan(ctx, best), pipe_devices(ctx, best),
                           "hetero-pipeline", alternative,
                           ("stages on different accelerators, layers split exactly by memory and speed",))
            if rp is not None:
                stats.hetero_pipelines += 1
                ranked.append(rp)
    ranked.sort(key=lambda r: -r.objective_value)
    return ranked[:top]


__all__ = [  # the API, and what tests and planner.build import from here (defined in searchctx / candidates)
    "NOMINAL_TOKENS", "_context", "_host_fits", "_spot_factor", "_sync_s", "best_combinations", "limits_of",
    "new_stats", "pipeline_plan", "rank_plan", "resolve_objective", "search_mode",
]
