"""`starverse train` with its accounting as a user runs it: the job file's `billing:` and `metrics:` fields, leases
priced from the job's pool (free without one), the hourly cap refused before launch, the total budget stopping
the job cleanly, a shared ledger in another currency, and the one-line errors of bad billing/metrics fields."""

from __future__ import annotations

import json
import os
import subprocess
from decimal import Decimal
from pathlib import Path

import pytest

from helpers import CLI, RAY_GROUP, TINY
from helpers import new_user_env as _env
from starverse.billing import Ledger, fx_rate
from starverse.cli import main
from starverse.elastic.job import job_prices, load_job
from starverse.errors import BudgetExceededError, ConfigError

REPO = Path(__file__).resolve().parents[2]


def _job(tmp: Path, extra: str, steps: int = 4, price: float | None = 36.0, devices: str = "{cpu_ranks: 2}") -> Path:
    """A tiny job on 2 CPU ranks; ``price`` per rank-hour (on-demand) from a pool, or no pool (None)."""
    (tmp / "tiny.json").write_text(json.dumps(TINY))
    (tmp / "corpus.txt").write_text(Path(os.__file__).read_text()[:30000])
    pool = ""
    if price is not None:
        (tmp / "pool.yaml").write_text(f"currency: USD\noffers:\n  - {{accelerator: cpu, count: 2, "
                                       f"price_per_hour: {price}}}\n")
        pool = "pool: pool.yaml\n"
    job = tmp / "job.yaml"
    job.write_text(
        "model: tiny.json\ndataset: corpus.txt\nrun_dir: run\n" + pool
        + f"train: {{steps: {steps}, seq_len: 32, global_batch: 8, micro_batch: 2, rebalance_every: 0}}\n"
        f"devices: {devices}\ncheckpoint: {{interval_steps: 1000}}\n" + extra
    )
    return job


def _train(tmp: Path, job: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, "train", str(job), "--json"], cwd=tmp, env=_env(tmp), capture_output=True,
                          text=True, timeout=240)


