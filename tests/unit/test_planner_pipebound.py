"""The heterogeneous-pipeline bounds hold against direct evaluation: memory caps by place in the pipeline
against the cost model's own stage memory, capacity tables against every placement, the least bottleneck
against the breakpoints of the capacities."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from starverse.catalog import load_catalog
from starverse.costmodel.stage import stage_costs
from starverse.models import load_model
from starverse.planner import job_from_dict, pipebound, pool_from_dict, space
from starverse.planner.pipekinds import Kinds, capacity_tables, family_kinds, model_numbers_1f1b, stage_rows
from starverse.planner.search import _context, resolve_objective


@pytest.fixture(scope="module")
def ctx():
    catalog = load_catalog(profile="")
    job = job_from_dict({"model": "llama-2-7b", "train": {"seq_len": 4096, "global_batch": 16, "tokens": 1e9},
                         "objective": "throughput"})
    pool = pool_from_dict({"currency": "USD", "offers": [
        {"accelerator": "rtx-4090", "count": 32, "price_per_hour": 0.4},
        {"accelerator": "t4", "count": 32, "price_per_hour": 0.2}]}, catalog)
    job, _ = resolve_objective(job, pool)
    return _context(job, pool, catalog, load_model(job.model), "full")


@pytest.mark.parametrize(("r", "mb", "setting"), [(1, 1, 0), (1, 2, 2), (2, 1, 3), (4, 4, 0)])
def test_caps_by_place_are_the_cost_models_memory(ctx, r, mb, setting):
    """``cap_j`` is the most layers a middle stage holds with ``min(j, m)`` micro-batches in flight, as
    ``stage_costs`` prices a stage ``j`` places from the end of a pipeline."""
    total = int(ctx.spec.num_layers)
    caps = space.offer_caps(ctx.pool.offers, None)
    tps = [[t for t in space.tp_degrees(ctx.spec, o.devices_per_node, c)] for o, c in zip(ctx.pool.offers, caps,
                                                                                          strict=True)]
    kinds = family_kinds(ctx, r, mb, setting, caps, tps, total, total)
    assert kinds.offer.size > 0
    m = ctx.batch // (r * mb)
    lay = np.arange(1, total, dtype=np.float64)
    checked = 0
    for i in range(kinds.offer.size):
        for j in range(1, int(kinds.kmax[i]) + 2):
            if j > kinds.per.shape[1]:
                break
            n = lay.size
            rows = stage_rows(ctx, np.full(n, kinds.offer[i]), np.full(n, float(kinds.tp[i])), lay, False, False,
                              np.ones(n), float(j + 1), r, mb, m, setting, bool(kinds.tp.max() > 1))
            c = stage_costs(model_numbers_1f1b(ctx), rows)
            fits = c["memory_gb"] <= c["capacity_gb"]
            most = int(lay[fits].max()) if fits.any() else 0
            assert int(kinds.per[i, j - 1]) == most, (i, j)
            checked += 1
    assert checked > 4


def test_capacity_tables_are_the_best_placement():
    """``T[k, q]`` = the most layers ``k`` stages hold, each at most ``q`` and its own cap, whatever places
    (caps sorted by place) they take among ``k`` or more."""
    rng = random.Random(3)
    for _ in range(20):
        per = sorted((rng.randint(0, 6) for _ in range(5)), reverse=True)
        one, z = np.ones(1), np.zeros(1, dtype=np.int64)
        tab = capacity_tables(Kinds(z, z, one, np.array([per], dtype=np.int64), z + 5, one, one, one), 8)
        for k in range(1, 6):
            for q in range(9):
                # any k distinct places among the first 7 (caps beyond the table: 0)
                padded = [*per, 0, 0]
                best = max(sum(min(q, padded[p]) for p in places)
                           for places in itertools.combinations(range(7), k))
                assert tab[0, k, q] == best


def test_least_bottleneck_never_above_the_truth():
    rng = np.random.default_rng(5)
    for _ in range(30):
        cols, q_n = int(rng.integers(1, 4)), 9
        a = rng.uniform(0.5, 2.0, size=(1, cols))
        inc = rng.integers(0, 3, size=(1, cols, q_n - 1))
        tab = np.concatenate([np.zeros((1, cols, 1)), np.cumsum(inc, axis=2)], axis=2).astype(np.float64)
        cap = pipebound.Tables(a, tab)
        total = int(rng.integers(1, 12))
        got = pipebound.tau_lb(cap, total)[0]
        # breakpoints: the capacity only changes at τ = q · a_c
        taus = sorted({0.0} | {q * float(a[0, c]) for c in range(cols) for q in range(q_n)})
        held = [cap(np.array([t]), np.array([0])).sum() for t in taus]
        ok = [t for t, h in zip(taus, held, strict=True) if h >= total]
        if not ok:
            assert not np.isfinite(got)
        else:
            assert got <= min(ok) + 1e-12
            assert got >= min(ok) * (1 - 1e-3) - 1e-9


def test_least_bottleneck_of_shared_columns_is_exact():
    """:meth:`Shared.least_tau` (the columns a node's children share set up once, one more column per row)
    is the least breakpoint holding the layers (never above it, within 1e-8), and never below the
    bisection's lower end."""
    rng = np.random.default_rng(6)
    for _ in range(40):
        cols, q_n, rows = int(rng.integers(0, 4)), 9, 3
        a = rng.uniform(0.5, 2.0, size=cols + rows)
        inc = rng.integers(0, 3, size=(cols + rows, q_n - 1))
        tab = np.concatenate([np.zeros((cols + rows, 1)), np.cumsum(inc, axis=1)], axis=1).astype(np.float64)
        total = int(rng.integers(1, 12))
        shared = pipebound.Shared.of(a[:cols], tab[:cols], total)
        got = shared.least_tau(a[cols:], tab[cols:], total)
        for i in range(rows):
            cs = [*range(cols), cols + i]
            cap = pipebound.Tables(a[None, cs], tab[None, cs])
            taus = sorted({0.0} | {q * float(a[c]) for c in cs for q in range(q_n)})
            ok = [t for t in taus if cap(np.array([t]), np.array([0])).sum() >= total]
            if not ok:
                assert not np.isfinite(got[i])
                continue
            assert min(ok) * (1 - 1e-7) <= got[i] <= min(ok)
            assert got[i] >= pipebound.tau_lb(cap, total)[0]


def test_core_bound_holds_for_every_schedule():
    """The core bound is never above ``m max S + (Σ S - max S) / v`` of any integer split at any ``v ≤ vmax``
    (1F1B is ``v = 1``): the smallest bubble of the searched schedules, and below 1F1B's alone when v > 1."""
    rng = np.random.default_rng(11)
    lowered = 0
    for _ in range(40):
        p, total, m, vmax = int(rng.integers(2, 4)), int(rng.integers(3, 9)), int(rng.integers(1, 9)), 4
        a = rng.uniform(0.5, 2.0, size=(1, p))
        caps = rng.integers(1, total + 1, size=p)
        q = np.arange(total + 1, dtype=np.float64)
        tab = np.stack([np.minimum(q, c) for c in caps])[None, :, :]
        cap = pipebound.Tables(a, tab)
        tau = pipebound.tau_lb(cap, total)
        mand = np.ones((1, p))
        got = float(pipebound.core_grid_schedules(m, vmax, tau, a, cap, mand, total)[1].min())
        only_1f1b = float(pipebound.core_grid_schedules(m, 1, tau, a, cap, mand, total)[1].min())
        assert got <= only_1f1b
        lowered += got < only_1f1b
        for split in itertools.product(range(1, total + 1), repeat=p):
            if sum(split) != total or any(x > c for x, c in zip(split, caps, strict=True)):
                continue
            s = a[0] * np.array(split)
            for v in range(1, vmax + 1):
                assert got <= m * s.max() + (s.sum() - s.max()) / v + 1e-9
    assert lowered  # interleaving does lower the bound
