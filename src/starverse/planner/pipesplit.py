"""The exact integer layer split of one heterogeneous pipeline (stages fixed, layers free).

For a pipeline of ``p`` stages whose accelerators, TP degrees, replicas, micro-batch and memory settings are
fixed, the cost model's 1F1B step (``costmodel.group.combine``) is::

    step = (m - 1) · max_i S_i + Σ_i S_i + max_i O_i + max_i D_i + max_i tied_i + 2 (m + p - 1) · max_i p2p_i

with ``S_i`` the stage's time per micro-batch, ``O_i`` its optimizer step and ``D_i`` its exposed gradient
all-reduce — each a function of the stage's layer count ``L_i`` (tables over ``L = 1..L_max``) — and the
point-to-point and tied-embedding terms independent of the layers. :func:`best_split` finds the integer
``L_1..L_p`` (each ≥ 1, summing to the model's layers, each stage within its memory) minimising the step,
exactly: a dynamic program over the stages whose state is the number of layers placed, keeping at each state
the Pareto set of the four aggregates ``(Σ S, max S, max O, max D)`` (the step grows with each of them, and
each grows when a stage is appended, so a dominated partial split never completes to a better one), pruned
by a lower bound on the completion against the best split known (first found by a greedy balancing sweep).
No assumption on the shape of the tables is made (monotone or not), so the result is the optimum over
every composition.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


def step_of(s: FloatArray, o: FloatArray, d: FloatArray, layers: IntArray, m: float, const: float) -> float:
    """The step of one split (``layers[i]`` layers on stage ``i``; tables indexed by ``L - 1``)."""
    idx = np.arange(len(layers))
    li = np.asarray(layers) - 1
    si, oi, di = s[idx, li], o[idx, li], d[idx, li]
    return float((m - 1.0) * si.max() + si.sum() + oi.max() + di.max() + const)


def _greedy(s: FloatArray, o: FloatArray, d: FloatArray, total: int, m: float, const: float,
            enough: float = -np.inf) -> tuple[float, IntArray | None]:
    """A good split to prune with: for each bottleneck level ``τ`` (ascending), every stage takes the layers
    it can hold under ``τ``, cheapest first, until the model is covered (``enough``: the first split whose
    step is at most this is returned at once)."""
    p, lmax = s.shape
    finite = np.isfinite(s)
    # the largest L each stage can take with every smaller count allowed too (prefix of finite entries)
    prefix_ok = np.cumprod(finite, axis=1).astype(bool)
    levels = np.unique(s[prefix_ok])
    best, best_l = np.inf, None
    with np.errstate(invalid="ignore"):
        slope = np.where(prefix_ok[:, 1], s[:, 1] - s[:, 0], np.inf) if lmax > 1 else s[:, 0]
    order = np.argsort(slope, kind="stable")
    floor = s[:, 0].sum()
    for tau in levels:
        if (m - 1.0) * tau + floor >= best:
            break
        caps = (prefix_ok & (s <= tau)).cumprod(axis=1).sum(axis=1)
        if caps.min() < 1 or caps.sum() < total:
            continue
        layers = np.ones(p, dtype=np.int64)
        rest = total - p
        for i in order:
            add = min(int(caps[i]) - 1, rest)
            layers[i] += add
            rest -= add
            if rest == 0:
                break
        v = step_of(s, o, d, layers, m, const)
        if v <= enough:
            return v, layers
        if v < best:
            best, best_l = v, layers
    return best, best_l


def _pareto(lab: FloatArray) -> npt.NDArray[np.bool_]:
    """Rows of ``lab`` not dominated by another row (ties: the first kept)."""
    n = lab.shape[0]
    if n <= 1:
        return np.ones(n, dtype=bool)
    le = (lab[:, None, :] <= lab[None, :, :]).all(axis=2)  # le[k, j]: k is at least as good as j everywhere
    lt = (lab[:, None, :] < lab[None, :, :]).any(axis=2)
    dom = le & lt
    # exact duplicates: the later one is dropped
    eq = le & le.T
    earlier = np.tril(np.ones((n, n), dtype=bool), k=-1).T  # earlier[k, j]: k < j
    dom = dom | (eq & earlier)
    return np.asarray(~dom.any(axis=0), dtype=np.bool_)


def _completion_bounds(s: FloatArray, smin: FloatArray, total: int) -> tuple[FloatArray, FloatArray]:
    """``tau[i, R]``: least bottleneck with which stages ``i..`` can hold ``R`` layers (each stage holds at
    most the largest ``L`` whose time is within it); ``low[i, R]``: a lower bound of ``Σ S`` over stages
    ``i..`` holding ``R`` layers (each its cheapest entry, plus the layers beyond one each at the smallest
    slope any of them has from its cheapest entry). Row ``p`` (no stage left) is 0 for ``R = 0``, inf else."""
    p, lmax = s.shape
    levels = np.unique(s[np.isfinite(s)])
    # suffix minimum over L: L layers fit under τ iff some count ≥ L does... the largest L with S ≤ τ
    g = np.minimum.accumulate(s[:, ::-1], axis=1)[:, ::-1]
    most = np.stack([np.searchsorted(g[i], levels, side="right") for i in range(p)])  # (p, V)
    reach = np.vstack([np.cumsum(most[::-1], axis=0)[::-1], np.zeros((1, levels.size), dtype=np.int64)])
    tau = np.full((p + 1, total + 1), np.inf)
    low = np.full((p + 1, total + 1), np.inf)
    tau[p, 0], low[p, 0] = 0.0, 0.0
    if lmax > 1:
        steps = np.arange(1, lmax, dtype=np.float64)
        with np.errstate(invalid="ignore"):
            rel = (s[:, 1:] - s[:, :1]) / steps[None, :]
        slope = np.where(np.isfinite(rel), rel, np.inf).min(axis=1)
    else:
        slope = np.full(p, np.inf)
    base = np.r_[np.cumsum(s[::-1, 0])[::-1], 0.0]
    r = np.arange(total + 1)
    for i in range(p):
        n_rem = p - i
        idx = np.searchsorted(reach[i], r, side="left")
        tau[i] = np.where((idx < levels.size) & (r >= n_rem), levels[np.minimum(idx, levels.size - 1)], np.inf)
        finite = slope[i:][np.isfinite(slope[i:])]
        sl = float(finite.min()) if finite.size else 0.0
        low[i] = np.where(r >= n_rem, base[i] + (r - n_rem) * sl, np.inf)
    return tau, np.where(np.isfinite(low), low, np.inf)


def best_split(s: FloatArray, o: FloatArray, d: FloatArray, total: int, m: float, const: float,
               incumbent: float = np.inf, any_split: bool = False) -> tuple[float, IntArray | None]:
    """Exact minimum step over integer splits and one split reaching it (``(inf, None)`` when no split
    fits or none beats ``incumbent``). ``s, o, d``: (p, L_max) tables, ``inf`` where stage ``i`` cannot hold
    ``L`` layers (memory); ``L_max = total - p + 1``. ``any_split``: the caller asks only whether some split
    beats ``incumbent`` (None exactly when the exact search returns None): the greedy sweep's split, when it
    does, is returned without the dynamic program."""
    p, lmax = s.shape
    if p > total or lmax < 1:
        return np.inf, None
    s = np.where(np.isfinite(s), s, np.inf)
    g_best, g_layers = _greedy(s, o, d, total, m, const, enough=incumbent if any_split else -np.inf)
    if any_split and g_layers is not None and g_best <= incumbent:
        return g_best, g_layers
    best = min(incumbent, g_best)
    best_layers = g_layers if g_best <= incumbent else None
    # completion lower bounds: stages i.. each take at least their cheapest entry
    fin = np.isfinite(s)
    smin = np.where(fin, s, np.inf).min(axis=1)
    omin = np.where(fin, o, np.inf).min(axis=1)
    dmin = np.where(fin, d, np.inf).min(axis=1)
    if not np.isfinite(smin).all():
        return (best, best_layers) if best_layers is not None else (np.inf, None)
    tau_rem, sum_rem = _completion_bounds(s, smin, total)
    rem_smax = np.r_[np.maximum.accumulate(smin[::-1])[::-1], 0.0]
    rem_omax = np.r_[np.maximum.accumulate(omin[::-1])[::-1], 0.0]
    rem_dmax = np.r_[np.maximum.accumulate(dmin[::-1])[::-1], 0.0]
    # states: layers placed; labels (Σ S, max S, max O, max D); back-pointers per stage
    lab = np.zeros((1, 4))
    state = np.zeros(1, dtype=np.int64)
    back: list[tuple[IntArray, IntArray]] = []  # per stage: (parent row, layers) of each kept row
    ls = np.arange(1, lmax + 1, dtype=np.int64)
    for i in range(p):
        left_after = p - 1 - i  # stages after this one, one layer each at least
        n = lab.shape[0]
        rows = np.repeat(np.arange(n), lmax)
        lay = np.tile(ls, n)
        new_state = state[rows] + lay
        si, oi, di = s[i, lay - 1], o[i, lay - 1], d[i, lay - 1]
        ok = np.isfinite(si) & (new_state + left_after <= total)
        if i == p - 1:
            ok &= new_state == total
        rows, lay, new_state, si, oi, di = rows[ok], lay[ok], new_state[ok], si[ok], oi[ok], di[ok]
        new = np.stack([lab[rows, 0] + si, np.maximum(lab[rows, 1], si), np.maximum(lab[rows, 2], oi),
                        np.maximum(lab[rows, 3], di)], axis=1)
        rest = total - new_state
        worst = np.maximum(new[:, 1], np.maximum(rem_smax[i + 1], tau_rem[i + 1, rest]))
        lb = (((m - 1.0) * worst if m > 1 else 0.0) + new[:, 0] + sum_rem[i + 1, rest]
              + np.maximum(new[:, 2], rem_omax[i + 1]) + np.maximum(new[:, 3], rem_dmax[i + 1]) + const)
        keep = lb < best
        rows, lay, new_state, new = rows[keep], lay[keep], new_state[keep], new[keep]
        if rows.size == 0:
            return (best, best_layers) if best_layers is not None else (np.inf, None)
        order = np.lexsort((new[:, 0], new_state))
        rows, lay, new_state, new = rows[order], lay[order], new_state[order], new[order]
        starts = np.flatnonzero(np.r_[True, new_state[1:] != new_state[:-1]])
        ends = np.r_[starts[1:], len(new_state)]
        kept = np.concatenate([a + np.flatnonzero(_pareto(new[a:b])) for a, b in zip(starts, ends, strict=True)])
        back.append((rows[kept], lay[kept]))
        lab, state = new[kept], new_state[kept]
    value = (m - 1.0) * lab[:, 1] + lab[:, 0] + lab[:, 2] + lab[:, 3] + const
    j = int(np.argmin(value))
    if not value[j] < best:
        return (best, best_layers) if best_layers is not None else (np.inf, None)
    layers = np.zeros(p, dtype=np.int64)
    for i in range(p - 1, -1, -1):
        parent, lay_i = back[i]
        layers[i] = lay_i[j]
        j = int(parent[j])
    return float(value.min()), layers
