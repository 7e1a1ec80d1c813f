"""`starverse estimate` and `starverse validate` as a user runs them (subprocess)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CASES = REPO / "data" / "validation"


def run(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    # the console script installed beside the interpreter, as a user runs it
    exe = Path(sys.executable).parent / "starverse"
    return subprocess.run([str(exe), *args], cwd=cwd, capture_output=True, text=True, timeout=240)


def test_estimate_json_is_consistent(tmp_path: Path) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text(
        "model: llama-2-70b\n"
        "train: {seq_len: 4096, global_batch: 64, recompute: full, zero_stage: 1, tokens: 1.0e9}\n"
        "groups:\n"
        "- replicas: 2\n  stages: [{accelerator: a100-80gb-sxm, tp: 8, layers: 40, repeat: 2}]\n"
        "- replicas: 1\n  stages: [{accelerator: h100-80gb-sxm, tp: 8, layers: 40, repeat: 2}]\n"
        "pricing: {currency: USD, price_per_hour: {a100-80gb-sxm: 1.5, h100-80gb-sxm: 2.5}}\n")
    res = run("estimate", str(plan), "--json")
    assert res.returncode == 0, res.stderr
    est = json.loads(res.stdout)
    assert est["tokens_per_s"] == pytest.approx(64 * 4096 / est["step_time_s"])
    assert est["num_devices"] == 48 and est["fits"] is True
    assert est["cost_per_hour"] == pytest.approx(32 * 1.5 + 16 * 2.5)
    assert est["power_kw"] == pytest.approx((32 * 400 + 16 * 700) / 1000)
    shares = [g["sequences_per_step"] for g in est["groups"]]
    assert sum(shares) == 64 and shares[1] > shares[0] / 2  # the H100 group, half the devices, gets more per device
    assert set(est["breakdown"]) == {"compute", "memory", "tp_comm", "dp_comm", "pp_comm", "pipeline_bubble",
                                     "cross_group_sync"}


KNOWN_REFUSED: set[str] = set()
"""Measured runs the estimator says do not fit (open misses of issue 9, item 4; see data/validation/README.md):
none. DT-FM's two 39B runs at micro-batch 4 were until their cases stated SGD (``optimizer: sgd``); Sailor's
since its OPT is read as its Megatron-DeepSpeed builds it (sailor-mit-n2-d2 was refused before)."""
KNOWN_OOM_FITS = {"bigscience-h14336-l82-a128-dp8-tp4-pp12-mbs2", "tr3m-32gb-tp1-pp2-dp4-mbs16"}
"""Runs the source reports as failed for memory that the estimator says fit (open misses of issue 9, item 4:
BigScience's 176B search, docs/costmodel.md `bigscience`; tr3m-1B3's PP 2 / micro-batch 16 on 32 GB, 31.7 of 32.0
GB, docs/costmodel.md `tr3m`; its three other out-of-memory rows are refused since its last stage's pipe buffers
keep fp32 logits)."""


def test_validate_json_has_exactly_the_documented_shape() -> None:
    res = run("validate", str(CASES), "--json")
    doc = json.loads(res.stdout)
    assert set(doc) == {"cases", "summary", "sources"}
    stats = {"n", "median_abs_error", "p90_abs_error", "max_abs_error", "spearman", "memory_n",
             "memory_median_abs_error", "memory_max_abs_error"}
    assert set(doc["summary"]) == stats
    files = [p for p in CASES.rglob("*.yaml") if "models" not in p.parts]
    assert len(doc["cases"]) == len(files)
    assert set(doc["sources"]) == {"korthikanti2022", "megatron", "megatron2021", "mpt", "sailor", "amp_t4",
                                   "amp_mixed", "sailor_gh200", "nemo2412", "nemolong", "fmsfsdp", "mptscale", "mptlong",
                                   "opt", "bigscience", "dtfm", "dtfmslow", "dlperf", "tr3m",
                                   "maxtext_v5e", "maxtext_v5p"}
    assert all(set(s) == stats for s in doc["sources"].values())
    assert sum(s["n"] for s in doc["sources"].values()) == doc["summary"]["n"]
    for case in doc["cases"]:
        assert set(case) == {"name", "source", "metric", "predicted", "measured", "error", "predicted_memory_gb",
                             "measured_memory_gb", "memory_error", "memory_excluded", "out_of_memory", "fits"}
        assert case["metric"] == "tokens_per_s"
        if case["out_of_memory"]:  # reported as failed for memory: no throughput to compare
            assert case["measured"] is None and case["error"] is None
            continue
        assert case["error"] == pytest.approx(case["predicted"] / case["measured"] - 1)
    # the cases the estimator refuses although they ran (data/validation/README.md says why) fail the run
    refused = {c["name"] for c in doc["cases"] if not c["fits"] and not c["out_of_memory"]}
    assert refused == KNOWN_REFUSED
    # a run the source reports as failed for memory passes when the estimator refuses it
    assert "bigscience-h12288-l100-a64-dp16-tp4-pp6-mbs2" not in res.stderr
    assert {c["name"] for c in doc["cases"] if c["out_of_memory"] and c["fits"]} == KNOWN_OOM_FITS
    assert res.returncode == (1 if KNOWN_REFUSED or KNOWN_OOM_FITS else 0), res.stderr
    for name in refused:
        assert f"case {name} failed: estimator says the plan does not fit" in res.stderr
    for name in KNOWN_OOM_FITS:
        assert f"case {name} failed: the run failed for memory, but the estimator says it fits" in res.stderr


def test_validate_reports_failed_cases_and_exits_1(tmp_path: Path) -> None:
    shutil.copytree(CASES / "models", tmp_path / "models")
    good = CASES / "megatron2021-gpt-1.7b.yaml"
    shutil.copy(good, tmp_path / "ok.yaml")
    text = good.read_text()
    (tmp_path / "bad-tp.yaml").write_text(text.replace("tp: 1", "tp: 5"))
    # the same model on one 24 GB card without recompute cannot fit
    (tmp_path / "too-big.yaml").write_text(
        text.replace("a100-80gb-sxm", "rtx-4090").replace("recompute: full", "recompute: none"))
    res = run("validate", str(tmp_path), "--json")
    assert res.returncode == 1
    doc = json.loads(res.stdout)
    by_name = {c["name"]: c for c in doc["cases"]}
    assert by_name["bad-tp"]["predicted"] is None and by_name["ok"]["predicted"] > 0
    assert "case bad-tp failed:" in res.stderr and "tp: 5 does not divide" in res.stderr
    assert "case too-big failed: estimator says the plan does not fit" in res.stderr
    assert doc["summary"]["n"] == 2  # ok and too-big have both figures


def test_estimate_readable_output_and_help() -> None:
    res = run("estimate", str(CASES / "korthikanti2022-175b-selective.yaml"))
    assert res.returncode == 0, res.stderr
    for text in ("step time", "tokens/s", "MFU", "usable", "bottleneck", "pipeline_bubble"):
        assert text in res.stdout
    helptext = run("validate", "--help").stdout
    assert "--json" in helptext and "--catalog" in helptext
