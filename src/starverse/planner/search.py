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
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from starverse.costmodel.batch import DeviceTable, ModelShape, TrainShape, cross_group_sync_s
from starverse.costmodel.constants import BYTES_PER_VALUE, NETWORK_EFFICIENCY
from starverse.costmodel.profile import check_profile_fits
from starverse.plan import Group, Plan
from starverse.planner import combine, hostmem, pipekinds, pipes, space
from starverse.planner.build import (
    NOMINAL_TOKENS,
    checkpoint_bytes,
    network_for,
    pricing_for,
    rank_plan,
    stages_even,
    train_spec,
    trainable_params,
)
from starverse.planner.job import Job
from starverse.planner.policy import (
    Limits,
    billed_hours,
    billed_hours_per_row,
    paid_cost,
    resolve_objective,
    score,
    within,
)
from starverse.planner.pool import Pool
from starverse.planner.result import RankedPlan, SearchStats

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

EXACT_TABLE_CELLS = 400_000
"""Up to this many (option, micro-batch count) rows, every fitting option gets a time table (exact search)."""
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
MAX_EXACT_EVALUATIONS = 4_000
"""Branch and bound stops after this many exact evaluations (then ``proven_optimal`` is False)."""


@dataclass
class _Ctx:
    """Everything one search (one training mode) shares."""

    job: Job
    pool: Pool
    catalog: Any
    spec: Any
    mode: str
    model: ModelShape
    train: TrainShape
    devices: DeviceTable
    settings: list[space.Setting]
    limits: Limits
    tokens: float | None
    state_bytes: float
    grad_bytes: float

    @property
    def budget_per_hour(self) -> float | None:
        return self.limits.budget_per_hour

    @property
    def batch(self) -> int:
        return self.job.train.global_batch

    @property
    def seq_len(self) -> int:
        return self.job.train.seq_len


@dataclass(frozen=True)
class _Combo:
    """An exactly evaluated combination (internal)."""

    setting: int
    options: tuple[int, ...]
    shares: tuple[int, ...]
    step_time_s: float
    tps: float
    tps_eff: float
    factor: float
    cost_per_hour: float
    power_kw: float
    hours: float
    total_cost: float
    value: float


def _context(job: Job, pool: Pool, catalog: Any, spec: Any, mode: str) -> _Ctx:
    t = job.train
    train = TrainShape(seq_len=t.seq_len, precision=t.precision, mode=mode, lora_rank=t.lora_rank)
    accs = [catalog.accelerator(o.accelerator) for o in pool.offers]
    shape = ModelShape.from_spec(spec)
    for o in pool.offers:
        if o.profile is not None:
            check_profile_fits(o.profile, o.accelerator, shape, o.profile_source)
    devices = DeviceTable.from_accelerators(
        accs, t.precision,
        devices_per_node=[o.devices_per_node for o in pool.offers],
        inter_node_gbps=[o.inter_node_gbps for o in pool.offers],
        price_per_hour=[o.price_per_hour for o in pool.offers],
        profiles=[o.profile for o in pool.offers],
    )
    trainable = trainable_params(spec, mode, t.lora_rank)
    state_bytes = checkpoint_bytes(trainable, t.precision)
    grad_bytes = trainable * BYTES_PER_VALUE[t.precision]
    sets = space.settings(t.zero_stage, t.recompute, t.offload, pipeline=False)
    return _Ctx(job, pool, catalog, spec, mode, shape, train, devices, sets,
                limits_of(job, pool, catalog), t.total_tokens, state_bytes, grad_bytes)


def limits_of(job: Job, pool: Pool, catalog: Any) -> Limits:
    """The job's constraints with its money limits converted to the pool's currency."""
    from starverse.catalog import convert

    c = job.constraints
    ccy = c.currency or pool.currency

    def money(x: float | None) -> float | None:
        return None if x is None else convert(x, ccy, pool.currency, catalog=catalog)

    return Limits(money(c.max_budget_per_hour), c.max_power_kw, c.deadline_hours, money(c.max_total_cost))


