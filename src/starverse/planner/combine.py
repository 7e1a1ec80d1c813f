"""Heterogeneous data parallelism: splitting the global batch over groups exactly, and bounding combinations.

For groups with time tables ``T_i`` (see :mod:`starverse.planner.space`), the best integer split of a global
batch ``B`` minimises the slowest group::

    T* = min { max_i T_i[s_i] : Σ s_i = B, s_i ≥ 1 }

It is found exactly by enumerating the reachable shares of all groups but the last (the last takes the
remainder), vectorised. Reachable shares are multiples of ``replicas × micro_batch`` that fit, so the grid is
small (``B / granularity`` points per group).

Branch and bound over combinations uses the rate bound ``ρ_i = max_s s / T_i[s]``: in time ``T`` group ``i``
can process at most ``ρ_i T`` sequences, so ``T* ≥ B / Σ ρ_i``, which bounds every objective (they are all
monotone in throughput for fixed devices). Combinations are evaluated in decreasing order of that bound
until the bound cannot beat the best plans found: the result is exact over the options it was given.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]

def _minmax_conv(ta: FloatArray, tb: FloatArray) -> tuple[FloatArray, npt.NDArray[np.int64]]:
    """``M[t] = min_s max(ta[s], tb[t - s])`` over ``s, t - s ≥ 1``, and the arg-min share of ``a``."""
    b = ta.shape[0] - 1
    fa = np.flatnonzero(np.isfinite(ta[1:])) + 1
    out = np.full(b + 1, np.inf)
    arg = np.zeros(b + 1, dtype=np.int64)
    if fa.size == 0:
        return out, arg
    t = np.arange(b + 1)
    idx = t[None, :] - fa[:, None]
    valid = idx >= 1
    vals = np.where(valid, np.maximum(ta[fa][:, None], tb[np.clip(idx, 0, b)]), np.inf)
    j = np.argmin(vals, axis=0)
    out = vals[j, t]
    arg = fa[j]
    return out, arg


def best_split(tables: Sequence[FloatArray], global_batch: int) -> tuple[float, tuple[int, ...]]:
    """Exact ``(T*, shares)`` for groups with time tables ``tables`` (``(inf, ())`` if no split exists).

    Groups are folded pairwise from the last: ``M_{i}[t] = min_s max(T_i[s], M_{i+1}[t - s])`` — a
    min-max convolution over the reachable shares of group ``i`` — so the cost is linear in the number of
    groups and never enumerates the full product of shares.
    """
    b = global_batch
    if len(tables) == 1:
        single = float(tables[0][b])
        return (single, (b,)) if np.isfinite(single) else (np.inf, ())
    acc = tables[-1]
    args = []
    for t in reversed(tables[:-1]):
        acc, arg = _minmax_conv(t, acc)
        args.append(arg)
    best = float(acc[b])
    if not np.isfinite(best):
        return np.inf, ()
    shares = []
    rest = b
    for arg in reversed(args):
        s = int(arg[rest])
        shares.append(s)
        rest -= s
    shares.append(rest)
    return best, tuple(shares)


def rate_bound(tables: FloatArray) -> FloatArray:
    """``ρ = max_s s / T[s]`` per row (sequences per second at the group's most efficient share)."""
    s = np.arange(tables.shape[1], dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(np.isfinite(tables) & (tables > 0), s / tables, 0.0)
    return r.max(axis=1) if r.size else np.zeros(tables.shape[0])
