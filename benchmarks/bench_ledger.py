"""Ledger speed: lease events per second with durability on, and ``starverse bill`` over 1,000,000 charge rows.

Prints one JSON object. Targets (issue 6): ``events_per_s`` >= 5,000 with WAL and synchronous=NORMAL,
each event its own committed transaction; ``bill_1m_rows_s`` <= 1 s. Each figure comes with a baseline
measured in the same run on the same disk: a plain one-row-per-commit INSERT loop at the same durability
(for events), a bare ``SELECT SUM`` over the charge rows (for the bill). Case and baseline alternate over
rounds (A B B A ...); each figure is the median with the spread of the rounds (``*_spread``), and a part that
fails says so in the JSON instead of crashing the run (``_common.py``).
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path

from _common import Report, interleave, paired_ratio, spread
from starverse.billing import EventKind, LeasePricing, Ledger, PricingMode, check_ledger, make_bill
from starverse.billing.schema import verify

T0 = 1_700_000_000
NUM_EVENTS = 6000
ROUNDS = 4
"""Rounds of each interleaved comparison (``BENCH_ROUNDS`` overrides)."""
BILL_LEASES, BILL_SEGMENTS = 2000, 500  # 1,000,000 price segments -> >= 1,000,000 charge rows


def bench_events(path: Path) -> dict[str, float]:
    """Open / spot price change / close / checkpoint, each one committed transaction, through the API."""
    rng = random.Random(0)
    with Ledger.open(path) as led:
        job = led.start_job("bench")
        open_leases: dict[str, int] = {}
        t = T0
        n = 0
        start, cpu0 = time.perf_counter(), time.process_time()
        while n < NUM_EVENTS:
            t += 1
            dev = f"d{rng.randrange(64)}"
            if dev not in open_leases:
                open_leases[dev] = led.open_lease(job, dev, "rtx-4090", LeasePricing(
                    PricingMode.SPOT, Decimal("0.35")), at_s=t).id
            else:
                r = rng.random()
                if r < 0.5:
                    led.set_price(open_leases[dev], Decimal(rng.randint(20, 50)) / 100, at_s=t)
                elif r < 0.9:
                    led.close_lease(open_leases.pop(dev), t)
                else:
                    led.record_event(job, EventKind.CHECKPOINT, at_s=t)
            n += 1
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu0
        sync = led.execute("PRAGMA synchronous").fetchone()[0]
        mode = led.execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal" and sync >= 1, (mode, sync)  # 1 = NORMAL
    return {"events_per_s": n / elapsed, "events_per_cpu_s": n / cpu}


def bench_plain_inserts(path: Path) -> float:
    """Baseline: one row per committed transaction, WAL + synchronous=NORMAL, no logic."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = NORMAL")
    conn.execute("CREATE TABLE t (a INTEGER, b INTEGER, c TEXT)")
    start = time.perf_counter()
    for i in range(NUM_EVENTS):
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO t VALUES (?, ?, ?)", (i, i * 7, "x"))
        conn.execute("COMMIT")
    elapsed = time.perf_counter() - start
    conn.close()
    return NUM_EVENTS / elapsed


def build_bill_ledger(path: Path) -> int:
    """A ledger whose leases have many spot price changes: >= 1,000,000 charge rows, through the API."""
    rng = random.Random(1)
    with Ledger.open(path) as led:
        jobs = [led.start_job(f"job{i}") for i in range(4)]
        for i in range(BILL_LEASES):
            start = T0 + i * 10
            le = led.open_lease(jobs[i % 4], f"n{i % 50}/gpu{i // 50}", "rtx-4090",
                                LeasePricing(PricingMode.SPOT, Decimal("0.35")), at_s=start)
            led.record_prices(le, [(start + 60 * k, Decimal(rng.randint(20, 60)) / 100)
                                   for k in range(1, BILL_SEGMENTS)])
            led.close_lease(le, start + 60 * BILL_SEGMENTS)
        return int(led.execute("SELECT COUNT(*) FROM charges").fetchone()[0])


