"""The benchmarks' shared helper: ABBA interleaving, paired ratios with their spread, a report that records a
failing or too-short part instead of crashing, and JSON without inf/NaN."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from helpers import load_script

common = load_script(Path(__file__).resolve().parents[2] / "benchmarks/_common.py", "_common")


def test_interleave_runs_cases_in_abba_order() -> None:
    calls: list[str] = []

    def case(name: str, value: float) -> Callable[[], float]:
        def run() -> float:
            calls.append(name)
            return value
        return run

    out = common.interleave({"a": case("a", 2.0), "b": case("b", 1.0)}, rounds=4)
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert out == {"a": [2.0] * 4, "b": [1.0] * 4}


def test_paired_ratio_is_per_round_with_median_and_spread() -> None:
    r = common.paired_ratio([2.0, 6.0, 3.0], [1.0, 2.0, 3.0])  # ratios 2, 3, 1
    assert r == {"median": 2.0, "min": 1.0, "max": 3.0, "rel_spread": 1.0, "n": 3}
    with pytest.raises(common.TooShort):
        common.spread([])


def test_report_records_failures_and_prints_finite_json(capsys: pytest.CaptureFixture[str]) -> None:
    report = common.Report()
    with report.part("short"):
        raise common.TooShort("0 steps")
    with report.part("broken"):
        _ = 1 / 0
    report.figure("ratio", common.spread([1.0, float("inf")]))
    report.emit()
    out = json.loads(capsys.readouterr().out)
    assert out["short_too_short"] == "0 steps"
    assert out["broken_error"] == "ZeroDivisionError: division by zero"
    assert out["ratio_spread"]["max"] is None and out["ratio_spread"]["n"] == 2
