"""The least price of a heterogeneous pipeline that holds the model under a bottleneck (a bound of
:mod:`.pipes`' branch and bound for the money objectives).

A pipeline has at most one block per offer (``k`` stages of one kind: offer and TP), so an offer's capacity
is that of one block, not a rate at which layers can be bought: under a bottleneck ``τ`` a block of kind
``κ`` and ``k`` stages holds at most ``tab[κ, k, ⌊τ / a_κ⌋]`` layers (:func:`.pipekinds.capacity_tables`:
per-layer time and memory caps by place) and costs ``k · π_κ`` per hour. The least price of holding ``need``
layers with at most one block per offer (exactly one for the blocks already chosen) and at least
``min_blocks`` blocks is a multiple-choice knapsack, solved exactly over the integer layer counts by a
dynamic program (:func:`least_price`). Capacities never shrink as ``τ`` grows, so the least price never grows
with ``τ``: on an interval of bottlenecks ``[τ_j, τ_{j+1}]`` the price is at least the least price at
``τ_{j+1}`` and the step at least its value at ``τ_j`` (:func:`per_price_ub`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Group:
    """One offer's choices: a block of kind ``kinds[i]`` with ``klo[i]..khi[i]`` stages; a ``mandatory``
    group must contribute its block (a block already chosen), another may be left out."""

    kinds: IntArray
    klo: IntArray
    khi: IntArray
    mandatory: bool = False


@dataclass(frozen=True)
class KindTables:
    """Per-layer time ``a``, capacity tables ``tab`` (kinds, stages + 1, levels) and price per stage; or,
    with ``tab`` None, the stages' memory caps ``per`` (kinds, stages) and ``levels``, from which
    :meth:`at` builds the rows it needs as :func:`.pipekinds.capacity_tables` does."""

    a: FloatArray
    tab: FloatArray | None
    price: FloatArray
    per: IntArray | None = None
    levels: int = 0

    @property
    def n_q(self) -> int:
        """Levels (the most layers a stage may take, plus one)."""
        return int(self.tab.shape[2]) if self.tab is not None else self.levels

    def at(self, kd: IntArray, q: IntArray) -> FloatArray:
        """(G, kinds, stages + 1): ``tab[kd[j], :, q[g, j]]`` for ``q`` (G, kinds)."""
        if self.tab is not None:
            st = np.arange(self.tab.shape[1])
            return np.asarray(self.tab[kd[None, :, None], st[None, None, :], q[:, :, None]], dtype=np.float64)
        assert self.per is not None
        held = np.minimum(q[:, :, None].astype(np.float64), self.per[kd].astype(np.float64)[None, :, :])
        out = np.zeros((q.shape[0], kd.size, held.shape[2] + 1))
        np.cumsum(held, axis=2, out=out[:, :, 1:])
        return out


def fill_steps(m: float, tau: Any) -> Any:
    """The ``(m - 1) τ`` of a pipeline's step (the other micro-batches at the bottleneck): 0 for one micro-batch,
    also where ``τ`` is infinite (``inf · 0`` would be nan, and a nan bound compares false everywhere)."""
    return (m - 1.0) * tau if m > 1 else np.zeros_like(tau, dtype=np.float64)


def price_curve(taus: FloatArray, kt: KindTables, group: Group, need: int, unit: int = 1) -> FloatArray:
    """(G, need + 1): the least price of one block of ``group`` holding at least ``c`` units of ``unit``
    layers under each bottleneck of ``taus`` (inf where none does; ``c = 0``: its cheapest block). A block
    of capacity ``x`` layers counts ``⌈x / unit⌉`` units: blocks holding ``L`` layers hold ``⌈L / unit⌉``
    units, so the knapsack over units is a relaxation (smaller, never above the least price)."""
    return price_curves(taus, kt, [group], need, unit)[0]


def price_curves(taus: FloatArray, kt: KindTables, groups: list[Group], need: int, unit: int = 1
                 ) -> list[FloatArray]:
    """:func:`price_curve` of each group, from one gather over all their kinds."""
    g, n = taus.shape[0], need + 1
    ok = [gr.khi >= gr.klo for gr in groups]
    kd = np.concatenate([gr.kinds[m] for gr, m in zip(groups, ok, strict=True)] + [np.zeros(0, np.int64)])
    lo = np.concatenate([gr.klo[m] for gr, m in zip(groups, ok, strict=True)] + [np.zeros(0, np.int64)])
    hi = np.concatenate([gr.khi[m] for gr, m in zip(groups, ok, strict=True)] + [np.zeros(0, np.int64)])
    if not kd.size:
        return [np.full((g, n), np.inf) for _ in groups]
    q = np.minimum(taus[:, None] / kt.a[kd][None, :] + 1e-9, kt.n_q - 1.0)  # (a > 0; τ = inf saturates)
    cap = np.ceil(kt.at(kd, q.astype(np.int64)) / unit - 1e-9)  # (G, kinds, stages + 1)
    # the fewest stages reaching each capacity (capacity never falls as stages are added): the stages of
    # capacity < c, i.e. ≤ c - 1 (whole units), counted per row and kind (stages out of range: never)
    st = np.arange(cap.shape[2])
    inside = (st[None, :] >= lo[:, None]) & (st[None, :] <= hi[:, None])
    at = np.where(inside[None], np.clip(cap, 0, n), n).astype(np.int64)
    at += (np.arange(g * kd.size) * (n + 1)).reshape(g, kd.size, 1)
    le = np.cumsum(np.bincount(at.ravel(), minlength=g * kd.size * (n + 1)).reshape(g, kd.size, n + 1), axis=2)
    short = np.concatenate([np.zeros((g, kd.size, 1), dtype=np.int64), le[:, :, :n - 1]], axis=2)
    price = np.where(short <= (hi - lo)[None, :, None], (lo[None, :, None] + short) * kt.price[kd][None, :, None],
                     np.inf)
    ends = np.cumsum([int(m.sum()) for m in ok])
    return [np.asarray(price[:, e - int(m.sum()):e].min(axis=1), dtype=np.float64) if m.any()
            else np.full((g, n), np.inf) for e, m in zip(ends, ok, strict=True)]


def least_price(curves: list[FloatArray], mandatory: list[bool], need: int, min_blocks: int,
                keep: list[FloatArray] | None = None) -> FloatArray:
    """(G,): the least total price of one block per mandatory curve and at most one per other curve
    (:func:`price_curve`) holding ``need`` layers together, with at least ``min_blocks`` (≤ 2) blocks.
    ``keep``: receives the tables of :func:`suffix_tables` on the way (with no curve, then after each but
    the last: the least prices of the curves added so far, with at least 0, 1, 2 blocks)."""
    g = curves[0].shape[0] if curves else 1
    f = _empty(g, need)
    for cur, must in zip(curves[:-1], mandatory[:-1], strict=True):
        if keep is not None:
            keep.append(_at_least(f))
        f = _add(f, cur, must)
    if keep is not None:
        keep.append(_at_least(f))
    last = f[:, :, need]
    if curves:  # the last group only at ``need``: its block at capacity ≥ d, the rest holding ≥ need - d
        with_ = (f[:, :, ::-1] + curves[-1][None, :, :]).min(axis=2)  # (states before it, G)
        last = np.full_like(last, np.inf) if mandatory[-1] else last.copy()
        last[1] = np.minimum(last[1], with_[0])
        last[2] = np.minimum(last[2], np.minimum(with_[1], with_[2]))
    return np.asarray(last[min(max(min_blocks, 0), 2):].min(axis=0), dtype=np.float64)


def _empty(g: int, need: int) -> FloatArray:
    """(3, G, need + 1): least price holding at least ``c`` with 0, 1, 2+ blocks, before any block."""
    f = np.full((3, g, need + 1), np.inf)
    f[0, :, 0] = 0.0
    return f


def _add(f: FloatArray, cur: FloatArray, must: bool) -> FloatArray:
    """One more group (:func:`price_curve` ``cur``) in the knapsack ``f`` (from :func:`_empty` and
    :func:`_add`; mandatory: its block is used)."""
    g, n = f.shape[1], f.shape[2]
    new = np.full_like(f, np.inf) if must else f.copy()
    # with no block before, only capacity 0 is held (f[0] is inf beyond it): one block alone is its curve
    new[1] = np.minimum(new[1], f[0, :, :1] + cur)
    # this block at capacity ≥ d, the rest holding ≥ c - d (d > c adds nothing: an inf pad); the min-plus
    # convolution distributes over min, so the 1- and 2+-block states join before it (both give 2+)
    src = np.minimum(f[1], f[2])
    if np.isfinite(src[:, 0]).any():
        buf = np.full((g, 2 * n - 1), np.inf)
        s0, s1 = buf.strides
        buf[:, n - 1:] = src
        win = np.lib.stride_tricks.as_strided(buf, (g, n, n), (s0, s1, s1), writeable=False)  # [c, j]: buf[c + j]
        new[2] = np.minimum(new[2], (win + cur[:, None, ::-1]).min(axis=2))  # cur[n - 1 - j]
    return np.asarray(np.minimum.accumulate(new[:, :, ::-1], axis=2)[:, :, ::-1])  # ≥ c implies ≥ c - 1


def _at_least(f: FloatArray) -> FloatArray:
    """The knapsack's states with at least 0, 1, 2 blocks (from exactly 0, 1, 2+)."""
    return np.asarray(np.minimum.accumulate(f[::-1], axis=0)[::-1])


