"""The ledger: leases, charges, idempotent close, recovery, migrations, bad input, foreign/corrupted files."""

from __future__ import annotations

import hashlib
import json
import sqlite3
from decimal import Decimal
from pathlib import Path

import pytest

from starverse.billing import (
    SCHEMA_VERSION,
    EventKind,
    LeasePricing,
    Ledger,
    PricingMode,
    check_ledger,
    make_bill,
)
from starverse.billing.money import TICKS_PER_UNIT, fx_rate
from starverse.billing.schema import APPLICATION_ID, migrate
from starverse.errors import BillingError

T0 = 1_700_000_000


def od(price: str, currency: str = "USD", gran: int = 1) -> LeasePricing:
    return LeasePricing(PricingMode.ON_DEMAND, Decimal(price), currency, gran)


def spot(price: str) -> LeasePricing:
    return LeasePricing(PricingMode.SPOT, Decimal(price))


@pytest.fixture
def ledger(tmp_path: Path):
    with Ledger.open(tmp_path / "ledger.sqlite") as led:
        yield led


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_lease_charges_per_second_and_spot_segments(ledger: Ledger):
    job = ledger.start_job("j1")
    le = ledger.open_lease(job, "n1/gpu0", "rtx-4090", spot("0.36"), at_s=T0)
    ledger.set_price(le, "0.72", at_s=T0 + 1800)
    rows = ledger.close_lease(le, T0 + 3600)
    assert [(r.seconds, r.price_micros) for r in rows] == [(1800, 360_000), (1800, 720_000)]
    assert ledger.spent(job) == Decimal("0.540000")
    assert ledger.charges(le) == rows
    assert ledger.lease(le).end_s == T0 + 3600


def test_close_is_idempotent_and_never_charges_twice(ledger: Ledger):
    job = ledger.start_job("j1")
    le = ledger.open_lease(job, "d", "cpu", od("3.6"), at_s=T0)
    first = ledger.close_lease(le, T0 + 10)
    assert ledger.close_lease(le, T0 + 10) == first
    assert ledger.close_lease(le) == first
    with pytest.raises(BillingError, match=r"lease 1 is already closed at 1700000010, not 1700000020"):
        ledger.close_lease(le, T0 + 20)
    assert ledger.spent_ticks(job) == 3_600_000 * 10
    assert check_ledger(ledger).ok


def test_open_lease_accrues_until_closed(ledger: Ledger):
    job = ledger.start_job("j1")
    ledger.open_lease(job, "d", "cpu", od("3.6", gran=60), at_s=T0)
    # 61 s on a per-minute offer: two minutes accrued
    assert ledger.spent_ticks(job, at_s=T0 + 61) == 3_600_000 * 120
    assert ledger.burn_rate(job) == Decimal("3.600000")