@pytest.mark.slow
def test_total_budget_checkpoints_and_stops_within_one_interval(tmp_path):
    # 2 ranks at 36 USD/h = 0.02 USD per second: a 0.06 budget lasts about 3 s of a job of 100,000 steps
    job = _job(tmp_path, "billing: {budget_total: 0.06}\n", steps=100_000)
    out = _train(tmp_path, job)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout)
    assert res["stop_reason"].startswith("budget: ") and "exceed the total budget 0.060000" in res["stop_reason"]
    assert 0 < res["final_step"] < 100_000
    bill = res["bill"]
    assert bill["currency"] == "USD" and bill["ledger"] == str(tmp_path / "run" / "ledger.sqlite")
    assert [le["price_per_hour"] for le in bill["leases"]] == ["36", "36"]
    assert all(le["charge_ticks"] == 36_000_000 * le["seconds"] for le in bill["leases"])
    # never more than one billing interval (1 s of both devices: 0.02 USD) over the budget
    assert Decimal("0") < Decimal(bill["charges"]) <= Decimal("0.06") + Decimal("0.02")
    # the stop is recorded, then the checkpoint of the step it stopped at (no plain `stop`: it was the budget)
    assert bill["events"][-2:] == [{"kind": "budget_stop", "step": res["final_step"]},
                                   {"kind": "checkpoint", "step": res["final_step"]}]
    listed = subprocess.run([*CLI, "checkpoints", "list", "run", "--json"], cwd=tmp_path, env=_env(tmp_path),
                            capture_output=True, text=True, timeout=60)
    assert json.loads(listed.stdout)["checkpoints"][-1]["step"] == res["final_step"]

    # the budget is spent: running the job again is refused before anything is launched; nothing changes
    ledger = tmp_path / "run" / "ledger.sqlite"
    before = ledger.read_bytes()
    again = subprocess.run([*CLI, "train", str(job)], cwd=tmp_path, env=_env(tmp_path), capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == 2 and again.stderr == (
        f"error: {job}: billing.budget_total: job 'run' has spent {bill['charges']} USD of its total budget "
        f"0.06 USD ({ledger}). To fix: raise billing.budget_total to continue it, or name another job "
        "(billing.job).\n")
    assert ledger.read_bytes() == before
    # another currency for the same job is refused too
    job.write_text(job.read_text().replace("budget_total: 0.06}", "budget_total: 1, currency: EUR}"))
    again = subprocess.run([*CLI, "train", str(job)], cwd=tmp_path, env=_env(tmp_path), capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == 2 and again.stderr == (
        f"error: {job}: billing.currency: job 'run' in {ledger} is billed in USD, not EUR. To fix: set "
        "billing.currency: USD (other prices are converted), or name another job (billing.job).\n")


def test_hourly_cap_refuses_the_job_before_anything_runs(tmp_path, monkeypatch, capsys):
    """Run in this process (``starverse.cli.main``, a new user's environment): a ``starverse train`` process
    imports torch (seconds of CPU) before it refuses. A billing refusal from a process of its own, one line and
    exit 2, is the currency mismatch of test_total_budget_checkpoints_and_stops_within_one_interval."""
    job = _job(tmp_path, "billing: {max_budget_per_hour: 50}\n")
    monkeypatch.chdir(tmp_path)
    env = _env(tmp_path)
    for k in set(os.environ) - set(env):
        monkeypatch.delenv(k)
    for k, v in env.items():
        if os.environ.get(k) != v:
            monkeypatch.setenv(k, v)
    code = main(["train", str(job), "--json"])
    out = capsys.readouterr()
    assert code == 2 and out.err.count("\n") == 1, out.err
    assert out.err == (
        f"error: {job}: billing.max_budget_per_hour: the job's devices cost 72 USD/h (2 x cpu: 36 USD/h each, "
        "on-demand (offer 'cpu' of pool.yaml)), above the cap of 50 USD/h. To fix: raise max_budget_per_hour, "
        "run fewer ranks (devices.cpu_ranks) or use cheaper offers in the pool.\n"
    )
    assert not (tmp_path / "run" / "ledger.sqlite").exists() and not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_shared_ledger_in_another_currency_and_metrics_off(tmp_path):
    job = _job(tmp_path, "billing: {ledger: ledgers/team.sqlite, job: exp-1, currency: eur}\n"
                         "metrics: {enabled: false}\n", steps=40)
    out = _train(tmp_path, job)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout)
    bill = res["bill"]
    assert bill["job"] == "exp-1" and bill["currency"] == "EUR"
    assert bill["ledger"] == str(tmp_path / "ledgers" / "team.sqlite")
    assert not (tmp_path / "run" / "ledger.sqlite").exists()
    assert res["metrics_url"] is None and not (tmp_path / "run" / "metrics.json").exists()
    assert [(le["price_per_hour"], le["price_currency"]) for le in bill["leases"]] == [("36", "USD")] * 2
    # each USD price is converted to EUR once, when the lease opens, at the rate table's rate
    eur = (Decimal(36) * fx_rate("USD", "EUR")).quantize(Decimal("0.000001"))
    with Ledger.open(tmp_path / "ledgers" / "team.sqlite", create=False) as led:
        for le in led.leases(led.job("exp-1")):
            assert le.fx_rate == fx_rate("USD", "EUR") and le.end_s is not None
            assert [r.ticks for r in led.charges(le.id)] == [int(eur * 1_000_000) * (le.end_s - le.start_s)] * (
                le.end_s > le.start_s)
    bill_out = subprocess.run([*CLI, "bill", "--db", "ledgers/team.sqlite", "--json"], cwd=tmp_path,
                              env=_env(tmp_path), capture_output=True, text=True, timeout=60)
    (total,) = json.loads(bill_out.stdout)["totals"] or [{"currency": "EUR", "charge_ticks": 0}]
    assert (total["currency"], total["charge_ticks"]) == ("EUR", bill["charge_ticks"])


@pytest.mark.slow
def test_without_a_pool_local_devices_are_free_and_without_billing_there_is_no_ledger(tmp_path):
    job = _job(tmp_path, "billing: {enabled: false}\n", steps=2, price=None)
    out = _train(tmp_path, job)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout)
    assert res["bill"] is None and res["final_step"] == 2
    assert not (tmp_path / "run" / "ledger.sqlite").exists()
    endpoint = json.loads((tmp_path / "run" / "metrics.json").read_text())  # metrics are on by default
    assert endpoint["host"] == "127.0.0.1" and endpoint["url"] == f"http://127.0.0.1:{endpoint['port']}/metrics"
    assert endpoint["port"] > 0 and res["metrics_url"] == endpoint["url"]

    free = job_prices(load_job(job), ["cpu", "cpu"])
    assert free.cost_per_hour == 0 and free.currency == "USD"
    assert free.lines == ("2 x cpu: free (no pool: your own device)",)


