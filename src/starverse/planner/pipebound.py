"""Bounds of the heterogeneous-pipeline branch and bound (:mod:`.pipes`): layer capacities under a
bottleneck, the least bottleneck, the bubble-aware bound of ``w · max S + Σ S``, and tokens/s per price.

A node's pipeline is described by *columns*: the blocks chosen (``k`` stages of one kind: offer and TP), the
child's block and the offers still open. Under a bottleneck ``τ`` (the slowest stage's time per
micro-batch), each column can hold at most some number of layers — its *capacity* — because a stage of
per-layer time ``a`` holds at most ``⌊τ / a⌋`` layers and at most what its memory allows at its place in
the pipeline (:class:`Tables`). Everything here is a valid bound: capacities never below the truth,
bottlenecks and step times never above it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Envelope:
    """Capacities from rates: a block of ``count`` stages of per-layer time ``a`` (``slopes = count / a``)
    holds ``count · ⌊τ / a⌋`` (integer layers), an open offer (``count = 0``) at most ``τ · slopes``; never
    more than ``limits`` (memory). Arrays are (rows, columns)."""

    slopes: FloatArray
    limits: FloatArray
    count: FloatArray

    def __call__(self, tau: FloatArray, rows: IntArray) -> FloatArray:
        """Capacity of the columns of ``rows`` under ``tau`` (one τ per entry of ``rows``)."""
        sl, cnt = self.slopes[rows], self.count[rows]
        with np.errstate(invalid="ignore", divide="ignore"):
            per = np.where(cnt > 0, cnt * np.floor(tau[:, None] * sl / np.where(cnt > 0, cnt, 1.0) + 1e-9),
                           tau[:, None] * sl)
        return np.minimum(np.where(np.isfinite(per), per, 0.0), self.limits[rows])

    def full(self) -> FloatArray:
        """Capacity at any ``τ``."""
        return self.limits

    def tau_hi(self) -> FloatArray:
        """A ``τ`` at which every column holds its most."""
        sl, li = self.slopes, self.limits
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.asarray(np.where(sl > 0, li / np.where(sl > 0, sl, 1.0), 0.0).max(axis=1) * 1.01 + 1e-12)


@dataclass(frozen=True)
class Tables:
    """Capacities from per-level tables: column ``c`` of row ``r`` holds ``tab[r, c, q]`` layers when each of
    its stages may take ``q = ⌊τ / a[r, c]⌋`` layers (``q`` saturates at the table's end). For a block of
    ``k`` stages of one kind, ``tab[q] = Σ_{j ≤ k} min(q, cap_j)`` with ``cap_j`` its memory cap at the
    ``j``-th least number of micro-batches in flight (``pipekinds.family_kinds``)."""

    a: FloatArray
    tab: FloatArray
    """(rows, columns, levels)."""

    def __call__(self, tau: FloatArray, rows: IntArray) -> FloatArray:
        """Capacity of the columns of ``rows`` under ``tau``."""
        return self.of(rows)(tau)

    def of(self, rows: IntArray) -> Callable[[FloatArray], FloatArray]:
        """Capacity of the columns of ``rows`` under a ``τ`` per row (the gather set up once)."""
        n_cols, n_q = self.tab.shape[1], self.tab.shape[2]
        a, flat = self.a[rows], self.tab.reshape(-1)
        base = (rows[:, None] * n_cols + np.arange(n_cols)[None, :]) * n_q

        def at(tau: FloatArray) -> FloatArray:
            """(rows, columns) for ``τ`` (rows,); (rows, points, columns) for (rows, points)."""
            t = tau if tau.ndim == 2 else tau[:, None]
            # (``a`` is finite and positive: an empty column has a zero table)
            q = np.minimum(t[:, :, None] / a[:, None, :] + 1e-9, n_q - 1.0).astype(np.int64)
            got = flat[base[:, None, :] + q]
            return np.asarray(got if tau.ndim == 2 else got[:, 0], dtype=np.float64)
        return at

    def full(self) -> FloatArray:
        """Capacity at any ``τ``."""
        return np.asarray(self.tab[:, :, -1], dtype=np.float64)

    def tau_hi(self) -> FloatArray:
        """A ``τ`` at which every column holds its most."""
        a = np.where(np.isfinite(self.a), self.a, 0.0)
        return np.asarray(a.max(axis=1) * (self.tab.shape[2] - 1) * 1.01 + 1e-12)


Capacity = Envelope | Tables


BISECTIONS = 16
"""Halvings of the bracket in :func:`tau_lb` (its lower end is returned: fewer only loosen the bound)."""


ROUND = 4
"""Halvings :func:`tau_lb` takes at once on capacity tables (every midpoint they may visit, one gather;
four is about the fastest for a few rows of a few columns)."""


def _bisect_round(at: Callable[[FloatArray], FloatArray], lo: FloatArray, hi: FloatArray, total: int, n: int
                  ) -> tuple[FloatArray, FloatArray]:
    """``n`` halvings of the brackets ``[lo, hi]`` at once: every midpoint they may visit (the same
    floating-point midpoints, level by level), then the bracket around the first point holding ``total``
    (capacity never falls as ``τ`` grows, so the halvings end there)."""
    if n <= 0:
        return lo, hi
    pts = np.stack([lo, hi], axis=1)
    for _ in range(n):
        nxt = np.empty((pts.shape[0], 2 * pts.shape[1] - 1))
        nxt[:, 0::2], nxt[:, 1::2] = pts, (pts[:, :-1] + pts[:, 1:]) / 2
        pts = nxt
    short = (at(pts[:, 1:-1]).sum(axis=2) < total).sum(axis=1)  # the midpoints not holding ``total``
    rows = np.arange(pts.shape[0])
    return pts[rows, short], pts[rows, short + 1]


def tau_lb(cap: Capacity, total: int) -> FloatArray:
    """Least ``τ`` with ``Σ_j capacity_j(τ) ≥ total`` per row (inf if never).

    Found by bisection; the lower end of the final bracket is returned, so the result never exceeds the
    true least ``τ`` (a valid lower bound)."""
    reach = cap.full().sum(axis=1)
    out = np.full(reach.shape[0], np.inf)
    ok = np.flatnonzero(reach >= total - 1e-9)
    if not ok.size:
        return out
    hi = cap.tau_hi()[ok]
    lo = np.zeros_like(hi)
    if isinstance(cap, Tables):
        at = cap.of(ok)
        for n in [ROUND] * (BISECTIONS // ROUND) + [BISECTIONS % ROUND]:
            lo, hi = _bisect_round(at, lo, hi, total, n)
    else:
        for _ in range(BISECTIONS):
            mid = (lo + hi) / 2
            enough = cap(mid, ok).sum(axis=1) >= total
            hi = np.where(enough, mid, hi)
            lo = np.where(enough, lo, mid)
    out[ok] = lo
    return out


@dataclass(frozen=True)
class Shared:
    """The columns all children of one node share (the blocks chosen, the open offers): per-layer time ``a``
    (columns,), finite and positive, and capacity tables ``tab`` (columns, levels) as in :class:`Tables`.
    ``reach[c]`` is the least of their breakpoints (every ``q · a_c``) at which together they hold ``c``
    layers (inf if none). Set up once per node, so that :meth:`least_tau` bounds its children (one more
    column each) with one gather."""

    a: FloatArray
    tab: FloatArray
    reach: FloatArray

    @classmethod
    def of(cls, a: FloatArray, tab: FloatArray, total: int) -> Shared:
        """The shared columns ``a`` (columns,) with their tables ``tab`` (columns, levels), up to ``total``."""
        pts = np.unique((a[:, None] * np.arange(tab.shape[1])[None, :]).ravel()) if a.size else np.zeros(1)
        held = _held(a, tab, pts)  # never falls along the sorted points
        at = np.searchsorted(held, np.arange(total + 1, dtype=np.float64), side="left")
        return cls(a, tab, np.r_[pts, np.inf][at])

    def least_tau(self, a: FloatArray, tab: FloatArray, total: int) -> FloatArray:
        """The least ``τ`` at which the shared columns and one more per row (per-layer time ``a`` (rows,),
        finite and positive; table ``tab`` (rows, levels)) hold ``total`` layers (inf if never): from
        ``τ ≥ q · a`` the row's column holds at least ``tab[q]`` and the shared ones the rest from
        ``reach[total - tab[q]]``, so the least over ``q`` of the larger of the two holds ``total``, and the
        least ``τ`` is one of them. Capacities step at ``⌊τ / a + 10⁻⁹⌋``, at most ``10⁻⁹`` relatively
        before the breakpoints, so the result, lowered by ``10⁻⁸`` relatively, is never above the least ``τ``
        (and never below :func:`tau_lb`'s bracket)."""
        q = np.arange(tab.shape[1], dtype=np.float64)
        rest = np.clip(total - tab, 0, total).astype(np.int64)
        first = np.maximum(a[:, None] * q[None, :], self.reach[rest]).min(axis=1)
        return np.asarray(first * (1.0 - 1e-8), dtype=np.float64)


def _held(a: FloatArray, tab: FloatArray, tau: FloatArray) -> FloatArray:
    """Capacity of the columns ``a`` / ``tab`` together at each ``τ`` of ``tau`` (any shape)."""
    if not a.size:
        return np.zeros(tau.shape)
    q = np.minimum(tau[..., None] / a + 1e-9, tab.shape[1] - 1.0).astype(np.int64)
    return np.asarray(tab[np.arange(a.size), q].sum(axis=-1), dtype=np.float64)


GRID_STEPS = 70
"""Points of the geometric grid (×1.01 apart) over which :func:`core_lb` bounds the bottleneck level."""


def _fill(cost: FloatArray, cap: FloatArray, need: FloatArray) -> FloatArray:
    """Least ``Σ cost · x`` with ``0 ≤ x ≤ cap`` and ``Σ x = need`` per row (columns already sorted by cost;
    inf where the capacity falls short)."""
    before = np.cumsum(cap, axis=1) - cap
    take = np.clip(need[:, None] - before, 0.0, cap)
    out = (cost * take).sum(axis=1)
    with np.errstate(invalid="ignore"):
        return np.where(cap.sum(axis=1) >= need - 1e-9, out, np.inf)


def core_grid(w: float, tau_lb_: FloatArray, cost: FloatArray, cap: Capacity, mand: FloatArray,
              total: int) -> tuple[FloatArray, FloatArray]:
    """Lower bounds of ``w · max S + Σ S`` per row and bottleneck interval, with ``S_i ≥ a_i L_i``: columns
    are groups of stages (a block: ``mand`` stages of at least one layer each, holding at most ``cap`` layers
    under bottleneck ``τ``, each layer costing at least ``cost``; an open offer: ``mand = 0``).

    For bottleneck ``τ``, ``Σ S ≥ g(τ)`` = the cheapest way to place the layers within the capacities (a
    fractional knapsack, exact by filling the cheapest columns first), and ``g`` does not grow with ``τ``;
    so on each step ``[τ_j, τ_{j+1}]`` of a geometric grid from ``τ_lb``, ``w τ + g(τ) ≥ w τ_j + g(τ_{j+1})``,
    and beyond the grid ``≥ w τ_J + g(∞)``. Returns the intervals' upper ends ``τ_{j+1}`` (inf for the last)
    and the bounds, (rows, G + 1); inf where nothing fits."""
    order = np.argsort(cost, axis=1, kind="stable")
    cost = np.take_along_axis(cost, order, axis=1)
    mand = np.take_along_axis(mand, order, axis=1)
    lim = np.take_along_axis(cap.full(), order, axis=1)
    base = np.where(mand > 0, mand * cost, 0.0).sum(axis=1)
    need = total - mand.sum(axis=1)
    safe = np.where(np.isfinite(tau_lb_), tau_lb_, 0.0)

    # every grid point of every row at once: rows repeated G times
    n, g_n = cost.shape[0], GRID_STEPS
    grid = safe[:, None] * 1.01 ** np.arange(1, g_n + 1)[None, :]  # τ_{j+1}, j = 0..G-1
    rep = np.repeat(np.arange(n), g_n)
    with np.errstate(invalid="ignore"):
        got = np.take_along_axis(cap(grid.ravel(), rep), order[rep], axis=1)
        room = np.maximum(got - mand[rep], 0.0)
    g_next = (base[rep] + _fill(cost[rep], room, need[rep])).reshape(n, g_n)
    steps = w * (grid / 1.01) + g_next
    tail = w * safe * 1.01 ** g_n + base + _fill(cost, np.maximum(lim - mand, 0.0), need)
    out = np.concatenate([steps, tail[:, None]], axis=1)
    bad = ~(np.isfinite(tau_lb_) & (need >= -1e-9))
    out[bad] = np.inf
    return np.concatenate([grid, np.full((n, 1), np.inf)], axis=1), out


def core_grid_schedules(m: int, vmax: int, tau_lb_: FloatArray, cost: FloatArray, cap: Capacity,
                        mand: FloatArray, total: int) -> tuple[FloatArray, FloatArray]:
    """:func:`core_grid` for the least pipeline core of every schedule searched: 1F1B's ``(m - 1) max S + Σ S``
    and interleaved 1F1B's ``m max S + (Σ S - max S) / v = ((m v - 1) max S + Σ S) / v``. The latter is
    linear in ``1 / v``, so over ``v ∈ [1, vmax]`` it is least at an end: the bound is the lesser of the two
    ends per interval (both grids are the same: they depend only on ``tau_lb_``)."""
    taus, steps = core_grid(m - 1.0, tau_lb_, cost, cap, mand, total)
    if vmax > 1:
        steps = np.minimum(steps, core_grid(m * vmax - 1.0, tau_lb_, cost, cap, mand, total)[1] / vmax)
    return taus, steps


def core_lb(w: float, tau_lb_: FloatArray, cost: FloatArray, cap: Capacity, mand: FloatArray,
            total: int) -> FloatArray:
    """Lower bound of ``w · max S + Σ S`` per row (the least of :func:`core_grid`'s; the bubble of a deep
    pipeline is in it: balanced stages make ``Σ S ≈ p τ``)."""
    return np.asarray(core_grid(w, tau_lb_, cost, cap, mand, total)[1].min(axis=1))


def price_step_lb(tau_hi: FloatArray, steps: FloatArray, extra: FloatArray, price_c: FloatArray,
                  have: FloatArray, need_total: int, open_ratio: FloatArray) -> FloatArray:
    """Lower bound of ``price × step`` per row, from :func:`core_grid`'s intervals: in the interval ending at
    ``τ_{j+1}`` the step is at least ``steps_j + extra``, the blocks already chosen hold at most ``have_j``
    layers, and the open offers must hold the rest at no more than ``open_ratio_j`` layers per unit of price
    (their best capacity per price at ``τ_{j+1}``; capacities never shrink as ``τ`` grows), so the price is at
    least ``price_c + (L - have_j) / open_ratio_j``."""
    need = np.maximum(need_total - have, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        add = np.where(need > 0, np.where(open_ratio > 0, need / open_ratio, np.inf), 0.0)
        ps = (steps + extra[:, None]) * (price_c[:, None] + add)
    ps = np.where(np.isnan(ps), np.inf, ps)
    return np.asarray(ps.min(axis=1))


PRICE_GRID = 40
"""Points of the grid over the open offers' share in :func:`per_price_ub`."""





@functools.lru_cache(maxsize=4)
def _price_grid(n: int) -> FloatArray:
    """:func:`per_price_ub`'s grid of open rates as fractions of the most, after a 0 (read only)."""
    g = np.r_[0.0, np.geomspace(1e-4, 1.0, n)]
    g.setflags(write=False)
    return g


def per_price_ub(m: int, total: int, seqs: float, rate_c: FloatArray, price_c: FloatArray, fixed: FloatArray,
                 r_open: float, e_open: float, w: float | None = None) -> FloatArray:
    """Upper bound of tokens/s per unit of price of any pipeline completing a node.

    The step is at least ``(m - 1) L / R + c`` (``R = Σ 1/a`` over the stages, the layer rate: the bottleneck
    is at least ``L / R``; ``c = fixed``: every layer once at the cheapest per-layer time, the optimizer step
    and the sends), so tokens/s ≤ ``seqs · m · R / ((m - 1) L + c R)`` (``seqs = r mb seq``).
    The open offers add a rate ``x ∈ [0, r_open]`` at a price of at least ``x / e_open``; on each step
    ``[x_j, x_{j+1}]`` of a grid the ratio is at most its numerator at ``x_{j+1}`` over its denominator at
    ``x_j`` (both grow with ``x``). ``w`` (``m - 1`` unless given) replaces ``m - 1`` as the weight of the
    bottleneck: interleaved 1F1B with ``v`` chunks has ``m - 1 / v`` (and ``fixed`` counts ``Σ S / v``)."""
    w = m - 1.0 if w is None else w
    xs = r_open * _price_grid(PRICE_GRID) if r_open > 0 else np.zeros(1)
    lo, hi = xs[:-1] if xs.size > 1 else xs, xs[1:] if xs.size > 1 else xs
    rc, pc, c = rate_c[:, None], price_c[:, None], fixed[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        add_price = lo[None, :] / e_open if e_open > 0 else np.where(lo[None, :] > 0, np.inf, 0.0)
        num = seqs * m * (rc + hi[None, :])
        den = (w * total + c * (rc + lo[None, :])) * (pc + add_price)
        ratio = np.where(den > 0, num / den, np.inf)
        ratio = np.where(np.isnan(ratio), np.inf, ratio)
        out = ratio.max(axis=1)
        # nothing chosen yet: every stage comes from the open offers, rate per price at most e_open
        empty = (rate_c <= 0) & (price_c <= 0)
        out = np.where(empty, seqs * m * e_open / (w * total) if w > 0 else np.inf, out)
    return np.asarray(out, dtype=np.float64)