def main() -> None:
    report = Report()
    rounds = int(os.environ.get("BENCH_ROUNDS", str(ROUNDS)))
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        runs = iter(range(10**6))
        cpu_rates: list[float] = []

        def events() -> float:
            ev = bench_events(tmp / f"events{next(runs)}.sqlite")
            cpu_rates.append(ev["events_per_cpu_s"])
            return ev["events_per_s"]

        with report.part("events"):
            # the API and the bare INSERT loop alternate (A B B A ...): the ratio is taken per round
            samples = interleave({"events": events, "plain": lambda: bench_plain_inserts(
                tmp / f"plain{next(runs)}.sqlite")}, rounds)
            report.figure("events_per_s", spread(samples["events"]))
            # on a shared machine the wall figure is mostly waiting for a core: the CPU-time rate says what one
            # free core would do
            report.figure("events_per_cpu_s", spread(cpu_rates))
            report.figure("plain_insert_per_s", spread(samples["plain"]))
            report.figure("events_vs_plain_insert_ratio", paired_ratio(samples["events"], samples["plain"]))
            report.figure("events_target_met", statistics.median(samples["events"]) >= 5000)

        db = tmp / "bill.sqlite"
        t = time.perf_counter()
        rows = build_bill_ledger(db)
        report.figure("bill_build_s", round(time.perf_counter() - t, 2))
        report.figure("charge_rows", rows)
        conn = sqlite3.connect(db)

        def raw_scan() -> float:
            t = time.perf_counter()
            conn.execute("SELECT SUM(ticks), SUM(seconds) FROM charges").fetchone()
            return time.perf_counter() - t

        with report.part("bill_inprocess"), Ledger.open(db) as led:
            def bill_by(by: str) -> Callable[[], float]:
                def run() -> float:
                    t = time.perf_counter()
                    make_bill(led, by)
                    return time.perf_counter() - t
                return run

            samples = interleave({"raw": raw_scan, **{by: bill_by(by) for by in ("job", "device", "mode", "day")}},
                                 rounds)
            for by in ("job", "device", "mode", "day"):
                report.figure(f"bill_{by}_inprocess_s", spread(samples[by]))
            report.figure("raw_sum_scan_s", spread(samples["raw"]))
            report.figure("bill_vs_raw_scan_ratio", paired_ratio(samples["job"], samples["raw"]))
            t = time.perf_counter()
            assert check_ledger(led).ok
            report.figure("check_1m_rows_s", round(time.perf_counter() - t, 2))  # re-rates every lease in Python
        conn.close()

        cli = str(Path(sys.executable).with_name("starverse"))
        subprocess.run([cli, "version"], check=True, capture_output=True)  # warm the page cache / imports

        def timed(*args: str) -> Callable[[], float]:
            def run() -> float:
                t = time.perf_counter()
                res = subprocess.run([cli, *args], check=True, capture_output=True, text=True)
                if args[0] == "bill":
                    assert json.loads(res.stdout)["totals"][0]["charge_ticks"] > 0
                return time.perf_counter() - t
            return run

        with report.part("bill_cli"):
            # the CLI opens the ledger read-only after SQLite's quick_check of every page (issue 15)
            samples = interleave({"startup": timed("version"), "bill": timed("bill", "--db", str(db), "--json")},
                                 rounds)
            report.figure("bill_1m_rows_s", spread(samples["bill"]))
            report.figure("cli_startup_s", spread(samples["startup"]))
            report.figure("bill_1m_rows_minus_startup_s",
                          spread([b - s for b, s in zip(samples["bill"], samples["startup"], strict=True)]))
            report.figure("bill_target_met", statistics.median(samples["bill"]) <= 1.0)
        with report.part("quick_check"):
            t = time.perf_counter()
            verify(db)
            report.figure("quick_check_1m_rows_s", round(time.perf_counter() - t, 3))
    report.emit()


if __name__ == "__main__":
    main()