def _host_fits(ctx: _Ctx, opts: space.Options) -> npt.NDArray[np.bool_]:
    """Options whose offloaded state fits their nodes' RAM (:mod:`~starverse.planner.hostmem`)."""
    z = np.array([st.zero_stage for st in ctx.settings], dtype=np.int64)[opts.setting]
    off = np.array([st.offload for st in ctx.settings], dtype=np.int64)[opts.setting]
    offers = ctx.pool.offers
    dpn = np.array([o.devices_per_node for o in offers], dtype=np.float64)[opts.offer]
    host = np.array([np.nan if o.host_memory_gb is None else o.host_memory_gb for o in offers])[opts.offer]
    need = hostmem.uniform_host_gb_per_node(ctx.model, ctx.train, opts.tp, opts.pp, opts.replicas, z, off, dpn)
    return hostmem.host_ok(need, host)


def _spot_factor(ctx: _Ctx, lam: FloatArray, nodes: FloatArray) -> FloatArray:
    return pipekinds.spot_factor_of(ctx, lam, nodes)


def _sync_s(ctx: _Ctx, num_groups: int, min_pp: int, gbps: float | None = None) -> float:
    """Cross-group gradient all-reduce, as the scalar cost model charges it: each pipeline stage syncs its
    slice in parallel (the shallowest pipeline sets the slice), over the link between the groups' offers
    (``gbps``: the slowest measured ``network.links`` among them, default ``cross_offer_gbps``) at the cost
    model's network efficiency."""
    if num_groups <= 1:
        return 0.0
    link = ctx.pool.cross_offer_gbps if gbps is None else gbps
    return float(cross_group_sync_s(ctx.grad_bytes / max(min_pp, 1), num_groups, link * NETWORK_EFFICIENCY))


def _screen(ctx: _Ctx, opts: space.Options, rate: FloatArray) -> IntArray:
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


def _options(ctx: _Ctx, stats: SearchStats) -> tuple[space.Options, FloatArray, FloatArray]:
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
    cells = int(kmax.sum())
    if cells <= EXACT_TABLE_CELLS or (pool.num_devices <= EXACT_SMALL_POOL_DEVICES
                                      and cells <= EXACT_SMALL_POOL_CELLS):
        tables, power, rows = space.time_tables(ctx.model, ctx.train, ctx.devices, opts, ctx.settings, ctx.batch)
        stats.evaluated_rows += rows
        ok = np.logical_and(np.isfinite(tables).any(axis=1), _host_fits(ctx, opts))
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
    fits = np.asarray(est.fits) & _host_fits(ctx, opts)
    rate = np.where(fits, opts.replicas * opts.micro_batch * k / est.step_time_s, 0.0)
    opts, rate = opts.take(fits), rate[fits]
    keep = _screen(ctx, opts, rate)
    opts = opts.take(keep)
    tables, power, rows = space.time_tables(ctx.model, ctx.train, ctx.devices, opts, ctx.settings, ctx.batch,
                                            dense_k_up_to=SCREENED_DENSE_MICRO_BATCHES)
    stats.evaluated_rows += rows
    ok2 = np.isfinite(tables).any(axis=1)
    return opts.take(ok2), tables[ok2], power[ok2]


