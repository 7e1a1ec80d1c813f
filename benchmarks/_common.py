"""What every benchmark here shares: interleaved rounds, the median and spread of a figure, one JSON object
that is printed whatever happened.

On a shared machine a figure measured once, or the best of a few runs of each side in a row, moves with the
load of the moment (``bench_runtime``'s DDP ratio ranged 0.56-1.10 over four runs). Measuring the case and
its baseline in alternating order, round after round (``A B B A A B ...``), lets a slow minute hit both sides
alike; the ratio is then taken per round (paired) and reported as its median with the spread of the rounds,
so a reader sees how far to trust it. A part that fails or has too little to measure says so in the JSON
(``<name>_error``, ``<name>_too_short``) instead of crashing the whole benchmark.

Use::

    from _common import Report, interleave, paired_ratio

    report = Report()
    with report.part("ddp"):
        samples = interleave({"ours": run_ours, "ddp": run_ddp}, rounds=4)   # each callable returns a rate
        report.figure("ddp_ratio", paired_ratio(samples["ours"], samples["ddp"]))
    report.emit()   # prints one JSON object; non-finite numbers become null
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any


class TooShort(Exception):
    """A measurement had nothing to measure (no steady-state steps, an empty timing): reported, not raised."""


def interleave(cases: Mapping[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Run every case once per round, in ABBA order (forward on even rounds, backward on odd ones).

    Each callable returns one sample (a rate or a duration). Returns the samples of each case, in round order,
    so ``samples[a][i]`` and ``samples[b][i]`` were measured next to each other.
    """
    names = list(cases)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            out[name].append(float(cases[name]()))
    return out


def spread(samples: Sequence[float]) -> dict[str, Any]:
    """``{"median", "min", "max", "rel_spread", "n"}``; ``rel_spread`` = (max - min) / median."""
    if not samples:
        raise TooShort("no samples")
    med = statistics.median(samples)
    lo, hi = min(samples), max(samples)
    return {"median": med, "min": lo, "max": hi, "rel_spread": (hi - lo) / abs(med) if med else None,
            "n": len(samples)}


def paired_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> dict[str, Any]:
    """The per-round ratios ``numerator[i] / denominator[i]`` summarised by :func:`spread`."""
    ratios = [a / b for a, b in zip(numerator, denominator, strict=True) if b]
    if not ratios:
        raise TooShort("every baseline sample was 0")
    return spread(ratios)


class Report:
    """The benchmark's one JSON object: figures, and for each part that failed, why."""

    def __init__(self) -> None:
        self.out: dict[str, Any] = {}

    def figure(self, name: str, value: Any) -> None:
        """Record a figure; a :func:`spread` dict becomes ``name`` (its median) plus ``name_spread``."""
        if isinstance(value, dict) and "median" in value:
            self.out[name] = value["median"]
            self.out[f"{name}_spread"] = {k: v for k, v in value.items() if k != "median"}
        else:
            self.out[name] = value

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        """A section of the benchmark: a ``TooShort`` becomes ``name_too_short``, any other exception
        ``name_error`` (with the last line of its traceback on stderr); the benchmark goes on."""
        try:
            yield
        except TooShort as e:
            self.out[f"{name}_too_short"] = str(e)
        except Exception as e:
            self.out[f"{name}_error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc(file=sys.stderr)

    def emit(self) -> None:
        """Print the object (with the machine's load, which explains a wide spread)."""
        self.out["load_average_1m"] = round(os.getloadavg()[0], 2)
        self.out["cpus"] = os.cpu_count()
        print(json.dumps(_finite(self.out), allow_nan=False))


def _finite(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x
