"""The cost model's fitted constants, how they are fitted, and the leave-one-source-out check.

Every other constant of the model comes from a datasheet, a microbenchmark or a paper
(:mod:`costmodel.constants`, docs/costmodel.md). The ones listed in :data:`FITTED` are fitted, on all
sources of ``data/validation`` together, never per case or per source. :func:`leave_one_source_out` refits
each of them without one source and scores that source with the refitted value: the figures the issue's
targets apply to (``scripts/loso.py`` prints them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from starverse.costmodel import constants as C
from starverse.costmodel.validate import (
    MIN_CONFIGS_FOR_SPEARMAN,
    CaseResult,
    LoadedCase,
    score_case,
    summarize,
)


@dataclass(frozen=True)
class FittedConstant:
    """One fitted constant: where it lives, its bounds, the cases that identify it and its objective."""

    name: str
    """Attribute of :mod:`costmodel.constants`."""
    lower: float
    """Smallest physically meaningful value."""
    upper: float
    """Largest physically meaningful value."""
    uses_pre_ampere: bool
    """Fitted on the runs that use a pre-Ampere card's tensor cores (``fit.uses_pre_ampere``, True) or on the
    others."""
    fitted_on: str
    """The data the committed value was fitted on."""


FITTED: tuple[FittedConstant, ...] = (
    FittedConstant(
        name="SUSTAINED_FRACTION", lower=0.3, upper=1.0, uses_pre_ampere=False,
        fitted_on="the runs of data/validation that do not use pre-Ampere tensor cores: korthikanti2022, "
                  "megatron (Megatron-Core H100), megatron2021, mpt (A100/H100, 37 runs), sailor (fp32, 6 accepted)",
    ),
    FittedConstant(
        name="PRE_AMPERE_EFFICIENCY", lower=0.05, upper=1.0, uses_pre_ampere=True,
        fitted_on="the runs of data/validation with pre-Ampere cards in fp16/bf16: amp_t4 (16 x T4, 47 runs), "
                  "amp_mixed (V100 + T4, 43); Sailor's Turing runs are fp32 (CUDA cores) and do not use it",
    ),
)
"""The fitted constants, fitted in this order (the second's cases depend on the first, not the reverse).
Objective of each: the mean over sources of each source's mean signed tokens/s error (predicted /
measured - 1) is zero on the cases that identify it (every source counts once, whatever the number of
configurations it ran)."""

TARGETS = {"median_abs_error": 0.12, "p90_abs_error": 0.25, "spearman": 0.8, "memory_abs_error": 0.10}
"""Issue 9's targets on held-out figures (Spearman only for sources with at least
:data:`~costmodel.validate.MIN_CONFIGS_FOR_SPEARMAN` configurations)."""


@contextmanager
def constants_set_to(values: dict[str, float]) -> Iterator[None]:
    """Temporarily give constants of :mod:`costmodel.constants` other values (fitting only; the cost
    model reads them at call time)."""
    olds = {k: getattr(C, k) for k in values}
    for k, v in values.items():
        setattr(C, k, v)
    try:
        yield
    finally:
        for k, v in olds.items():
            setattr(C, k, v)


def uses_pre_ampere(case: LoadedCase) -> bool:
    """The case runs a stage on a pre-Ampere card (``constants.PRE_AMPERE``) on its tensor cores."""
    return case.plan.train.precision in C.TENSOR_CORE_PRECISIONS and any(
        acc in C.PRE_AMPERE for acc in case.plan.accelerators())


def _score_all(cases: Sequence[LoadedCase], catalog: Any) -> list[CaseResult]:
    return [score_case(c, catalog) for c in cases]


def _source_mean_error(results: list[CaseResult]) -> float:
    by_source: dict[str, list[float]] = {}
    for r in results:
        if r.error is not None and r.ok:
            by_source.setdefault(r.source, []).append(r.error)
    if not by_source:
        return 0.0
    return float(np.mean([np.mean(v) for v in by_source.values()]))


def fit_constant(const: FittedConstant, cases: Sequence[LoadedCase], catalog: Any,
                 tol: float = 1e-3) -> float | None:
    """The value of ``const`` that zeroes its objective on its share of ``cases`` (None when none of them
    identifies it). Regula falsi (Illinois): throughput, hence the error, grows with the constant."""
    mine = [c for c in cases if uses_pre_ampere(c) == const.uses_pre_ampere]
    if not mine:
        return None

    def err(x: float) -> float:
        with constants_set_to({const.name: x}):
            return _source_mean_error(_score_all(mine, catalog))

    a, b = const.lower, const.upper
    fa, fb = err(a), err(b)
    if fa >= 0.0:
        return a
    if fb <= 0.0:
        return b
    side = 0
    x = a
    for _ in range(40):
        x = (a * fb - b * fa) / (fb - fa)
        fx = err(x)
        if abs(fx) < tol or b - a < tol:
            break
        if fx < 0.0:
            a, fa = x, fx
            if side == -1:
                fb /= 2.0
            side = -1
        else:
            b, fb = x, fx
            if side == 1:
                fa /= 2.0
            side = 1
    return round(x, 4)


def fit_all(cases: Sequence[LoadedCase], catalog: Any) -> dict[str, float]:
    """Fit every constant of :data:`FITTED` in order on ``cases``; a constant no case identifies keeps its
    committed value."""
    values: dict[str, float] = {}
    for const in FITTED:
        with constants_set_to(values):
            v = fit_constant(const, cases, catalog)
        values[const.name] = getattr(C, const.name) if v is None else v
    return values


def _held_out(results: list[CaseResult]) -> dict[str, Any]:
    s = summarize(results)
    refused = sorted(r.name for r in results if r.reason is not None)
    mem_max = s["memory_max_abs_error"]
    checks: dict[str, bool | None] = {
        "median_abs_error": None if s["median_abs_error"] is None
        else s["median_abs_error"] <= TARGETS["median_abs_error"],
        "p90_abs_error": None if s["p90_abs_error"] is None else s["p90_abs_error"] <= TARGETS["p90_abs_error"],
        "spearman": None if s["n"] < MIN_CONFIGS_FOR_SPEARMAN or s["spearman"] is None
        else s["spearman"] >= TARGETS["spearman"],
        "peak_memory": None if mem_max is None else mem_max <= TARGETS["memory_abs_error"],
        "fits_as_reported": not refused,
    }
    return {**s, "failed_cases": refused, "meets": checks}


def leave_one_source_out(cases: Sequence[LoadedCase], catalog: Any,
                         progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Refit every constant of :data:`FITTED` on all sources, and again without each source; score each
    source with the constants fitted without it (a constant no remaining source identifies keeps its
    committed value).

    Returns ``{"fitted": {name: {"all": v, "without": {source: v}}}, "held_out": {source: summary},
    "pooled": summary}`` where each summary is :func:`~costmodel.validate.summarize`'s plus
    ``failed_cases`` and ``meets`` (target -> True/False, None where the target does not apply).
    """
    sources = sorted({c.source for c in cases})
    all_values = fit_all(cases, catalog)
    fitted: dict[str, dict[str, Any]] = {name: {"all": v, "without": {}} for name, v in all_values.items()}
    held_out: dict[str, Any] = {}
    pooled: list[CaseResult] = []
    for src in sources:
        if progress is not None:
            progress(src)
        values = fit_all([c for c in cases if c.source != src], catalog)
        for name, v in values.items():
            fitted[name]["without"][src] = v
        with constants_set_to(values):
            results = _score_all([c for c in cases if c.source == src], catalog)
        pooled.extend(results)
        held_out[src] = _held_out(results)
    return {"fitted": fitted, "held_out": held_out, "pooled": _held_out(pooled)}