def test_overlapping_lease_is_refused_and_nothing_recorded_is_lost(ledger: Ledger):
    job = ledger.start_job("j1")
    a = ledger.open_lease(job, "dev0", "cpu", od("1"), at_s=T0)
    with pytest.raises(BillingError, match=r"device 'dev0' already has lease 1 \(job 1\) from 1700000000 still "
                                           r"open, overlapping a new lease from 1700000100"):
        ledger.open_lease(job, "dev0", "cpu", od("1"), at_s=T0 + 100)
    ledger.close_lease(a, T0 + 200)
    with pytest.raises(BillingError, match=r"from 1700000000 until 1700000200, overlapping a new lease from 1700000199"):
        ledger.open_lease(job, "dev0", "cpu", od("1"), at_s=T0 + 199)
    b = ledger.open_lease(job, "dev0", "cpu", od("1"), at_s=T0 + 200)  # back to back is fine
    # a lease cannot be closed across a later lease of the same device
    c = ledger.open_lease(job, "dev1", "cpu", od("1"), at_s=T0)
    ledger.close_lease(c, T0 + 10)
    d = ledger.open_lease(job, "dev1", "cpu", od("1"), at_s=T0 + 20)
    assert d.id > c.id
    # a backdated lease overlaps a later one of the device (an open lease covers all that follows)
    with pytest.raises(BillingError, match=r"device 'dev1' already has lease 4 \(job 1\) from 1700000020 still open"):
        ledger.open_lease(job, "dev1", "cpu", od("1"), at_s=T0 + 15)
    e = ledger.open_lease(job, "dev2", "cpu", od("1"), at_s=T0 + 100)
    ledger.close_lease(e, T0 + 200)
    with pytest.raises(BillingError, match=r"lease 5 \(job 1\) from 1700000100 until 1700000200, overlapping a "
                                           r"new lease from 1700000050"):
        ledger.open_lease(job, "dev2", "cpu", od("1"), at_s=T0 + 50)
    ledger.close_lease(ledger.open_lease(job, "dev3", "cpu", od("1"), at_s=T0), T0 + 60)
    # leases are half-open in whole seconds: one that started and ended within a second (a run of under a second,
    # then its rerun) does not overlap the next lease from that second; a lease from an earlier second does
    ledger.close_lease(ledger.open_lease(job, "dev4", "cpu", od("1"), at_s=T0 + 300), T0 + 300)
    with pytest.raises(BillingError, match=r"lease 7 \(job 1\) from 1700000300 until 1700000300, overlapping"):
        ledger.open_lease(job, "dev4", "cpu", od("1"), at_s=T0 + 299)
    g = ledger.open_lease(job, "dev4", "cpu", od("1"), at_s=T0 + 300)
    with pytest.raises(BillingError, match=r"device 'dev4' already has lease 8 \(job 1\) from 1700000300 still open"):
        ledger.open_lease(job, "dev4", "cpu", od("1"), at_s=T0 + 300)
    ledger.close_lease(g, T0 + 310)
    assert [le.id for le in ledger.leases(job)] == [a.id, b.id, c.id, d.id, e.id, 6, 7, g.id]
    assert ledger.spent_ticks(job, at_s=T0 + 200) == 1_000_000 * (200 + 10 + 180 + 100 + 60 + 0 + 10)
    assert check_ledger(ledger).ok


def test_bad_input_one_clear_error_each(ledger: Ledger, tmp_path: Path):
    job = ledger.start_job("j1")
    le = ledger.open_lease(job, "d", "cpu", spot("1"), at_s=T0)
    before = ledger.spent_ticks(job, at_s=T0 + 50)
    with pytest.raises(BillingError, match=r"unknown currency 'USDD'\. Did you mean 'USD'"):
        ledger.open_lease(job, "e", "cpu", od("1", "USDD"), at_s=T0)
    with pytest.raises(BillingError, match=r"unknown currency 'XXX'"):
        ledger.start_job("j2", currency="XXX")
    with pytest.raises(BillingError, match=r"price: must be >= 0 \(got -2\)"):
        LeasePricing(PricingMode.ON_DEMAND, Decimal(-2))
    with pytest.raises(BillingError, match=r"price: must be >= 0 \(got -0.5\)"):
        ledger.set_price(le, "-0.5", at_s=T0 + 10)
    with pytest.raises(BillingError, match="pricing mode 'weekly' is unknown"):
        LeasePricing("weekly", Decimal(1))  # type: ignore[arg-type]
    with pytest.raises(BillingError, match="granularity_s: must be a whole number of seconds >= 1"):
        LeasePricing(PricingMode.ON_DEMAND, Decimal(1), "USD", 0)
    with pytest.raises(BillingError, match="event kind 'explosion' is unknown"):
        ledger.record_event(job, "explosion")
    with pytest.raises(BillingError, match=r"price change at 1700000000 is not after the previous one"):
        ledger.set_price(le, "2", at_s=T0)
    with pytest.raises(BillingError, match="is on-demand: its price is fixed"):
        ledger.set_price(ledger.open_lease(job, "f", "cpu", od("1"), at_s=T0), "2", at_s=T0 + 1)
    with pytest.raises(BillingError, match=r"lease 1: end 1699999999 is before its start 1700000000"):
        ledger.close_lease(le, T0 - 1)
    with pytest.raises(BillingError, match="job 'j1' is billed in USD, not EUR"):
        ledger.start_job("j1", currency="EUR")
    # nothing recorded before any of these was lost or changed
    assert ledger.spent_ticks(job, at_s=T0 + 50) - 1_000_000 * 50 == before
    assert len(ledger.segments(le)) == 1
    assert [j.name for j in ledger.jobs()] == ["j1"]


