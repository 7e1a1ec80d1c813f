"""Property: any malformed job, pool, plan or training file is one clean error (issue 15).

Hypothesis starts from a valid file of each kind and breaks it in a way no field accepts: a hostile value at any
leaf or mapping (non-finite, negative, astronomically large, the wrong shape), a misspelt key, a key given
twice, an alias bomb, an unclosed bracket. The CLI (run in this process through ``starverse.cli.main``) must exit
2 with one line on stderr and no traceback; the per-example deadline turns a hang into a failure (it is a hang
detector: each example takes milliseconds).
"""

from __future__ import annotations

import copy
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import TINY
from starverse.cli import main

VALID: dict[str, dict[str, Any]] = {
    "job.yaml": {"model": "llama-2-7b", "train": {"seq_len": 4096, "global_batch": 128, "tokens": 2.0e9},
                 "objective": "cost-performance", "constraints": {"max_budget_per_hour": 20, "max_power_kw": 30},
                 "search": {"max_groups": 2, "restart_s": 300}},
    "pool.yaml": {"currency": "USD", "cross_offer_gbps": 100, "offers": [
        {"accelerator": "rtx-4090", "count": 16, "price_per_hour": 0.69, "devices_per_node": 8},
        {"accelerator": "a100-80gb-sxm", "count": 8, "price_per_hour": 2.45, "spot_price_per_hour": 1.1,
         "pricing": "spot", "interruptions_per_hour": 0.1, "billing_granularity_s": 60}]},
    "plan.yaml": {"model": "llama-2-7b", "train": {"seq_len": 4096, "global_batch": 128, "zero_stage": 1},
                  "groups": [{"replicas": 2, "micro_batch": 1, "stages": [
                      {"accelerator": "a100-80gb-sxm", "tp": 4, "layers": 16, "repeat": 2}]}],
                  "network": {"cross_group_gbps": 100, "devices_per_node": {"a100-80gb-sxm": 8}}},
    "train.yaml": {"model": "tiny.json", "dataset": "docs", "run_dir": "run", "devices": {"cpu_ranks": 1},
                   "train": {"steps": 3, "seq_len": 16, "global_batch": 4, "micro_batch": 2, "lr": 1e-3},
                   "checkpoint": {"interval_steps": 2, "grace_s": 30, "keep_last": 2},
                   "billing": {"budget_total": 5.0, "max_budget_per_hour": 1.0},
                   "metrics": {"port": 0, "linger_s": 0}},
}
ARGV = {
    "job.yaml": ["plan", "job.yaml", "--pool", "pool.yaml"],
    "pool.yaml": ["plan", "job.yaml", "--pool", "pool.yaml"],
    "plan.yaml": ["estimate", "plan.yaml"],
    "train.yaml": ["train", "train.yaml"],
}
HOSTILE: list[Any] = [float("inf"), float("-inf"), float("nan"), -1, -1e300, 10**30, 1e300, [[1], {"a": None}],
                      {"nested": [float("nan")]}]
"""Values no field of any file accepts (every number is positive, finite and bounded; no field takes a list
of lists or an arbitrary mapping)."""


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every value position in ``doc`` (leaves and containers, not the root)."""
    out: list[tuple[Any, ...]] = []
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else []
    for k, v in items:
        out.append((*prefix, k))
        out.extend(_paths(v, (*prefix, k)))
    return out


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> None:
    for k in path[:-1]:
        doc = doc[k]
    doc[path[-1]] = value


def _rename(doc: Any, path: tuple[Any, ...]) -> None:
    for k in path[:-1]:
        doc = doc[k]
    doc[str(path[-1]) + "_x"] = doc.pop(path[-1])


def _dump(doc: Any) -> str:
    return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)


@st.composite
def malformed(draw: st.DrawFn) -> tuple[str, str]:
    """(file name, broken text)."""
    name = draw(st.sampled_from(sorted(VALID)))
    doc = copy.deepcopy(VALID[name])
    kind = draw(st.sampled_from(["value", "value", "value", "rename", "duplicate", "bomb", "unclosed"]))
    if kind in ("value", "rename"):
        path = draw(st.sampled_from(_paths(doc)))
        if kind == "rename" and isinstance(path[-1], str):
            _rename(doc, path)
        else:
            _set(doc, path, draw(st.sampled_from(HOSTILE)))
        return name, _dump(doc)
    text = _dump(doc)
    lines = text.splitlines()
    if kind == "duplicate":
        top = [line for line in lines if line and not line.startswith((" ", "-"))]
        return name, text + draw(st.sampled_from(top)) + "\n"
    if kind == "bomb":
        depth = draw(st.integers(min_value=7, max_value=12))
        anchors = ["&a0 [" + ", ".join(['"lol"'] * 9) + "]"]
        anchors += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, depth)]
        key = draw(st.sampled_from([k for k in doc if isinstance(doc[k], str | int | float)]))
        lines = [f"{key}: [{', '.join(anchors)}]" if line.startswith(f"{key}:") else line for line in lines]
        return name, "\n".join(lines) + "\n"
    at = draw(st.integers(min_value=0, max_value=len(lines) - 1))
    lines[at] = lines[at] + " {unclosed: ["
    return name, "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("malformed")
    for name, doc in VALID.items():
        (root / name).write_text(_dump(doc))
    (root / "tiny.json").write_text(json.dumps(TINY))
    (root / "docs").mkdir()
    (root / "docs" / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 50)
    return root


@pytest.mark.timeout(300)
@settings(max_examples=80, deadline=timedelta(seconds=20), derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=malformed())
def test_any_malformed_file_is_one_clean_error(case: tuple[str, str], project: Path,
                                              capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    name, text = case
    monkeypatch.chdir(project)
    monkeypatch.setenv("STARVERSE_PROFILE", "")
    monkeypatch.setenv("STARVERSE_CACHE", str(project / "cache"))
    monkeypatch.setenv("COLUMNS", "400")
    target = project / name
    target.write_text(text)
    try:
        code = main(ARGV[name])
    finally:
        target.write_text(_dump(VALID[name]))
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, f"{name}:\n{text}\n{err}"
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
