"""How often to checkpoint: Young/Daly from the measured save cost and the pool's interruption rate.

With a save that blocks training for ``C`` seconds and interruptions every ``M`` seconds on average, the
expected waste per second of training is about ``C/τ + (τ/2 + W)/M`` for an interval ``τ``, where ``W`` is
how long a save takes to reach disk (work since the last *committed* checkpoint is lost). The minimum is
Young's ``τ = sqrt(2·C·M)``; Daly's higher-order form corrects it when ``C`` is not small against ``M``.
With asynchronous saves ``C`` is only the blocked time, and ``W`` does not depend on ``τ`` but bounds it
from below: a new save cannot start before the previous one is on disk.

The formula is written once, here: :func:`young_daly_interval_s` (scalars or numpy arrays) and
:func:`waste_fraction` are what the supervisor's checkpoint callback (:func:`choose_interval`) and the
planner's spot overhead (``planner.policy.spot_factor``) both use. numpy only (no torch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np
import numpy.typing as npt

from starverse.errors import ConfigError

DEFAULT_MAX_INTERVAL_S = 1800.0
"""Upper bound when interruptions are rare or unknown (on-demand devices still fail, and rollback needs
snapshots)."""


@overload
def young_daly_interval_s(save_cost_s: float, mtbf_s: float) -> float: ...
@overload
def young_daly_interval_s(save_cost_s: npt.ArrayLike, mtbf_s: npt.ArrayLike) -> np.ndarray: ...
def young_daly_interval_s(save_cost_s: npt.ArrayLike, mtbf_s: npt.ArrayLike) -> float | np.ndarray:
    """Optimal compute time between checkpoints (Daly 2006, eq. 37; Young 1974 to first order).

    ``save_cost_s``: time training is blocked per checkpoint; ``mtbf_s``: mean time between interruptions
    of the job (inf: never interrupted, interval inf). Returns ``mtbf_s`` when the save costs at least twice
    the MTBF (checkpointing cannot pay). Scalars give a float; arrays broadcast (the planner's search).
    """
    c = np.asarray(save_cost_s, dtype=float)
    m = np.asarray(mtbf_s, dtype=float)
    if np.any(c < 0) or np.any(~(m > 0)):
        raise ConfigError(f"need save_cost_s >= 0 and mtbf_s > 0 (got {save_cost_s!r}, {mtbf_s!r})")
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        r = c / (2 * m)
        daly = np.sqrt(2 * c * m) * (1 + np.sqrt(r) / 3 + r / 9) - c
        tau = np.where(np.isinf(m), np.inf, np.where(c == 0, 0.0, np.where(c >= 2 * m, m, daly)))
    return float(tau) if tau.ndim == 0 else tau


def waste_fraction(interval_s: npt.ArrayLike, save_cost_s: npt.ArrayLike, mtbf_s: npt.ArrayLike,
                   lost_s: npt.ArrayLike = 0.0) -> np.ndarray:
    """Expected time lost per second of useful training with checkpoints every ``interval_s``:
    ``C/τ`` saving plus, per interruption (every ``M`` s), half an interval redone and ``lost_s`` (a
    restart, or the write time of the last save). inf where the save alone takes half the time (``τ < 2C``);
    0 when never interrupted and saves cost nothing."""
    tau = np.asarray(interval_s, dtype=float)
    c = np.asarray(save_cost_s, dtype=float)
    m = np.asarray(mtbf_s, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        saving = np.where(c > 0, c / tau, 0.0)
        redo = np.where(np.isinf(m), 0.0, (np.where(np.isinf(tau), 0.0, tau / 2) + lost_s) / m)
        out = saving + redo
    return np.asarray(np.where((c > 0) & (tau < 2 * c) & ~np.isinf(m), np.inf, out))


def job_mtbf_s(interruptions_per_hour: Sequence[float]) -> float:
    """MTBF of a job from each device's interruption rate, assuming independent losses.

    Spot losses are correlated (see ``traces.TraceStats.job_mtbf_s``); with a measured trace prefer it.
    """
    rate = sum(interruptions_per_hour)
    if any(r < 0 for r in interruptions_per_hour):
        raise ConfigError(f"interruption rates must be >= 0 (got {list(interruptions_per_hour)})")
    return math.inf if rate == 0 else 3600.0 / rate


@dataclass(frozen=True)
class IntervalChoice:
    """A checkpoint interval and why it was chosen (logged, and written into each manifest)."""

    steps: int
    """Optimizer steps between checkpoints."""
    interval_s: float
    """The same in seconds of training."""
    reason: str
    """One line a person can check: the inputs and the rule used."""
    save_cost_s: float | None = None
    """Blocked time per save used (measured)."""
    write_s: float | None = None
    """Time for a save to reach disk (measured)."""
    mtbf_s: float | None = None
    """Job MTBF used."""

    def expected_waste_fraction(self, step_time_s: float) -> float | None:
        """Expected share of time lost to saving and to redoing work (first order), when inputs are known."""
        if self.save_cost_s is None or self.mtbf_s is None or math.isinf(self.mtbf_s):
            return None
        return float(waste_fraction(self.steps * step_time_s, self.save_cost_s, self.mtbf_s, self.write_s or 0.0))


def choose_interval(
    *,
    step_time_s: float,
    save_cost_s: float,
    write_s: float,
    mtbf_s: float,
    override_steps: int | None = None,
    max_interval_s: float = DEFAULT_MAX_INTERVAL_S,
) -> IntervalChoice:
    """Checkpoint interval in steps: the user's ``override_steps``, else Young/Daly bounded below by the
    write time ``write_s`` (one save in flight at a time) and above by ``max_interval_s``."""
    if override_steps is not None:
        if override_steps < 1:
            raise ConfigError(f"checkpoint interval must be >= 1 step (got {override_steps})")
        return IntervalChoice(
            steps=override_steps,
            interval_s=override_steps * step_time_s,
            reason=f"every {override_steps} steps (set by the job file)",
        )
    if step_time_s <= 0:
        raise ConfigError(f"step_time_s must be > 0 (got {step_time_s})")
    tau = young_daly_interval_s(save_cost_s, mtbf_s)
    rule = (
        f"Young/Daly sqrt(2·C·MTBF) with C={save_cost_s:.3g} s blocked per save, "
        f"MTBF={_fmt_s(mtbf_s)}"
    )
    if tau < write_s:
        tau, rule = write_s, rule + f"; raised to the write time {write_s:.3g} s (one save in flight)"
    if tau > max_interval_s:
        tau, rule = max_interval_s, rule + f"; capped at {_fmt_s(max_interval_s)}"
    steps = max(1, round(tau / step_time_s))
    return IntervalChoice(
        steps=steps,
        interval_s=steps * step_time_s,
        reason=f"every {steps} steps ({_fmt_s(steps * step_time_s)} at {step_time_s:.3g} s/step): {rule}",
        save_cost_s=save_cost_s,
        write_s=write_s,
        mtbf_s=mtbf_s,
    )


def _fmt_s(s: float) -> str:
    if math.isinf(s):
        return "unknown (no interruption rate)"
    if s >= 3600:
        return f"{s / 3600:.3g} h"
    if s >= 60:
        return f"{s / 60:.3g} min"
    return f"{s:.3g} s"