def test_currency_conversion_by_rate_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    rates = tmp_path / "rates.json"
    rates.write_text(json.dumps({"XTS": 2}))  # ISO 4217 test code: 2 XTS per EUR
    monkeypatch.setenv("STARVERSE_FX_RATES", str(rates))
    assert fx_rate("EUR", "XTS") == Decimal(2)
    with Ledger.open(tmp_path / "l.sqlite") as led:
        job = led.start_job("j", currency="XTS")
        le = led.open_lease(job, "d", "cpu", od("1.5", "EUR"), at_s=T0)
        assert led.lease(le).fx_rate == Decimal(2)
        led.close_lease(le, T0 + 3600)
        assert led.spent(job) == Decimal("3.000000")
        # a bill converted back to EUR
        b = make_bill(led, "job", currency="EUR")
        assert b.totals[0].charges == Decimal("1.500000") and b.totals[0].currency == "EUR"
    monkeypatch.setenv("STARVERSE_FX_RATES", str(tmp_path / "missing.json"))
    with pytest.raises(BillingError, match=r"missing.json: cannot read currency rates \(FileNotFoundError\)"):
        fx_rate("EUR", "XTS")


def test_recover_closes_a_dead_process_leases_at_last_heartbeat(tmp_path: Path):
    path = tmp_path / "l.sqlite"
    led = Ledger.open(path)
    job = led.start_job("j")
    le = led.open_lease(job, "d", "cpu", od("3.6"), at_s=T0)
    led.heartbeat(job, at_s=T0 + 42)
    led._conn.close()  # the process dies: no close_lease
    with Ledger.open(path) as again:
        assert [x.id for x in again.leases(open_only=True)] == [le.id]
        closed = again.recover(job)
        assert [x.id for x in closed] == [le.id]
        assert again.lease(le).end_s == T0 + 42
        assert again.spent_ticks(job) == 3_600_000 * 42
        assert again.recover(job) == []
        assert check_ledger(again).ok


def test_max_budget_per_hour_refuses_a_lease(ledger: Ledger):
    job = ledger.start_job("j", max_budget_per_hour="5")
    ledger.open_lease(job, "a", "h100", od("2"), at_s=T0)
    ledger.open_lease(job, "b", "h100", od("2"), at_s=T0)
    from starverse.errors import BudgetExceededError
    with pytest.raises(BudgetExceededError, match=r"lease of 'c' \(h100\) refused: job 'j' would cost 6.000000 USD/h, "
                                                 r"above max_budget_per_hour 5.000000"):
        ledger.open_lease(job, "c", "h100", od("2"), at_s=T0)
    assert len(ledger.leases(job)) == 2
    ledger.open_lease(job, "c", "h100", od("1"), at_s=T0)  # exactly at the cap is allowed


