"""The least price of a heterogeneous pipeline's blocks (:mod:`starverse.planner.pipeprice`) against plain
loops over every choice of blocks, its fractional relaxation below it, and the bounds built on them never
below what a pipeline of those blocks achieves."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from starverse.planner import pipeprice


def _instance(rng: random.Random, total: int):
    """Random kinds (per-layer time, memory caps by place that never grow, most stages, price per stage)
    grouped by offer."""
    n_groups = rng.randint(2, 4)
    kinds, groups = [], []
    for _ in range(n_groups):
        ks = []
        for _ in range(rng.randint(1, 3)):
            kmax = rng.randint(1, 5)
            per = sorted((rng.randint(0, total) for _ in range(kmax)), reverse=True)
            per = [max(p, 1) for p in per]
            kinds.append((rng.uniform(0.5, 3.0), per, kmax, rng.uniform(0.2, 5.0)))
            ks.append(len(kinds) - 1)
        groups.append(ks)
    n = len(kinds)
    kmax_all = max(k[2] for k in kinds)
    tab = np.zeros((n, kmax_all + 1, total + 1))
    q = np.arange(total + 1, dtype=float)
    for i, (_, per, kmax, _) in enumerate(kinds):
        for k in range(1, kmax_all + 1):
            tab[i, k] = sum(np.minimum(q, per[j]) for j in range(min(k, kmax)))
    a = np.array([k[0] for k in kinds])
    price = np.array([k[3] for k in kinds])
    kmax = np.array([k[2] for k in kinds], dtype=np.int64)
    kt = pipeprice.KindTables(a, tab, price)
    grs = [pipeprice.Group(np.array(ks, dtype=np.int64), np.ones(len(ks), dtype=np.int64), kmax[ks]) for ks in groups]
    return kt, grs, kmax


def _brute(tau: float, kt, groups, kmax, need: int, min_blocks: int, mandatory=()) -> float:
    """Plain loops: every group left out or one of its blocks (kind, stages)."""
    choices = []
    for gi, g in enumerate(groups):
        opts = [] if gi in mandatory else [None]
        for kd in g.kinds:
            for k in range(int(g.klo[list(g.kinds).index(kd)]), int(g.khi[list(g.kinds).index(kd)]) + 1):
                opts.append((int(kd), k))
        choices.append(opts)
    best = np.inf
    for pick in itertools.product(*choices):
        used = [c for c in pick if c is not None]
        if len(used) < min_blocks:
            continue
        cap = 0.0
        for kd, k in used:
            q = min(int(np.floor(tau / kt.a[kd] + 1e-9)), kt.tab.shape[2] - 1) if np.isfinite(tau) else -1
            cap += kt.tab[kd, k, q]
        if cap >= need:
            best = min(best, sum(k * kt.price[kd] for kd, k in used))
    return best


@pytest.mark.parametrize("seed", range(16))
def test_least_price_is_the_brute_force_minimum(seed):
    rng = random.Random(seed)
    total = rng.randint(3, 12)
    kt, groups, kmax = _instance(rng, total)
    taus = np.array([rng.uniform(0.3, 3.0 * total) for _ in range(4)] + [np.inf])
    min_blocks = rng.choice([0, 1, 2])
    mandatory = tuple(i for i in range(len(groups)) if rng.random() < 0.2)
    curves = [pipeprice.price_curve(taus, kt, g, total) for g in groups]
    got = pipeprice.least_price(curves, [i in mandatory for i in range(len(groups))], total, min_blocks)
    want = np.array([_brute(t, kt, groups, kmax, total, min_blocks, mandatory) for t in taus])
    assert (np.isinf(got) == np.isinf(want)).all()
    assert np.allclose(got[np.isfinite(want)], want[np.isfinite(want)], rtol=1e-12)
    # the fractional relaxation is never above it (no block minimum, no mandatory block)
    if not mandatory and min_blocks == 0:
        frac = pipeprice.fractional_price(taus, kt, groups, np.full(taus.shape, float(total)))
        assert (frac <= got * (1 + 1e-9) + 1e-12).all()
    # the suffix tables hold the same least prices
    suffix = pipeprice.suffix_tables(taus, kt, groups, total)
    if not mandatory:
        assert np.allclose(suffix[0, min_blocks, :, total], got)


@pytest.mark.parametrize("seed", range(10))
def test_per_price_bound_is_never_below_a_pipeline_of_those_blocks(seed):
    """Any choice of blocks and any bottleneck at least ``tau0`` gives step × price at least what
    :func:`pipeprice.per_price_ub` allows (tokens per step / its bound), on its own intervals and on a
    node's (:func:`pipeprice.node_per_price`)."""
    rng = random.Random(100 + seed)
    total = rng.randint(3, 10)
    kt, groups, kmax = _instance(rng, total)
    m = rng.randint(1, 16)
    tau0 = rng.uniform(0.1, 2.0)
    work, extra, sum_lb = 1000.0, rng.uniform(0.0, 2.0), rng.uniform(0.0, 5.0)
    kept: list[np.ndarray] = []
    ub, lo, hi = pipeprice.per_price_ub(work, m, tau0, sum_lb, extra, kt, groups, total, 2,
                                        target=rng.choice([np.inf, rng.uniform(1.0, 200.0)]), suffix=kept)
    suffix = pipeprice.suffix_tables(hi, kt, groups, total)
    if lo.size:  # the knapsack's states on the way are the suffix tables (all but groups[0:], never read)
        assert np.array_equal(kept[0][1:], suffix[1:])
    node = pipeprice.node_per_price(work, m, lo, hi, suffix[0], np.array([tau0]), sum_lb, np.array([extra]),
                                    np.zeros(1), np.zeros((1, lo.size)), total, np.array([2]))[0]
    for _ in range(12):
        tau = tau0 * rng.uniform(1.0, 50.0)
        price = _brute(tau, kt, groups, kmax, total, 2)
        if not np.isfinite(price):
            continue
        step = (m - 1.0) * tau + max(tau, sum_lb) + extra
        assert work / (step * price) <= ub * (1 + 1e-9)
        assert work / (step * price) <= node * (1 + 1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_tables_built_from_memory_caps_give_the_same_prices(seed):
    """:class:`pipeprice.KindTables` without ``tab`` (built from the stages' caps) prices as with it."""
    rng = random.Random(300 + seed)
    total = rng.randint(3, 12)
    kt, groups, _ = _instance(rng, total)
    # the caps behind ``tab``: a stage's cap is the step of the table at its highest level
    per = np.diff(kt.tab[:, :, -1], axis=1).astype(np.int64)
    lazy = pipeprice.KindTables(kt.a, None, kt.price, per, kt.tab.shape[2])
    taus = np.array([rng.uniform(0.3, 3.0 * total) for _ in range(4)] + [np.inf])
    for g in groups:
        assert np.array_equal(pipeprice.price_curve(taus, kt, g, total), pipeprice.price_curve(taus, lazy, g, total))
    need = np.full(taus.shape, float(total))
    assert np.array_equal(pipeprice.fractional_price(taus, kt, groups, need),
                          pipeprice.fractional_price(taus, lazy, groups, need))