@pytest.mark.slow
@pytest.mark.xdist_group(RAY_GROUP)
def test_train_runs_its_ranks_as_ray_actors_when_the_job_asks(tmp_path):
    pytest.importorskip("ray")
    job = _job(tmp_path, "billing: {enabled: false}\nmetrics: {enabled: false}\n", steps=2, price=None,
               devices="{cpu_ranks: 2, launcher: ray}")
    out = _train(tmp_path, job)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout)
    assert res["final_step"] == 2
    assert any(p.name.startswith("step-") for p in (tmp_path / "run" / "checkpoints").iterdir())
    with pytest.raises(ConfigError) as e:
        load_job(_write(tmp_path, "devices: {launcher: rai}\n"))
    assert "job.yaml:2: devices.launcher: must be 'local' or 'ray' (got 'rai')" in str(e.value)


def _write(tmp: Path, text: str) -> Path:
    p = tmp / "job.yaml"
    p.write_text("dataset: x\n" + text)
    return p


@pytest.mark.parametrize(("text", "message"), [
    ("billing: {budget_totl: 3}\n", "job.yaml:2: billing.budget_totl: unknown field; did you mean 'budget_total'?"),
    ("billing:\n  currency: usx\n", "job.yaml:3: billing.currency: unknown currency 'usx'. Did you mean 'USD'?"),
    ("billing: {max_budget_per_hour: -1}\n", "job.yaml:2: billing.max_budget_per_hour: must be greater than 0 (got -1)"),
    ("billing: {budget_total: 0}\n", "job.yaml:2: billing.budget_total: must be greater than 0 (got 0)"),
    ("billing: {enabled: false, budget_total: 3}\n",
     "job.yaml:2: billing: budgets are enforced from the ledger, which enabled: false turns off; remove "
     "budget_total/max_budget_per_hour or set enabled: true"),
    ("metrics: {port: 70000}\n", "job.yaml:2: metrics.port: must be less than or equal to 65535 (got 70000)"),
    ("metrics: {linger_s: -1}\n", "job.yaml:2: metrics.linger_s: must be greater than or equal to 0 (got -1)"),
    ("metric: {port: 1}\n", "job.yaml:2: metric: unknown field; did you mean 'metrics'?"),
])
def test_billing_and_metrics_field_errors_are_one_line(tmp_path, text, message):
    with pytest.raises(ConfigError) as e:
        load_job(_write(tmp_path, text))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_prices_come_from_the_first_offer_of_each_accelerator_converted_to_the_job_currency(tmp_path):
    (tmp_path / "pool.yaml").write_text(
        "currency: CNY\noffers:\n"
        "  - {accelerator: cpu, count: 4, price_per_hour: 2.0, spot_price_per_hour: 0.5, pricing: spot}\n"
        "  - {name: cpu-od, accelerator: cpu, count: 4, price_per_hour: 9.0}\n"
        "  - {accelerator: rtx-4090, count: 1, price_per_hour: 1.2, billing_granularity_s: 60}\n"
    )
    job = load_job(_write(tmp_path, "pool: pool.yaml\nbilling: {currency: CNY, max_budget_per_hour: 2.2}\n"))
    p = job_prices(job, ["cpu", "rtx-4090", "cpu", "t4"], "job.yaml")
    assert p.currency == "CNY" and p.cost_per_hour == Decimal("2.2")  # 2 x 0.5 spot + 1.2; the t4 is free
    assert (p.prices["cpu"].mode.value, p.prices["cpu"].price) == ("spot", Decimal("0.5"))
    assert (p.prices["rtx-4090"].price, p.prices["rtx-4090"].granularity_s) == (Decimal("1.2"), 60)
    assert p.prices["t4"].price == 0 and "1 x t4: free (not offered by pool.yaml: your own device)" in p.lines
    with pytest.raises(BudgetExceededError, match=r"^job.yaml: billing.max_budget_per_hour: the job's devices "
                                                  r"cost 2.7 CNY/h \(3 x cpu"):
        job_prices(job, ["cpu", "cpu", "cpu", "rtx-4090"], "job.yaml")
    # a pool in another currency is converted for the cap; the leases keep the offer's currency
    job = load_job(_write(tmp_path, "pool: pool.yaml\nbilling: {currency: USD}\n"))
    p = job_prices(job, ["cpu"])
    assert p.currency == "USD" and p.prices["cpu"].currency == "CNY" and 0 < p.cost_per_hour < Decimal("0.5")