def test_credits_for_redo_and_restart(ledger: Ledger):
    job = ledger.start_job("j", at_s=T0)
    a = ledger.open_lease(job, "a", "rtx-4090", spot("3.6"), at_s=T0)
    b = ledger.open_lease(job, "b", "rtx-4090", od("7.2"), at_s=T0)
    ledger.record_event(job, EventKind.CHECKPOINT, at_s=T0 + 100, step=10)
    ledger.record_event(job, EventKind.CHECKPOINT, at_s=T0 + 300, step=30)
    ledger.close_lease(a, T0 + 400)  # spot device taken back
    ledger.record_event(job, EventKind.PREEMPTION, at_s=T0 + 400, step=40, lease=a)
    ledger.record_event(job, EventKind.PREEMPTION, at_s=T0 + 410)  # while down: no new credit
    ledger.record_event(job, EventKind.RESUME, at_s=T0 + 460, step=30)
    ledger.close_lease(b, T0 + 1000)
    credits = ledger.credits(job)
    got = [(c.lease_id, c.kind.value, c.start_s - T0, c.end_s - T0, c.ticks) for c in credits]
    assert got == [
        (a.id, "redo", 300, 400, 3_600_000 * 100),
        (b.id, "redo", 300, 400, 7_200_000 * 100),
        (b.id, "restart", 400, 460, 7_200_000 * 60),  # lease a was gone: nothing of it to credit
    ]
    b_ = make_bill(ledger, "job")
    assert b_.totals[0].credit_ticks == sum(c.ticks for c in credits)
    assert b_.totals[0].charge_ticks == 3_600_000 * 400 + 7_200_000 * 1000  # credits are not netted in


