"""Validation against published training runs: predicted vs measured tokens/s (``starverse validate``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field

from starverse.config import FrozenModel, parse, read_yaml, where
from starverse.errors import ConfigError, StarverseError
from starverse.plan import Plan, _resolve_model_path


class Measured(FrozenModel):
    """What was measured on a real run (any subset)."""

    tokens_per_s: float | None = Field(default=None, gt=0)
    """Whole-job training throughput."""
    tflops_per_device: float | None = Field(default=None, gt=0)
    """Model TFLOP/s per device."""
    step_time_s: float | None = Field(default=None, gt=0)
    """Seconds per optimizer step."""
    peak_memory_gb: float | None = Field(default=None, gt=0)
    """Peak device memory."""


class ValidationCase(Plan):
    """A plan that really ran, with its measurements and their source."""

    measured: Measured
    """Measured figures."""
    source: str = ""
    """Where the figures come from."""


@dataclass(frozen=True)
class CaseResult:
    """One case: prediction vs measurement, or why it could not be estimated."""

    name: str
    """File stem."""
    path: str
    """File path."""
    predicted: float | None
    """Predicted tokens/s."""
    measured: float | None
    """Measured tokens/s."""
    fits: bool
    """The estimator says the published plan fits in memory (it ran, so it must)."""
    reason: str | None = None
    """Why the case failed (not estimable, no measurement, reported as not fitting)."""

    @property
    def error(self) -> float | None:
        """predicted / measured - 1."""
        if self.predicted is None or self.measured is None:
            return None
        return self.predicted / self.measured - 1.0

    @property
    def ok(self) -> bool:
        """Estimated, measured and fits."""
        return self.reason is None


def find_cases(paths: list[str | Path]) -> list[Path]:
    """``*.yaml`` files in the given folders (sorted), plus files given directly."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out.extend(sorted(p.glob("*.yaml")))
        elif p.is_file():
            out.append(p)
        else:
            raise ConfigError(f"{p}: no such file or folder; pass validation case files or folders of them")
    return out


def run_case(path: Path, catalog: Any = None) -> CaseResult:
    """Estimate one case; errors become the case's ``reason`` (never silently skipped)."""
    from starverse.costmodel.step import estimate
    from starverse.models import load_model

    name = path.stem
    measured: float | None = None
    try:
        data, node = read_yaml(path)
        case = parse(ValidationCase, data, str(path), node)
        measured = case.measured.tokens_per_s
        plan = Plan.model_validate(case.model_dump(exclude={"measured", "source"}, exclude_unset=True))
        plan = _resolve_model_path(plan, path.parent)
        try:
            spec = load_model(plan.model, base_dir=path.parent)
        except StarverseError as e:
            raise ConfigError(f"{where(path, ('model',))}: model: {e}") from None
        try:
            est = estimate(plan, catalog, spec)
        except StarverseError as e:
            raise ConfigError(f"{where(path, getattr(e, 'loc', None))}: {e}") from None
    except StarverseError as e:
        return CaseResult(name, str(path), None, measured, False, reason=str(e))
    if measured is None:
        return CaseResult(name, str(path), est.tokens_per_s, None, est.fits,
                          reason="no measured.tokens_per_s in the case")
    if not est.fits:
        return CaseResult(name, str(path), est.tokens_per_s, measured, False,
                          reason=f"estimator says the plan does not fit ({est.memory_gb:.1f} of "
                                 f"{est.capacity_gb:.1f} GB), but it ran")
    return CaseResult(name, str(path), est.tokens_per_s, measured, True)


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman rank correlation (average ranks for ties); NaN for fewer than 2 points."""
    if len(x) < 2:
        return float("nan")

    def ranks(v: list[float]) -> np.ndarray:
        a = np.asarray(v, dtype=np.float64)
        order = np.argsort(a, kind="mergesort")
        r = np.empty(len(a))
        r[order] = np.arange(len(a), dtype=np.float64)
        for val in np.unique(a):  # average ties
            idx = a == val
            r[idx] = r[idx].mean()
        return r

    rx, ry = ranks(x), ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


def summarize(results: list[CaseResult]) -> dict[str, Any]:
    """n, median/p90/max |error| and Spearman over the cases with both figures."""
    scored = [r for r in results if r.error is not None]
    errs = np.abs(np.array([r.error for r in scored], dtype=np.float64))

    def stat(f: Any) -> float | None:
        return float(f(errs)) if len(errs) else None

    rho = spearman([r.predicted for r in scored], [r.measured for r in scored])  # type: ignore[misc]
    return {
        "n": len(scored),
        "median_abs_error": stat(np.median),
        "p90_abs_error": stat(lambda e: np.percentile(e, 90)),
        "max_abs_error": stat(np.max),
        "spearman": None if math.isnan(rho) else rho,
    }


def report(results: list[CaseResult]) -> dict[str, Any]:
    """The ``--json`` document, exactly ``{"cases": [...], "summary": {...}}`` (failed cases have null
    figures; their reasons are in each ``CaseResult.reason``, which the CLI prints on stderr)."""
    cases = [{"name": r.name, "metric": "tokens_per_s", "predicted": r.predicted, "measured": r.measured,
              "error": r.error} for r in results]
    return {"cases": cases, "summary": summarize(results)}


def load_plan_or_case(path: str | Path) -> Plan:
    """A plan file, or a validation case file (its ``measured``/``source`` are ignored)."""
    from starverse.plan import load_plan

    data, node = read_yaml(path)
    if isinstance(data, dict) and ("measured" in data or "source" in data):
        case = parse(ValidationCase, data, str(path), node)
        plan = Plan.model_validate(case.model_dump(exclude={"measured", "source"}, exclude_unset=True))
        return _resolve_model_path(plan, Path(path).parent)
    return load_plan(path)
