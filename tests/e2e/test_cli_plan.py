"""`starverse plan` as a user runs it: table, JSON, --out checked by `starverse estimate`, --plot, bad input."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
STARVERSE = Path(sys.executable).parent / "starverse"


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(STARVERSE), *args], capture_output=True, text=True, cwd=cwd or ROOT, timeout=120)


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan")
    r = run("plan", str(EXAMPLES / "quickstart/job.yaml"), "--pool", str(EXAMPLES / "quickstart/pool.yaml"),
            "--json", "--top", "3", "--out", str(out / "plan.yaml"), "--plot", str(out / "frontier.png"))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout), out


def test_the_printed_check_command_runs_as_printed_for_a_path_with_spaces_and_brackets(tmp_path):
    """The follow-up command `plan --out` prints is shell-quoted (and not read as rich markup), so it runs."""
    out = tmp_path / "my plans [v1]" / "plan.yaml"
    out.parent.mkdir()
    r = run("plan", str(EXAMPLES / "quickstart/job.yaml"), "--pool", str(EXAMPLES / "quickstart/pool.yaml"),
            "--out", str(out))
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if "check it with: " in ln)
    command = shlex.split(line.split("check it with: ", 1)[1].rstrip(")"))
    assert command[:2] == ["starverse", "estimate"] and command[2] == str(out)
    assert run(*command[1:]).returncode == 0


def test_json_ranked_plans(quickstart):
    doc, _ = quickstart
    plans = doc["plans"]
    assert doc["objective"] == "cost-performance" and doc["currency"] == "USD"
    assert 1 <= len(plans) <= 3
    values = [p["objective_value"] for p in plans]
    assert values == sorted(values, reverse=True)
    for p in plans:
        assert p["cost_per_hour"] <= 20 + 1e-9  # the job's budget
        assert set(p["price_sources"]) == set(p["devices"]) and all(p["price_sources"].values())
        assert p["objective_value"] == pytest.approx(p["effective_tokens_per_s"] * 3600 / p["cost_per_hour"])
        assert p["hours"] == pytest.approx(2e9 / p["effective_tokens_per_s"] / 3600)
    assert doc["stats"]["proven_optimal"] is True


def test_out_plan_gives_same_numbers_in_estimate(quickstart):
    doc, out = quickstart
    r = run("estimate", str(out / "plan.yaml"), "--json")
    assert r.returncode == 0, r.stderr
    est = json.loads(r.stdout)
    best = doc["plans"][0]
    assert est["tokens_per_s"] == pytest.approx(best["tokens_per_s"], rel=1e-9)
    assert est["step_time_s"] == pytest.approx(best["step_time_s"], rel=1e-9)
    assert est["mfu"] == pytest.approx(best["mfu"], rel=1e-9)
    assert est["margin_gb"] == pytest.approx(best["headroom_gb"], rel=1e-9)
    assert est["power_kw"] == pytest.approx(best["power_kw"], rel=1e-9)
    assert est["cost_per_hour"] == pytest.approx(best["cost_per_hour"], rel=1e-9)


def test_plot_is_a_png_of_the_frontier(quickstart):
    doc, out = quickstart
    data = (out / "frontier.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    front = doc["frontier"]
    assert front, "the frontier has points"
    hours = [p["hours"] for p in front]
    costs = [p["cost"] for p in front]
    assert hours == sorted(hours) and costs == sorted(costs, reverse=True)  # Pareto: faster costs more


def test_table_output(tmp_path):
    r = run("plan", str(EXAMPLES / "quickstart/job.yaml"), "--pool", str(EXAMPLES / "quickstart/pool.yaml"),
            "--top", "2")
    assert r.returncode == 0, r.stderr
    for col in ("devices", "layout", "tokens/s", "MFU", "USD/h", "total", "hours", "kW", "headroom GB",
                "bottleneck"):
        assert col in r.stdout
    assert "proven optimal" in r.stdout
    assert "chosen: plan 1," in r.stdout and "M tokens per USD" in r.stdout


def test_mixed_currency_scenario_plan(tmp_path):
    r = run("plan", str(EXAMPLES / "scenario1-mixed-70b/job-lora.yaml"), "--pool",
            str(EXAMPLES / "scenario1-mixed-70b/pool-mixed.yaml"), "--json", "--top", "1")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["currency"] == "CNY"
    assert doc["plans"][0]["mode"] == "lora"


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


JOB = "model: llama-2-7b\ntrain: {seq_len: 2048, global_batch: 32}\n"
POOL = "offers:\n  - {accelerator: rtx-4090, count: 8, price_per_hour: 0.69}\n"


@pytest.mark.parametrize(
    ("job", "pool", "message"),
    [
        (JOB, "offers:\n  - {accelerator: rtx-4090, count: 0, price_per_hour: 0.69}\n",
         "pool.yaml:2: offers[0].count: must be greater than 0 (got 0)"),
        (JOB, "offers:\n  - {accelerator: h1OO, count: 8, price_per_hour: 1}\n",
         "pool.yaml:2: offers[0].accelerator: unknown accelerator 'h1OO'"),
        (JOB + "constraints: {max_budget_per_hour: 0.1}\n", POOL,
         "the budget of 0.1 USD/h excludes every offer (the cheapest device costs 0.69 USD/h)"),
        (JOB + "constraints: {deadline_hours: 5}\n", POOL,
         "job.yaml:3: constraints.deadline_hours: constraints.deadline_hours needs the length of the job; add train.tokens"),
        ("model: llama-2-7b\ntrain: {seq_len: 2048, global_batch: 32, tokens: 1e9, steps: 4}\n", POOL,
         "give either tokens or steps, not both"),
        ("model: llama-2-7b\ntrain: {seq_len: 2048, global_batch: 32}\nobjective: speed\n", POOL,
         "job.yaml:3: objective: must be 'cost-performance', 'throughput', 'cost' or 'time'"),
        ("model: lama-2-7b\ntrain: {seq_len: 2048, global_batch: 32}\n", POOL, "lama-2-7b"),
    ],
)
def test_bad_input_one_line_exit_2(tmp_path, job, pool, message):
    j = write(tmp_path, "job.yaml", job)
    p = write(tmp_path, "pool.yaml", pool)
    r = run("plan", "job.yaml", "--pool", "pool.yaml", cwd=tmp_path)
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert message in lines[0]
    assert j.exists() and p.exists()


def test_infeasible_pool_explains(tmp_path):
    write(tmp_path, "job.yaml", "model: llama-2-70b\ntrain: {seq_len: 4096, global_batch: 16, offload: none}\n"
                                "search: {alternatives: false}\n")
    write(tmp_path, "pool.yaml", "currency: CNY\noffers:\n  - {accelerator: rtx-4090, count: 16, price_per_hour: 1.2}\n"
                                 "  - {accelerator: tpu-v5e, count: 3, price_per_hour: 2.8}\n")
    r = run("plan", "job.yaml", "--pool", "pool.yaml", cwd=tmp_path)
    assert r.returncode == 2
    line = r.stderr.strip()
    assert "\n" not in line
    assert "needs ≥ 1.1 TB of weights+gradients+Adam state; the pool has 432 GB of device memory" in line
    assert "fine-tune with LORA instead →" in line


def test_help_lists_options():
    r = run("plan", "--help")
    assert r.returncode == 0
    for opt in ("--pool", "--top", "--json", "--out", "--plot", "--catalog"):
        assert opt in r.stdout


def test_simulate_plan_on_a_trace(tmp_path):
    """`starverse simulate` replays a written plan on a bundled trace: p50 <= p90, the planner's figure beside
    the simulated one; a bad policy or a missing trace is one line and exit code 2."""
    trace = ROOT / "data/traces/bamboo/p3-trace.csv"
    plan = tmp_path / "plan.yaml"
    plan.write_text(textwrap.dedent("""\
        model: llama-1b
        train: {seq_len: 2048, global_batch: 32, tokens: 1.0e9, zero_stage: 1}
        groups:
          - replicas: 8
            micro_batch: 2
            stages: [{accelerator: rtx-4090, tp: 1, layers: 16}]
        pricing: {currency: USD, price_per_hour: {rtx-4090: 0.34}}
        """))
    r = run("simulate", str(plan), "--trace", str(trace), "--runs", "300", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["policy"] == "restart" and doc["runs"] == 300
    assert 1.0 < doc["p50"]["factor"] <= doc["p90"]["factor"]
    assert doc["p50"]["wall_hours"] == pytest.approx(doc["p50"]["factor"] * doc["work_hours"])
    assert doc["p50"]["cost"] == pytest.approx(doc["p50"]["wall_hours"] * 8 * 0.34, rel=1e-6)
    assert doc["spot_factor_vs_sim"] == pytest.approx(doc["planner_spot_factor"] / doc["p50"]["factor"])
    helptext = run("simulate", "--help").stdout
    assert all(opt in helptext for opt in ("--trace", "--policy", "--runs", "--hours", "--json"))
    table = run("simulate", str(plan), "--trace", str(trace), "--runs", "200", "--policy", "in-place")
    assert table.returncode == 0 and "p90" in table.stdout and "planner (Young/Daly" in table.stdout
    bad = run("simulate", str(plan), "--trace", str(trace), "--policy", "pray")
    assert bad.returncode == 2 and bad.stderr.strip() == (
        "error: --policy: unknown policy 'pray'; use one of: restart, in-place")
    missing = run("simulate", str(plan), "--trace", str(tmp_path / "none.csv"))
    assert missing.returncode == 2 and "none.csv: trace file not found" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1