def test_bill_totals_equal_sum_of_per_second_charges(ledger: Ledger):
    job1 = ledger.start_job("j1")
    job2 = ledger.start_job("j2", currency="EUR")
    midnight = (T0 // 86400 + 1) * 86400
    a = ledger.open_lease(job1, "a", "t4", spot("0.35"), at_s=midnight - 1000)
    ledger.record_prices(a, [(midnight - 10, "0.41"), (midnight + 500, "0.2")])
    ledger.close_lease(a, midnight + 700)
    b = ledger.open_lease(job1, "b", "t4", od("0.9", gran=60), at_s=midnight - 30)
    ledger.close_lease(b, midnight + 61)
    c = ledger.open_lease(job2, "c", "h100", LeasePricing(PricingMode.DAILY, Decimal("40"), "EUR"), at_s=T0)
    ledger.close_lease(c, T0 + 90_000)
    per_second = (
        350_000 * 990 + 410_000 * 510 + 200_000 * 200  # spot
        + 900_000 * 120  # 91 s rounded up to 2 minutes
    )
    for by in ("job", "device", "mode", "day"):
        bill = make_bill(ledger, by)
        usd = [x for x in bill.lines if x.currency == "USD"]
        assert sum(x.charge_ticks for x in usd) == per_second, by
        eur_total = next(t for t in bill.totals if t.currency == "EUR")
        assert eur_total.charge_ticks == 80 * TICKS_PER_UNIT, by  # two daily packages
    by_day = {x.key: x.charge_ticks for x in make_bill(ledger, "day").lines if x.currency == "USD"}
    assert len(by_day) == 2
    assert by_day[min(by_day)] == 350_000 * 990 + 410_000 * 10 + 900_000 * 30
    assert {x.key for x in make_bill(ledger, "mode").lines} == {"spot", "on-demand", "daily"}
    with pytest.raises(BillingError, match="--by 'week': use one of job, device, mode, day"):
        make_bill(ledger, "week")


def test_check_finds_tampering_double_charges_and_overlaps(ledger: Ledger):
    job = ledger.start_job("j")
    le = ledger.open_lease(job, "a", "cpu", od("1"), at_s=T0)
    ledger.close_lease(le, T0 + 100)
    assert check_ledger(ledger).ok
    ledger.execute("UPDATE charges SET ticks = ticks + 1")
    assert check_ledger(ledger).problems == [
        "lease 1: charge row 0 has ticks 100000001, its rating 100000000 (stored total 0.027778, rated 0.027778)"]
    ledger.execute("UPDATE charges SET ticks = ticks - 1")
    ledger.execute("INSERT INTO charges (lease_id, seq, job_id, mode, kind, start_s, end_s, day, seconds, "
                   "price_micros, ticks) SELECT lease_id, seq + 1, job_id, mode, kind, start_s, end_s, day, seconds, "
                   "price_micros, ticks FROM charges")
    assert any("2 stored charge rows" in p for p in check_ledger(ledger).problems)
    ledger.execute("DELETE FROM charges WHERE seq = 1")
    ledger.execute("INSERT INTO leases (job_id, device, accelerator, provider, mode, offer_price_micros, "
                   "offer_currency, fx_rate, granularity_s, start_s, end_s, last_seen_s) "
                   f"VALUES (1, 'a', 'cpu', 'local', 'on-demand', 0, 'USD', '1', 1, {T0 + 50}, NULL, {T0 + 50})")
    problems = check_ledger(ledger).problems
    assert any("overlaps lease 2" in p for p in problems)


def test_migrations_from_v1_rate_existing_leases(tmp_path: Path):
    path = tmp_path / "old.sqlite"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    assert migrate(conn, path, target=1) == 1
    conn.execute("INSERT INTO jobs (name, currency, created_s) VALUES ('old', 'USD', 0)")
    conn.execute("INSERT INTO leases (job_id, device, accelerator, provider, mode, offer_price_micros, offer_currency, "
                 f"fx_rate, granularity_s, start_s, end_s, last_seen_s) VALUES (1, 'd', 'cpu', 'local', 'on-demand', "
                 f"1800000, 'USD', '1', 1, {T0}, {T0 + 7200}, {T0 + 7200})")
    conn.execute(f"INSERT INTO price_segments VALUES (1, {T0}, 1800000)")
    conn.close()
    with Ledger.open(path) as led:
        versions = [r[0] for r in led.execute("SELECT version FROM schema_version ORDER BY version")]
        assert versions == list(range(1, SCHEMA_VERSION + 1))
        assert led.spent(led.job("old")) == Decimal("3.600000")
        assert check_ledger(led).ok


def test_newer_schema_is_refused_untouched(tmp_path: Path):
    path = tmp_path / "l.sqlite"
    Ledger.open(path).close()
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("INSERT INTO schema_version VALUES (99, 0, 'future')")
    conn.close()
    digest = sha(path)
    with pytest.raises(BillingError, match=rf"ledger schema version 99 is newer than this Starverse \({SCHEMA_VERSION}\); left untouched"):
        Ledger.open(path)
    assert sha(path) == digest


def test_foreign_and_corrupted_files_are_refused_and_never_modified(tmp_path: Path):
    garbage = tmp_path / "garbage.sqlite"
    garbage.write_bytes(bytes(range(256)) * 8)
    foreign = tmp_path / "foreign.sqlite"
    conn = sqlite3.connect(foreign)
    conn.execute("CREATE TABLE users (id INTEGER)")
    conn.commit()
    conn.close()
    torn = tmp_path / "torn.sqlite"
    with Ledger.open(torn) as led:
        job = led.start_job("j")
        for i in range(200):
            led.close_lease(led.open_lease(job, f"d{i}", "cpu", od("1"), at_s=T0), T0 + 10)
    led2 = Ledger.open(torn)
    led2.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    led2.close()
    data = bytearray(torn.read_bytes())
    data[4096:] = b"\xff" * (len(data) - 4096)  # keep the header, destroy every page after the first
    torn.write_bytes(bytes(data))
    for path, pattern in [
        (garbage, r"garbage.sqlite: not a Starverse ledger \(not an SQLite database, or corrupted\); left untouched"),
        (foreign, r"foreign.sqlite: an SQLite database of another application \(application_id 0x0\)"),
        (torn, r"torn.sqlite: ledger is damaged \(SQLite quick_check: .*\); left untouched and never written to"),
    ]:
        digest = sha(path)
        with pytest.raises(BillingError, match=pattern), Ledger.open(path) as led:
            led.spent_ticks(led.job("j"))  # the torn file may open; reading it must fail cleanly
        assert sha(path) == digest, path
    with pytest.raises(BillingError, match="no ledger here"):
        Ledger.open(tmp_path / "none.sqlite", create=False)
    assert not (tmp_path / "none.sqlite").exists()


def test_totals_beyond_64_bits_stay_exact(ledger: Ledger):
    # two charges of 2e9 currency units each: SQLite's SUM overflows, the ledger does not
    job = ledger.start_job("big")
    huge = 2_000_000_000 * 1_000_000  # 2e9 per hour, in micros
    leases = []
    for dev in ("a", "b"):
        le = ledger.open_lease(job, dev, "cpu", od(str(Decimal(huge) / 1_000_000)), at_s=T0)
        ledger.close_lease(le, T0 + 3600)
        leases.append(le)
    want = 2 * huge * 3600
    assert want > 2**63
    assert ledger.spent_ticks(job) == want
    assert make_bill(ledger, "job").totals[0].charge_ticks == want
    assert make_bill(ledger, "device").totals[0].charge_ticks == want
    # one row past 64 bits (6400 s to UTC midnight at 2e9/h) is refused clearly; the lease stays open
    le = ledger.open_lease(job, "c", "cpu", od(str(Decimal(huge) / 1_000_000)), at_s=T0)
    with pytest.raises(BillingError, match=r"lease 3: a charge row of 3555555555.555556 exceeds the ledger's "
                                           r"per-row limit"):
        ledger.close_lease(le, T0 + 7200)
    assert ledger.lease(le).end_s is None


def test_close_refuses_to_run_over_a_later_lease_of_the_device(ledger: Ledger):
    # unreachable through open_lease (it refuses the later lease); a file written by other code may hold one
    job = ledger.start_job("j")
    a = ledger.open_lease(job, "dev", "cpu", od("1"), at_s=T0)
    ledger.execute("INSERT INTO leases (job_id, device, accelerator, provider, mode, offer_price_micros, "
                   "offer_currency, fx_rate, granularity_s, start_s, end_s, last_seen_s) "
                   f"VALUES (1, 'dev', 'cpu', 'local', 'on-demand', 0, 'USD', '1', 1, {T0 + 50}, NULL, {T0 + 50})")
    with pytest.raises(BillingError, match=r"lease 1 of 'dev' cannot end at 1700000060: lease 2 of the same device "
                                           r"starts at 1700000050"):
        ledger.close_lease(a, T0 + 60)
    assert ledger.close_lease(a, T0 + 50)[0].seconds == 50


def test_two_processes_creating_one_new_ledger_both_migrate_it(tmp_path: Path, monkeypatch) -> None:
    """Two processes open one new ledger at once (seen in a service job started after a server restart): the
    second reads version 0 before the first commits its migrations, then waits for the write lock. Once it has
    the lock it must see them applied, not create schema_version again and call the ledger corrupted."""
    from starverse.billing import schema

    path = tmp_path / "ledger.sqlite"
    first = sqlite3.connect(path, isolation_level=None)
    second = sqlite3.connect(path, isolation_level=None)
    real = schema.current_version
    reads = {"n": 0}

    def stale_first_read(conn: sqlite3.Connection) -> int:
        reads["n"] += 1
        if conn is second and reads["n"] == 1:
            assert migrate(first, path) == schema.SCHEMA_VERSION  # the other process wins the race meanwhile
            return 0
        return real(conn)

    monkeypatch.setattr(schema, "current_version", stale_first_read)
    assert migrate(second, path) == schema.SCHEMA_VERSION
    monkeypatch.setattr(schema, "current_version", real)
    versions = [v for (v,) in second.execute("SELECT version FROM schema_version ORDER BY version")]
    assert versions == [m.version for m in schema.MIGRATIONS]  # each migration applied once
