"""``starverse bill`` as a user runs it: totals, groupings, JSON, credits apart, --check, one-line errors."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest

from starverse.billing import EventKind, LeasePricing, Ledger, PricingMode
from starverse.cli import main

T0 = 1_700_000_000
MIDNIGHT = (T0 // 86400 + 1) * 86400
STARVERSE = str(Path(sys.executable).with_name("starverse"))


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([STARVERSE, "bill", *args], capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("run")
    with Ledger.open(d / "ledger.sqlite") as led:
        job = led.start_job("llama-mixed", at_s=MIDNIGHT - 3600)
        a = led.open_lease(job, "n0/gpu0", "rtx-4090", LeasePricing(PricingMode.SPOT, Decimal("0.36")),
                           at_s=MIDNIGHT - 3600)
        led.set_price(a, "0.72", at_s=MIDNIGHT - 1800)
        b = led.open_lease(job, "n1/tpu0", "tpu-v5e", LeasePricing(PricingMode.ON_DEMAND, Decimal("1.2"), "USD", 60),
                           at_s=MIDNIGHT - 3600)
        led.record_event(job, EventKind.CHECKPOINT, at_s=MIDNIGHT - 600)
        led.close_lease(a, MIDNIGHT)
        led.record_event(job, EventKind.PREEMPTION, at_s=MIDNIGHT, lease=a)
        led.record_event(job, EventKind.RESUME, at_s=MIDNIGHT + 300)
        led.close_lease(b, MIDNIGHT + 3601)  # per-minute offer: 7201 s billed as 7260
    return d


# per-second reference: 0.36/h * 1800 s + 0.72/h * 1800 s, and 1.2/h * 7260 s
SPOT_TICKS = 360_000 * 1800 + 720_000 * 1800
TPU_TICKS = 1_200_000 * 7260
CREDIT_TICKS = 720_000 * 600 + 1_200_000 * 600 + 1_200_000 * 300  # redo on both, restart on the TPU only


def test_json_totals_equal_the_per_second_charges_and_credits_are_apart(run_dir: Path):
    res = run(str(run_dir), "--json", "--by", "device")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    lines = {x["key"]: x for x in out["lines"]}
    assert lines["n0/gpu0"]["charge_ticks"] == SPOT_TICKS
    assert lines["n1/tpu0"]["charge_ticks"] == TPU_TICKS
    assert lines["n0/gpu0"]["charges"] == "0.540000"
    total = out["totals"][0]
    assert total["charge_ticks"] == SPOT_TICKS + TPU_TICKS
    assert total["charges"] == "2.960000"  # 0.54 + 2.42
    assert total["credit_ticks"] == CREDIT_TICKS
    assert total["net"] == str((Decimal(SPOT_TICKS + TPU_TICKS - CREDIT_TICKS) / 3_600_000_000).quantize(
        Decimal("0.000001")))
    assert sorted((c["kind"], c["lease"], c["seconds"]) for c in out["credits"]) == [
        ("redo", 1, 600), ("redo", 2, 600), ("restart", 2, 300)]


@pytest.mark.parametrize("by", ["job", "mode", "day"])
def test_every_grouping_adds_up_to_the_same_total(run_dir: Path, by: str):
    out = json.loads(run("--db", str(run_dir / "ledger.sqlite"), "--by", by, "--json").stdout)
    assert sum(x["charge_ticks"] for x in out["lines"]) == SPOT_TICKS + TPU_TICKS
    if by == "day":
        days = {x["key"]: x["charge_ticks"] for x in out["lines"]}
        assert days == {"2023-11-14": SPOT_TICKS + 1_200_000 * 3600, "2023-11-15": 1_200_000 * 3660}
    if by == "mode":
        assert {x["key"] for x in out["lines"]} == {"spot", "on-demand"}


def test_table_output_and_currency_conversion(run_dir: Path):
    res = run(str(run_dir))
    assert res.returncode == 0
    assert "llama-mixed" in res.stdout and "2.960000" in res.stdout and "Insurance credits" in res.stdout
    conv = json.loads(run(str(run_dir), "--json", "--currency", "usd").stdout)
    assert conv["totals"][0]["currency"] == "USD" and conv["totals"][0]["charges"] == "2.960000"


def test_check_passes_then_catches_a_doubled_charge(run_dir: Path, tmp_path: Path):
    res = run(str(run_dir), "--check")
    assert res.returncode == 0 and "OK (1 jobs, 2 leases, 5 charge rows" in res.stdout
    assert json.loads(run(str(run_dir), "--check", "--json").stdout) == {
        "ledger": str(run_dir / "ledger.sqlite"), "ok": True, "problems": [], "jobs": 1, "leases": 2,
        "charge_rows": 5, "payments": 0}
    copy = tmp_path / "ledger.sqlite"
    copy.write_bytes((run_dir / "ledger.sqlite").read_bytes())
    conn = sqlite3.connect(copy)
    conn.execute("INSERT INTO charges (lease_id, seq, job_id, mode, kind, start_s, end_s, day, seconds, "
                 "price_micros, ticks) SELECT lease_id, seq + 10, job_id, mode, kind, start_s, end_s, day, seconds, "
                 "price_micros, ticks FROM charges WHERE lease_id = 1 AND seq = 0")
    conn.commit()
    conn.close()
    bad = run("--db", str(copy), "--check")
    assert bad.returncode == 1
    assert "lease 1: 3 stored charge rows totalling 0.720000 differ from its rating (2 rows, 0.540000)" in bad.stderr


def test_user_errors_are_one_line_exit_2_and_leave_files_untouched(run_dir: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]):
    """The first case from a process of its own (what a user sees: one line, exit 2), the others in this process
    (``starverse.cli.main``, as tests/e2e/test_bad_input_cli.py runs the CLI): the same code path to the
    message, without a process start each."""
    garbage = tmp_path / "garbage.sqlite"
    garbage.write_bytes(b"not a database at all" * 10)
    foreign = tmp_path / "other.db"
    conn = sqlite3.connect(foreign)
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    conn.close()
    digests = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in (garbage, foreign)}
    empty_run = tmp_path / "empty-run"
    empty_run.mkdir()
    cases = [
        (["--db", str(garbage)], "not a Starverse ledger (not an SQLite database, or corrupted); left untouched"),
        (["--db", str(foreign)], "an SQLite database of another application (application_id 0x0)"),
        ([str(tmp_path / "nope")], "no such run directory"),
        ([str(empty_run)], "no ledger here"),
        ([str(run_dir), "--db", str(garbage)], "give either RUN_DIR or --db FILE, not both"),
        ([str(run_dir), "--currency", "XYZ"], "unknown currency 'XYZ'"),
        ([str(run_dir), "--by", "week"], "--by 'week': use one of job, device, mode, day"),
    ]
    for i, (args, message) in enumerate(cases):
        if i == 0:
            res = run(*args)
            code, err = res.returncode, res.stderr
        else:
            code, err = main(["bill", *args]), capsys.readouterr().err
        assert code == 2, (args, err)
        assert err.count("\n") == 1 and err.startswith("error: "), err
        assert message in err, err
    assert not (empty_run / "ledger.sqlite").exists()
    assert {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in (garbage, foreign)} == digests
