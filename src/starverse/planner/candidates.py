"""Candidate generation for :mod:`~starverse.planner.search`: the group options worth combining, with their time
tables (steps 1-3 of the search), and the combinations of them with their rate bounds (step 4's input).

Small spaces keep every fitting option (exact); large ones are screened to each (offer, setting)'s
(devices ↑, rate ↑) Pareto front (``SearchStats.screened``). :func:`single_frontier` adds every single-group
option's time-vs-cost front to the search's frontier points.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import numpy.typing as npt

from starverse.planner import space
from starverse.planner.build import NOMINAL_TOKENS
from starverse.planner.policy import Limits, billed_hours_per_row, paid_cost, score, within
from starverse.planner.result import SearchStats
from starverse.planner.searchctx import SearchContext, host_fits, spot_factor

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

EXACT_TABLE_CELLS = 400_000
"""Up to this many (option, micro-batch count) rows under 1F1B, every fitting option gets a time table (exact
search; its interleaved variants too)."""
EXACT_SMALL_POOL_DEVICES = 16
"""Pools of at most this many devices are always searched exactly (up to ``EXACT_SMALL_POOL_CELLS`` rows)."""
EXACT_SMALL_POOL_CELLS = 4_000_000
"""Row limit of the exact search on small pools (a few seconds)."""
KEEP_PER_SETTING = 10
"""Large spaces: options kept per (offer, setting) after screening."""
MAX_COMBINATIONS = 600_000
"""Bound at most about this many combinations: when the full product is larger, each (setting, offer set)
keeps its share of the budget by shortening the per-offer lists to their best-rate options (and the search
is then marked ``screened``)."""
SCREENED_DENSE_MICRO_BATCHES = 16
"""Screened searches tabulate every micro-batch count per replica up to this, then a ×1.25 grid (the
batch split of a combination can then only use those counts)."""
MULTI_GROUP_SETTINGS = 6
"""Screened searches: memory settings kept for multi-group combinations (by their best single-group bound),
each with its schedules (1F1B, interleaved)."""
MULTI_GROUP_OFFERS = 6
"""Screened searches: offers per setting kept for multi-group combinations (by their best bound)."""


def _screen(ctx: SearchContext, opts: space.Options, rate: FloatArray) -> IntArray:
    """Large spaces: per (offer, setting), the options on the (devices ↑, rate ↑) Pareto front, thinned.

    Two fronts are kept: one over all options (for combinations, where a group takes part of the batch)
    and one over the options that can take the whole batch alone (``replicas × micro_batch`` divides it).
    """
    n = opts.num_devices
    key = opts.offer * 10_000 + opts.setting
    whole = (ctx.batch % (opts.replicas * opts.micro_batch)) == 0
    keep: set[int] = set()
    for k in np.unique(key):
        for mask in (key == k, (key == k) & whole):
            idx = np.flatnonzero(mask)
            order = idx[np.lexsort((-rate[idx], n[idx]))]
            front = []
            best = -1.0
            for i in order:
                if rate[i] > best * (1 + 1e-9):
                    front.append(int(i))
                    best = float(rate[i])
            if len(front) > KEEP_PER_SETTING:
                pick = np.unique(np.round(np.linspace(0, len(front) - 1, KEEP_PER_SETTING)).astype(int))
                front = [front[p] for p in pick]
            keep.update(front)
    return np.asarray(sorted(keep), dtype=np.int64)


def candidate_options(ctx: SearchContext, stats: SearchStats) -> tuple[space.Options, FloatArray, FloatArray]:
    """Options worth combining, their time tables and power."""
    pool = ctx.pool
    caps = space.offer_caps(pool.offers, ctx.budget_per_hour)
    so = ctx.job.search
    opts = space.enumerate_options(ctx.spec, ctx.batch, pool.offers, ctx.settings, ctx.job.train.micro_batch,
                                   caps, max_tp=so.max_tp, max_pipeline_stages=so.max_pipeline_stages,
                                   use_all_devices=so.use_all_devices)
    if len(opts) == 0:
        return opts, np.zeros((0, ctx.batch + 1)), np.zeros(0)
    kmax = ctx.batch // (opts.replicas * opts.micro_batch)
    # rows under 1F1B decide (the interleaved variants of the same options come with them)
    one = np.array([st.virtual_stages == 1 for st in ctx.settings])[opts.setting]
    cells = int(kmax[one].sum())
    if cells <= EXACT_TABLE_CELLS or (pool.num_devices <= EXACT_SMALL_POOL_DEVICES
                                      and cells <= EXACT_SMALL_POOL_CELLS):
        tables, power, rows = space.time_tables(ctx.model, ctx.train, ctx.devices, opts, ctx.settings, ctx.batch)
        stats.evaluated_rows += rows
        ok = np.logical_and(np.isfinite(tables).any(axis=1), host_fits(ctx, opts))
        stats.options += len(opts)
        return opts.take(ok), tables[ok], power[ok]
    # large space: a coarser replica grid (every count to 8, then ×1.5) for the screening pass
    opts = space.enumerate_options(ctx.spec, ctx.batch, pool.offers, ctx.settings, ctx.job.train.micro_batch,
                                   caps, dense_replicas_up_to=8, growth=1.5, max_tp=so.max_tp,
                                   max_pipeline_stages=so.max_pipeline_stages, use_all_devices=so.use_all_devices)
    stats.options += len(opts)
    # Memory per device never grows with the replica count (ZeRO shards over more replicas; fewer
    # micro-batches per replica keep fewer in flight), so a configuration that does not fit at its largest
    # replica count fits at none: test that row first and expand only the configurations that fit.
    base = np.stack([opts.offer, opts.tp, opts.pp, opts.micro_batch, opts.setting], axis=1)
    first = np.ones(len(opts), dtype=bool)
    first[1:] = (base[1:] != base[:-1]).any(axis=1)
    cfg = np.cumsum(first) - 1
    last = np.r_[np.flatnonzero(first)[1:] - 1, len(opts) - 1]
    probe, _ = space.evaluate_full_share(ctx.model, ctx.train, ctx.devices, opts.take(last), ctx.settings,
                                         ctx.batch)
    stats.evaluated_rows += len(last)
    opts = opts.take(np.asarray(probe.fits)[cfg])
    est, k = space.evaluate_full_share(ctx.model, ctx.train, ctx.devices, opts, ctx.settings, ctx.batch)
    stats.evaluated_rows += len(opts)
    stats.screened = True
    fits = np.asarray(est.fits) & host_fits(ctx, opts)
    rate = np.where(fits, opts.replicas * opts.micro_batch * k / est.step_time_s, 0.0)
    opts, rate = opts.take(fits), rate[fits]
    keep = _screen(ctx, opts, rate)
    opts = opts.take(keep)
    tables, power, rows = space.time_tables(ctx.model, ctx.train, ctx.devices, opts, ctx.settings, ctx.batch,
                                            dense_k_up_to=SCREENED_DENSE_MICRO_BATCHES)
    stats.evaluated_rows += rows
    ok2 = np.isfinite(tables).any(axis=1)
    return opts.take(ok2), tables[ok2], power[ok2]


def combinations(ctx: SearchContext, opts: space.Options, rate: FloatArray, t_min: FloatArray, power: FloatArray,
                  stats: SearchStats) -> tuple[IntArray, IntArray, FloatArray]:
    """Combinations (members padded with -1, setting, bound) that pass the budget/power caps.

    Single groups are bounded all at once. Multi-group combinations are enumerated per (setting, offer set);
    in screened searches only the most promising settings and offers (by their best single-group bound)
    are combined, and each (setting, offer set) gets an equal share of ``MAX_COMBINATIONS``.
    """
    max_g = ctx.job.search.max_groups
    price_opt = opts.num_devices * np.array([o.price_per_hour for o in ctx.pool.offers])[opts.offer]
    lam_opt = opts.num_devices * np.array([o.interruptions_per_hour for o in ctx.pool.offers])[opts.offer]
    dpn = np.array([o.devices_per_node for o in ctx.pool.offers])[opts.offer]
    nodes_opt = np.ceil(opts.num_devices / dpn)
    gran_opt = np.array([o.billing_granularity_s for o in ctx.pool.offers])[opts.offer]
    accs = [o.accelerator for o in ctx.pool.offers]
    tokens = ctx.tokens if ctx.tokens is not None else NOMINAL_TOKENS

    def bounds(grid: IntArray) -> tuple[IntArray, FloatArray]:
        """Rows of ``grid`` (option indices, one column per group) within the caps, and their bounds."""
        g = grid.shape[1]
        price = price_opt[grid].sum(axis=1)
        # budget and power first: they need no time table, and they thin the grid before the rest
        ok = within(Limits(ctx.limits.budget_per_hour, ctx.limits.max_power_kw), price,
                    power[grid].sum(axis=1), 0.0, 0.0)
        grid, price = grid[ok], price[ok]
        f = spot_factor(ctx, lam_opt[grid].sum(axis=1), nodes_opt[grid].sum(axis=1))
        # step ≥ max(B / Σρ, slowest group's shortest step): the cross-group sync adds a group's share of ONE
        # ring over every replica minus its own ring (joint_sync_s), which can be ~0 when each group already
        # spans nodes over the same link, so the only bound on it that always holds is 0
        with np.errstate(divide="ignore"):
            t_lb = np.maximum(ctx.batch / rate[grid].sum(axis=1), t_min[grid].max(axis=1))
        tps_ub = ctx.batch * ctx.seq_len / t_lb / f
        with np.errstate(divide="ignore"):
            hours_lb = tokens / tps_ub / 3600.0
        total_lb = np.zeros_like(hours_lb)
        for j in range(g):
            total_lb += paid_cost(price_opt[grid[:, j]], billed_hours_per_row(hours_lb, gran_opt[grid[:, j]]))
        bound = score(ctx.job.objective, tps_ub, price, total_lb, hours_lb)
        ok = np.isfinite(bound) & (tps_ub > 0) & within(ctx.limits, price, 0.0, hours_lb, total_lb)
        return grid[ok], bound[ok]

    members: list[IntArray] = []
    bound_parts: list[FloatArray] = []
    use_all = ctx.job.search.use_all_devices
    num_offers = len(ctx.pool.offers)
    single, single_bound = bounds(np.arange(len(opts), dtype=np.int64)[:, None])
    if use_all and num_offers > 1:  # a single group leaves the other offers' devices idle
        single, single_bound = single[:0], single_bound[:0]
    padded = np.full((single.shape[0], max_g), -1, dtype=np.int64)
    padded[:, :1] = single
    members.append(padded)
    bound_parts.append(single_bound)

    # what each (setting, offer) can do on its own, to pick what to combine in screened searches
    best_alone: dict[tuple[int, int], float] = {}
    for i, b in zip(single[:, 0], single_bound, strict=True):
        key = (int(opts.setting[i]), int(opts.offer[i]))
        best_alone[key] = max(best_alone.get(key, -np.inf), float(b))
    screened = bool(stats.screened)
    settings_all = [int(x) for x in np.unique(opts.setting)]
    if screened:
        by_setting: dict[int, float] = {}
        for (si, _), b in best_alone.items():
            by_setting[si] = max(by_setting.get(si, -np.inf), b)
        # the most promising memory settings, each with every schedule (chunk count) it has
        mem: dict[tuple[int, int, int], list[int]] = {}
        for si in sorted(by_setting, key=lambda x: -by_setting[x]):
            st = ctx.settings[si]
            mem.setdefault((st.zero_stage, st.recompute, st.offload), []).append(si)
        settings_all = [si for group in list(mem.values())[:MULTI_GROUP_SETTINGS] for si in group]
    jobs: list[tuple[tuple[int, ...], list[IntArray]]] = []
    for si in settings_all:
        in_set = np.flatnonzero(opts.setting == si)
        per_offer = {int(o): in_set[opts.offer[in_set] == o] for o in np.unique(opts.offer[in_set])}
        offers = sorted(per_offer)
        if screened:
            offers = sorted(sorted(offers, key=lambda o: -best_alone.get((si, o), -np.inf))[:MULTI_GROUP_OFFERS])
        for g in range(2, min(max_g, len(offers)) + 1):
            for subset in itertools.combinations(offers, g):
                if len({accs[o] for o in subset}) < g:
                    continue  # one group per accelerator: the plan's pricing is per accelerator
                if use_all and g < num_offers:
                    continue  # every offer takes part
                jobs.append((subset, [per_offer[o] for o in subset]))
    total = sum(math.prod(len(x) for x in lists) for _, lists in jobs)
    share = MAX_COMBINATIONS / max(len(jobs), 1)
    for subset, lists in jobs:
        g = len(subset)
        if total > MAX_COMBINATIONS and math.prod(len(x) for x in lists) > share:
            per = max(1, int(share ** (1.0 / g)))  # shorten each list to its best-rate members
            lists = [x[np.argsort(-rate[x], kind="stable")[:per]] for x in lists]
            stats.screened = True
        grid = np.stack([a.ravel() for a in np.meshgrid(*lists, indexing="ij")], axis=1)
        grid, bound = bounds(grid)
        padded = np.full((grid.shape[0], max_g), -1, dtype=np.int64)
        padded[:, :g] = grid
        members.append(padded)
        bound_parts.append(bound)
    all_members = np.concatenate(members)
    return all_members, opts.setting[all_members[:, 0]], np.concatenate(bound_parts)


def single_frontier(ctx: SearchContext, opts: space.Options, tables: FloatArray, power: FloatArray,
                     stats: SearchStats) -> None:
    """Add the time-vs-cost Pareto front of every single-group option (each one exact at the full batch) to
    the frontier points, so the plot shows the whole trade-off, not only what branch and bound visited."""
    if ctx.job.search.use_all_devices and len(ctx.pool.offers) > 1:
        return  # single groups are not plans when every offer must take part
    step = tables[:, ctx.batch]
    n = opts.num_devices
    price = n * np.array([o.price_per_hour for o in ctx.pool.offers])[opts.offer]
    lam = n * np.array([o.interruptions_per_hour for o in ctx.pool.offers])[opts.offer]
    dpn = np.array([o.devices_per_node for o in ctx.pool.offers])[opts.offer]
    gran = np.array([o.billing_granularity_s for o in ctx.pool.offers])[opts.offer]
    f = spot_factor(ctx, lam, np.ceil(n / dpn))
    with np.errstate(divide="ignore", invalid="ignore"):
        hours = (ctx.tokens if ctx.tokens is not None else NOMINAL_TOKENS) * step * f / (ctx.batch * ctx.seq_len) / 3600
    total = paid_cost(price, billed_hours_per_row(hours, gran))
    ok = np.isfinite(hours) & np.isfinite(total) & within(ctx.limits, price, power, hours, total)
    idx = np.flatnonzero(ok)
    idx = idx[np.lexsort((total[idx], hours[idx]))]
    best = np.inf
    for i in idx:
        if total[i] < best * (1 - 1e-9):
            best = float(total[i])
            label = f"{int(n[i])}×{ctx.pool.offers[int(opts.offer[i])].name}"
            stats.frontier_points.append((float(hours[i]), best, label))
