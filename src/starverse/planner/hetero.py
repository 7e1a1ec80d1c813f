"""Helpers for heterogeneous pipelines (one pipeline whose stages run on different accelerators).

The search over such pipelines is exact and lives in :mod:`~starverse.planner.pipes` (with the layer split
in :mod:`~starverse.planner.pipesplit`); this module keeps the plan-building helper and the proportional
split that benchmarks use as a baseline.
"""

from __future__ import annotations

from collections.abc import Sequence

from starverse.plan import Stage


def split_layers(weights: Sequence[float], num_layers: int) -> list[int]:
    """Integer layers per stage ∝ ``weights`` (largest remainder), every stage at least one layer."""
    n = len(weights)
    total = sum(weights)
    raw = [max(w / total * num_layers, 1.0) for w in weights]
    scale = num_layers / sum(raw)
    raw = [r * scale for r in raw]
    out = [max(1, int(r)) for r in raw]
    while sum(out) < num_layers:
        i = max(range(n), key=lambda j: raw[j] - out[j])
        out[i] += 1
    while sum(out) > num_layers:
        i = max((j for j in range(n) if out[j] > 1), key=lambda j: out[j] - raw[j])
        out[i] -= 1
    return out


def stage_runs(accs: Sequence[str], tps: Sequence[int], layers: Sequence[int]) -> list[Stage]:
    """Consecutive identical stages folded with ``repeat``."""
    out: list[Stage] = []
    for a, t, lay in zip(accs, tps, layers, strict=True):
        if out and out[-1].accelerator == a and out[-1].tp == t and out[-1].layers == lay:
            out[-1] = out[-1].model_copy(update={"repeat": out[-1].repeat + 1})
        else:
            out.append(Stage(accelerator=a, tp=t, layers=lay))
    return out