def _evaluate(ctx: _Ctx, opts: space.Options, tables: FloatArray, power: FloatArray, setting: int,
              members: Sequence[int]) -> _Combo | None:
    """Exact value of one combination (None if no integer split exists or a constraint fails)."""
    t_star, shares = combine.best_split([tables[i] for i in members], ctx.batch)
    if not math.isfinite(t_star):
        return None
    offers = [ctx.pool.offers[int(opts.offer[i])] for i in members]
    n = [int(opts.num_devices[i]) for i in members]
    step = t_star + _sync_s(ctx, len(members), min(int(opts.pp[i]) for i in members),
                            ctx.pool.slowest_link_gbps(o.name for o in offers))
    lam = sum(k * o.interruptions_per_hour for k, o in zip(n, offers, strict=True))
    nodes = sum(math.ceil(k / o.devices_per_node) for k, o in zip(n, offers, strict=True))
    factor = float(_spot_factor(ctx, np.asarray(lam, dtype=float), np.asarray(nodes, dtype=float)))
    if not math.isfinite(factor):
        return None
    tps = ctx.batch * ctx.seq_len / step
    tps_eff = tps / factor
    price = sum(k * o.price_per_hour for k, o in zip(n, offers, strict=True))
    pw = float(sum(power[i] for i in members))
    tokens = ctx.tokens if ctx.tokens is not None else NOMINAL_TOKENS
    hours = tokens / tps_eff / 3600.0
    total = float(sum(k * o.price_per_hour * billed_hours(np.asarray(hours), o.billing_granularity_s)
                      for k, o in zip(n, offers, strict=True)))
    if not within(ctx.limits, price, pw, hours, total):
        return None
    value = float(score(ctx.job.objective, np.asarray(tps_eff), np.asarray(price), np.asarray(total),
                        np.asarray(hours)))
    return _Combo(setting, tuple(int(i) for i in members), shares, step, tps, tps_eff, factor, price, pw,
                  hours, total, value)


SCREENED_DENSE_MICRO_BATCHES = 16
"""Screened searches tabulate every micro-batch count per replica up to this, then a ×1.25 grid (the
batch split of a combination can then only use those counts)."""
MULTI_GROUP_SETTINGS = 6
"""Screened searches: settings kept for multi-group combinations (by their best single-group bound)."""
MULTI_GROUP_OFFERS = 6
"""Screened searches: offers per setting kept for multi-group combinations (by their best bound)."""