@pytest.mark.slow
def test_demo_prints_the_bill_and_where_the_files_are_and_never_reuses_a_run_dir(tmp_path):
    (tmp_path / "pool.yaml").write_text("currency: USD\noffers:\n  - {accelerator: cpu, count: 2, "
                                        "price_per_hour: 3.6}\n")
    args = [*CLI, "demo", "--steps", "4", "--checkpoint-every", "2", "--corpus-mb", "0.05", "--pool", "pool.yaml",
            "--run-dir", "run"]
    # datasheet figures (STARVERSE_PROFILE=""): the probe of a fresh HOME (~10 s of CPU) is test_demo.py's subject
    env = {**_env(tmp_path), "STARVERSE_PROFILE": ""}
    out = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "run"
    text = out.stdout
    assert "leases: 7.2 USD/h; 2 x cpu: 3.6 USD/h each, on-demand (offer 'cpu' of pool.yaml)" in text
    assert "steps 4, final loss" in text
    assert f"ledger:      {run / 'ledger.sqlite'}  (starverse bill {run})" in text
    assert f"checkpoints: {run / 'checkpoints'}  (starverse checkpoints list {run})" in text
    with Ledger.open(run / "ledger.sqlite", create=False) as led:
        (job,) = led.jobs()
        leases = led.leases(job)
        ticks = sum(r.ticks for le in leases for r in led.charges(le.id))
        assert len(leases) == 2 and all(le.end_s is not None for le in leases)
        assert ticks == 3_600_000 * sum(le.end_s - le.start_s for le in leases)  # 3.6/h = 3.6e6 micros/h
        assert [(e.kind.value, e.step) for e in led.events(job)] == [("checkpoint", 2), ("checkpoint", 4),
                                                                      ("stop", 4)]
    assert f"bill (job '{job.name}', USD)" in text and f"charges {Decimal(ticks) / 3_600_000_000:.6f} USD" in text
    listed = subprocess.run([*CLI, "checkpoints", "list", "run", "--json"], cwd=tmp_path, env=_env(tmp_path),
                            capture_output=True, text=True, timeout=60)
    assert [c["step"] for c in json.loads(listed.stdout)["checkpoints"]] == [2, 4]

    again = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and again.stderr == (
        f"error: {run}: already holds the checkpoints of an earlier run; the demo trains from scratch. To fix: "
        "pass another --run-dir, or omit it (each demo then gets its own runs/demo/<UTC time>).\n")