def suffix_tables(taus: FloatArray, kt: KindTables, groups: list[Group], need: int) -> FloatArray:
    """(groups + 1, 3, G, need + 1): ``out[l, k]`` is the least price of optional blocks of ``groups[l:]``
    holding at least ``c`` layers with at least ``k`` (0, 1, 2) blocks under each bottleneck of ``taus``."""
    f = _empty(taus.shape[0], need)
    out = [_at_least(f)]
    for cur in price_curves(taus, kt, groups, need)[::-1]:
        f = _add(f, cur, False)
        out.append(_at_least(f))
    return np.stack(out[::-1])


GRID_RATIO = 1.01
""":func:`per_price_ub` refines its intervals of bottlenecks down to this ratio where the bound matters."""
MAX_POINTS = 160
UNITS = 80
"""The knapsack counts layers in units of ``⌈L / UNITS⌉`` (:func:`price_curve`)."""
"""Bottlenecks at which :func:`per_price_ub` solves the knapsack at most (fewer only loosen the bound)."""


def _refine(work: float, m: int, tau0: float, sum_lb: float, extra: float, kt: KindTables,
            groups: list[Group], need: int, min_blocks: int, target: float, exact: bool = True,
            suffix: list[FloatArray] | None = None) -> tuple[FloatArray, FloatArray, FloatArray, float]:
    """:func:`per_price_ub`'s intervals (the last one ``[τ_end, ∞]``), the least price at their upper ends,
    and the least step × price over them (inf: nothing fits). ``exact``: the knapsack's least price, else
    its fractional relaxation (:func:`fractional_price`, about a hundred times cheaper). ``suffix``: where
    the knapsack counts whole layers over optional groups, receives :func:`suffix_tables` at the upper ends
    (the knapsack runs the groups last first, so its states on the way are those tables)."""
    mand = [gr.mandatory for gr in groups]
    unit = max(1, -(-need // UNITS))
    units = -(-need // unit)
    keep = suffix is not None and exact and unit == 1 and not any(mand)
    tabs: list[FloatArray] = []  # per call of ``prices``: (groups + 1, 3, points, need + 1)

    def prices(taus: FloatArray) -> FloatArray:
        if not exact:
            return fractional_price(taus, kt, groups, np.full(taus.shape, float(need)))
        curves = price_curves(taus, kt, groups, units, unit)
        if not keep:
            return least_price(curves, mand, units, min_blocks)
        got: list[FloatArray] = []
        p = least_price(curves[::-1], mand[::-1], units, min_blocks, got)
        # ``got``: groups[n:], groups[n - 1:], …, groups[1:]; groups[0:] is never read (a placeholder)
        tabs.append(np.stack([np.full_like(got[0], np.inf), *got[::-1]]))
        return p

    def step(tau: FloatArray) -> FloatArray:
        return fill_steps(m, tau) + np.maximum(tau, sum_lb) + extra

    p_inf = float(prices(np.array([np.inf]))[0])
    t_inf = tabs[-1] if keep else None
    if not np.isfinite(p_inf) or not np.isfinite(tau0):
        return np.zeros(0), np.zeros(0), np.zeros(0), np.inf
    tau0 = max(tau0, 1e-12)
    ps_goal = work / target if np.isfinite(target) and target > 0 else 0.0
    # beyond tau_end: step ≥ step(tau_end), price ≥ P(∞), so ps ≥ ps_goal there
    tau_end = max(ps_goal / (m * p_inf), tau0 * GRID_RATIO ** 8) if ps_goal > 0 and p_inf > 0 else tau0 * 4.0
    tail = float(step(np.array([tau_end]))[0]) * p_inf
    edges = tau0 * (tau_end / tau0) ** (np.arange(9) / 8.0)
    lo, hi = edges[:-1], edges[1:]
    p_hi = prices(hi)
    t_hi = tabs[-1] if keep else None
    used = hi.size
    while True:
        lb = step(lo) * p_hi
        thr = ps_goal if ps_goal > 0 else float(np.min(lb, initial=tail)) * 1.02
        sel = (lb < thr) & (hi > lo * GRID_RATIO)
        k = int(sel.sum())
        if k == 0 or used + 3 * k > MAX_POINTS:
            break
        # split each selected interval in four (geometrically): three new right ends each
        s_lo, s_hi = lo[sel], hi[sel]
        r = (s_hi / s_lo) ** 0.25
        inner = s_lo[:, None] * r[:, None] ** np.arange(1, 4)[None, :]
        p_in = prices(inner.ravel()).reshape(k, 3)
        new_lo = np.concatenate([s_lo[:, None], inner], axis=1).ravel()
        new_hi = np.concatenate([inner, s_hi[:, None]], axis=1).ravel()
        new_p = np.concatenate([p_in, p_hi[sel][:, None]], axis=1).ravel()
        lo, hi, p_hi = np.r_[lo[~sel], new_lo], np.r_[hi[~sel], new_hi], np.r_[p_hi[~sel], new_p]
        if t_hi is not None:  # the same rows as ``p_hi``
            t_in = tabs[-1].reshape(*t_hi.shape[:2], k, 3, t_hi.shape[3])
            t_new = np.concatenate([t_in, t_hi[:, :, sel][:, :, :, None]], axis=3).reshape(
                *t_hi.shape[:2], 4 * k, t_hi.shape[3])
            t_hi = np.concatenate([t_hi[:, :, ~sel], t_new], axis=2)
        used += 3 * k
    ps = min(float((step(lo) * p_hi).min()), tail)
    if suffix is not None and t_hi is not None:
        suffix.append(np.concatenate([t_hi, t_inf], axis=2))
    return np.r_[lo, tau_end], np.r_[hi, np.inf], np.r_[p_hi, p_inf], ps


def per_price_ub(work: float, m: int, tau0: float, sum_lb: float, extra: float, kt: KindTables,
                 groups: list[Group], need: int, min_blocks: int, target: float = np.inf, exact: bool = True,
                 suffix: list[FloatArray] | None = None) -> tuple[float, FloatArray, FloatArray]:
    """Tokens/s per unit of price at most (``work``: tokens per step) of a pipeline of one block per
    mandatory group and at most one per other group, at least ``min_blocks``, holding ``need`` layers, whose
    bottleneck is at least ``tau0``, ``Σ S`` at least ``sum_lb`` and step at least ``extra`` more.

    Under a bottleneck ``τ`` the step is at least ``(m - 1) τ + max(τ, Σ S) + extra`` under 1F1B, and under
    interleaved 1F1B with ``v`` chunks ``(m - 1/v) τ + Σ S / v ≥ (m - 1) τ + max(τ, Σ S / v)``: callers pass
    ``sum_lb`` divided by the most chunks any pipeline bounded may take; on an interval
    ``[τ_j, τ_{j+1}]`` the price is at least the least price at ``τ_{j+1}``. The intervals are refined where
    the bound could still exceed ``target`` (tokens/s per price to beat; inf: around the least), down to
    ``GRID_RATIO``; beyond the last, ``τ ≥ τ_end``, the price is at least the least at any bottleneck.
    Also returns the intervals (sorted; the last ``[τ_end, ∞]``), for :func:`node_per_price`."""
    lo, hi, _, ps = _refine(work, m, tau0, sum_lb, extra, kt, groups, need, min_blocks, target, exact, suffix)
    order = np.argsort(lo)
    if suffix:  # :func:`suffix_tables` at ``hi`` (of ``groups`` in their order), when the knapsack gave them
        suffix[0] = suffix[0][:, :, order]
    return (work / ps if ps > 0 else np.inf), lo[order], hi[order]


def node_per_price(work: float, m: int, lo: FloatArray, hi: FloatArray, suffix: FloatArray, tau: FloatArray,
                   sum_lb: float, extra: FloatArray, price: FloatArray, have: FloatArray, need: int,
                   min_open: IntArray, core: FloatArray | None = None) -> FloatArray:
    """Tokens/s per unit of price at most for nodes (rows) of a family, on the family's intervals
    (:func:`per_price_ub`'s): per interval the step at its lower end (at least the node's bottleneck ``tau``),
    times the price of the blocks chosen (``price``) plus the least price of the open offers
    (``suffix``: :func:`suffix_tables` at the upper ends, for the offers still open) holding what the chosen
    blocks cannot (``have``: (rows, intervals), their capacity at the upper ends) with at least ``min_open``
    more blocks (``core``: a lower bound of the step's core, per row, at any bottleneck)."""
    n = tau.shape[0]
    t_lo = np.maximum(lo[None, :], tau[:, None])
    live = t_lo <= hi[None, :]
    step = fill_steps(m, t_lo) + np.maximum(t_lo, sum_lb)
    if core is not None:  # a lower bound of the pipeline core at any bottleneck
        step = np.maximum(step, core[:, None])
    step = step + extra[:, None]
    rest = np.clip(need - have, 0, need).astype(np.int64)  # (rows, intervals)
    # suffix[min_open[i], j, rest[i, j]]: (rows, intervals)
    add = suffix[np.clip(min_open, 0, 2)[:, None], np.arange(rest.shape[1])[None, :], rest]
    with np.errstate(invalid="ignore"):
        ps = np.where(live, step * (price[:, None] + add), np.inf)
    ps = ps.min(axis=1) if ps.shape[1] else np.full(n, np.inf)
    with np.errstate(divide="ignore"):
        return np.asarray(np.where(ps > 0, work / ps, np.inf), dtype=np.float64)


def fractional_price(taus: FloatArray, kt: KindTables, groups: list[Group], need: FloatArray) -> FloatArray:
    """(G,): a lower bound of the least price of optional blocks, one per group, holding ``need`` (G,)
    layers under each bottleneck: the knapsack's fractional relaxation, each group holding at most its
    longest block's capacity at no more than its best layers per unit of price (the groups with the most
    layers per unit of price filled first)."""
    if not groups:
        return np.where(need > 0, np.inf, 0.0)
    n_q = kt.n_q
    kd = np.concatenate([gr.kinds for gr in groups])
    lo = np.concatenate([gr.klo for gr in groups])
    hi = np.concatenate([gr.khi for gr in groups])
    member = np.repeat(np.arange(len(groups)), [gr.kinds.size for gr in groups])
    q = np.minimum(taus[:, None] / kt.a[kd][None, :] + 1e-9, n_q - 1.0).astype(np.int64)  # (G, kinds)
    cap = kt.at(kd, q)  # (G, kinds, stages + 1)
    n_s = cap.shape[2]
    ks = np.arange(n_s, dtype=np.float64)
    within = (ks[None, :] >= lo[:, None]) & (ks[None, :] <= hi[:, None])  # (kinds, stages + 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        per = cap / (ks[None, :] * kt.price[kd][:, None])[None, :, :]
    kind_r = np.where(within[None], per, 0.0).max(axis=2)  # (G, kinds)
    kind_c = np.where(hi >= lo, np.take_along_axis(cap, np.clip(hi, 0, n_s - 1)[None, :, None]
                                                   .repeat(cap.shape[0], axis=0), axis=2)[:, :, 0], 0.0)
    in_g = member[None, :] == np.arange(len(groups))[:, None]  # (groups, kinds)
    r = np.where(in_g[None], kind_r[:, None, :], 0.0).max(axis=2, initial=0.0)  # (G, groups)
    c = np.where(in_g[None], kind_c[:, None, :], 0.0).max(axis=2, initial=0.0)
    order = np.argsort(-r, axis=1, kind="stable")
    r = np.take_along_axis(r, order, axis=1)
    c = np.take_along_axis(c, order, axis=1)
    before = np.cumsum(c, axis=1) - c
    take = np.clip(need[:, None] - before, 0.0, c)
    with np.errstate(divide="ignore", invalid="ignore"):
        price = np.where(take > 0, take / r, 0.0).sum(axis=1)
    return np.asarray(np.where(c.sum(axis=1) >= need - 1e-9, price, np.inf), dtype=np.float64)