def _combinations(ctx: _Ctx, opts: space.Options, rate: FloatArray, t_min: FloatArray, power: FloatArray,
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
    # a lower bound: the fastest link between any two offers
    sync_by_pp = {g: np.array([_sync_s(ctx, g, p, ctx.pool.fastest_link_gbps) for p in range(int(opts.pp.max()) + 1)])
                  for g in range(1, max_g + 1)}

    def bounds(grid: IntArray) -> tuple[IntArray, FloatArray]:
        """Rows of ``grid`` (option indices, one column per group) within the caps, and their bounds."""
        g = grid.shape[1]
        price = price_opt[grid].sum(axis=1)
        # budget and power first: they need no time table, and they thin the grid before the rest
        ok = within(Limits(ctx.limits.budget_per_hour, ctx.limits.max_power_kw), price,
                    power[grid].sum(axis=1), 0.0, 0.0)
        grid, price = grid[ok], price[ok]
        f = _spot_factor(ctx, lam_opt[grid].sum(axis=1), nodes_opt[grid].sum(axis=1))
        # step ≥ max(B / Σρ, slowest group's shortest step) + the cross-group sync (an exact lower bound)
        with np.errstate(divide="ignore"):
            t_lb = np.maximum(ctx.batch / rate[grid].sum(axis=1), t_min[grid].max(axis=1))
        t_lb = t_lb + sync_by_pp[g][opts.pp[grid].min(axis=1)]
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
        settings_all = sorted(by_setting, key=lambda x: -by_setting[x])[:MULTI_GROUP_SETTINGS]
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


def _single_frontier(ctx: _Ctx, opts: space.Options, tables: FloatArray, power: FloatArray,
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
    f = _spot_factor(ctx, lam, np.ceil(n / dpn))
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


def _branch_and_bound(ctx: _Ctx, opts: space.Options, tables: FloatArray, power: FloatArray, top: int,
                      stats: SearchStats) -> list[_Combo]:
    """Exact evaluation of combinations in decreasing bound order until the bound closes."""
    _single_frontier(ctx, opts, tables, power, stats)
    rate = combine.rate_bound(tables)
    t_min = tables.min(axis=1)
    members, sets, bound = _combinations(ctx, opts, rate, t_min, power, stats)
    stats.combinations += len(bound)
    order = np.argsort(-bound, kind="stable")
    # best plan per rented device set: the top list shows different device mixes, not the same mix with a
    # memory setting that happens to tie
    best: dict[tuple[tuple[int, int], ...], tuple[float, int, _Combo]] = {}
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
        combo = _evaluate(ctx, opts, tables, power, int(sets[ci]), m)
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


def _plan_of(ctx: _Ctx, opts: space.Options, combo: _Combo) -> tuple[Plan, dict[str, int]]:
    groups = []
    devices: dict[str, int] = {}
    for i, s in zip(combo.options, combo.shares, strict=True):
        offer = ctx.pool.offers[int(opts.offer[i])]
        groups.append(Group(
            replicas=int(opts.replicas[i]), micro_batch=int(opts.micro_batch[i]),
            batch_share=s / ctx.batch if len(combo.options) > 1 else None,
            stages=stages_even(offer.accelerator, int(opts.tp[i]), int(opts.pp[i]), int(ctx.spec.num_layers)),
        ))
        devices[offer.name] = int(opts.num_devices[i])
    sp = any(int(opts.tp[i]) > 1 for i in combo.options)
    plan = Plan(
        model=ctx.job.model, train=train_spec(ctx.job, ctx.mode, ctx.settings[combo.setting], sp),
        groups=groups, network=network_for(ctx.pool, list(devices)), pricing=pricing_for(ctx.pool, list(devices)),
    )
    return plan, devices


def best_combinations(job: Job, pool: Pool, catalog: Any, spec: Any, mode: str, top: int = 1
                      ) -> tuple[list[_Combo], space.Options, SearchStats]:
    """The search core without the final scalar re-estimate: best combinations, the options they index,
    and the statistics (used by :func:`search_mode` and by the exactness test against brute force)."""
    stats: SearchStats = new_stats()
    job, _ = resolve_objective(job, pool)
    _, opts, combos = _best(job, pool, catalog, spec, mode, top, stats)
    return combos, opts, stats


def _best(job: Job, pool: Pool, catalog: Any, spec: Any, mode: str, top: int, stats: SearchStats
          ) -> tuple[_Ctx, space.Options, list[_Combo]]:
    """Options of the space and the ``top`` best combinations of them (branch and bound)."""
    ctx = _context(job, pool, catalog, spec, mode)
    opts, tables, power = _options(ctx, stats)
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
        plan, devices = _plan_of(ctx, opts, combo)
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
            rp = rank_plan(job, pool, catalog, spec, pipeline_plan(ctx, best), _pipe_devices(ctx, best),
                           "hetero-pipeline", alternative,
                           ("stages on different accelerators, layers split exactly by memory and speed",))
            if rp is not None:
                stats.hetero_pipelines += 1
                ranked.append(rp)
    ranked.sort(key=lambda r: -r.objective_value)
    return ranked[:top]


def _pipe_devices(ctx: _Ctx, pipe: pipes.Pipeline) -> dict[str, int]:
    return {ctx.pool.offers[o].name: n for o, n in pipe.devices().items()}


def pipeline_plan(ctx: _Ctx, pipe: pipes.Pipeline) -> Plan:
    """The :class:`~starverse.plan.Plan` of a heterogeneous pipeline found by :mod:`~starverse.planner.pipes`."""
    from starverse.planner.hetero import stage_runs

    offers = ctx.pool.offers
    accs = [offers[o].accelerator for o, _, k in pipe.blocks for _ in range(k)]
    tps = [t for _, t, k in pipe.blocks for _ in range(k)]
    names = [offers[o].name for o, _, _ in pipe.blocks]
    return Plan(
        model=ctx.job.model,
        train=train_spec(ctx.job, ctx.mode, ctx.settings[pipe.setting], any(t > 1 for t in tps)),
        groups=[Group(replicas=pipe.replicas, micro_batch=pipe.micro_batch,
                      stages=stage_runs(accs, tps, list(pipe.layers)))],
        network=network_for(ctx.pool, names), pricing=pricing_for(ctx.pool, names),
    )


__all__ = ["best_combinations", "new_stats", "rank_plan", "resolve_objective", "search_mode"]
