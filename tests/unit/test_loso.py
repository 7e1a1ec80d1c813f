"""The leave-one-source-out script: every fitted constant refitted without each source (issue 9, item 3)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from starverse.costmodel import constants as C
from starverse.costmodel.fit import FITTED, TARGETS

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def loso() -> dict:
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "loso.py")], capture_output=True, text=True,
                         timeout=300, check=False)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_every_fitted_constant_is_refitted_without_each_source(loso: dict) -> None:
    sources = {"korthikanti2022", "megatron", "megatron2021", "mpt", "sailor", "amp_t4", "amp_mixed"}
    assert set(loso["fitted"]) == {c.name for c in FITTED} == {"SUSTAINED_FRACTION", "PRE_AMPERE_EFFICIENCY"}
    for name, fit in loso["fitted"].items():
        # the committed value is the fit on all sources (rounded), not a hand-picked one
        assert fit["all"] == pytest.approx(getattr(C, name), abs=0.001)
        assert set(fit["without"]) == sources
        # no source moves it much: it is not specific to one software stack or cluster
        assert all(abs(v - fit["all"]) < 0.03 for v in fit["without"].values()), fit


def test_held_out_figures_against_the_targets(loso: dict) -> None:
    held = loso["held_out"]
    # the A100/H100 sources meet p90 and rank targets held out; their medians within 16 % (Megatron-Core
    # H100: 15.8 %, 4 runs; the others 5-11 %)
    for src in ("korthikanti2022", "megatron", "megatron2021", "mpt"):
        assert held[src]["p90_abs_error"] <= TARGETS["p90_abs_error"], src
        assert held[src]["median_abs_error"] <= 0.16, src
        assert held[src]["meets"]["spearman"] in (True, None), src
    # the mixed consumer cluster: ranking meets the target, the errors do not (open miss, reported as such)
    sailor = held["sailor"]
    assert sailor["meets"]["spearman"] is True
    assert sailor["meets"]["p90_abs_error"] is False
    assert set(sailor["failed_cases"]) == {"sailor-mit-n2-d2", "sailor-mit-n4-d4", "sailor-mit-n6-d6"}
    # AMP's clusters held out: within 25 % in the median (+100 % and +66 % without the pre-Ampere term),
    # but neither p90 nor rank meets the target (open misses)
    for src in ("amp_t4", "amp_mixed"):
        assert held[src]["median_abs_error"] <= 0.25, src
        assert held[src]["meets"]["spearman"] is False, src
    assert loso["pooled"]["n"] == 136
