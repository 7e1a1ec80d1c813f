"""Ledger speed: lease events per second with durability on, and ``starverse bill`` over 1,000,000 charge rows.

Prints one JSON object. Targets (issue 6): ``events_per_s`` >= 5,000 with WAL and synchronous=NORMAL,
each event its own committed transaction; ``bill_1m_rows_s`` <= 1 s. Each figure comes with a baseline
measured in the same run on the same disk: a plain one-row-per-commit INSERT loop at the same durability
(for events), a bare ``SELECT SUM`` over the charge rows (for the bill).
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import subprocess
import sys
import tempfile
import time
from decimal import Decimal
from pathlib import Path

from starverse.billing import EventKind, LeasePricing, Ledger, PricingMode, check_ledger, make_bill

T0 = 1_700_000_000
NUM_EVENTS = 6000
REPEATS = 3
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
    out: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        # best of 3 for every timed figure, baseline included: on a shared machine the minimum is the
        # least disturbed run
        evs = [bench_events(tmp / f"events{i}.sqlite") for i in range(REPEATS)]
        ev = max(evs, key=lambda e: e["events_per_s"])
        base = max(bench_plain_inserts(tmp / f"plain{i}.sqlite") for i in range(REPEATS))
        out["events_per_s"] = round(ev["events_per_s"])
        # on a shared machine the wall figure is mostly waiting for a core: the CPU-time rate says what one
        # free core would do (load average printed below)
        out["events_per_cpu_s"] = round(ev["events_per_cpu_s"])
        out["plain_insert_per_s"] = round(base)
        out["events_vs_plain_insert_ratio"] = round(ev["events_per_s"] / base, 3)
        out["events_target_met"] = ev["events_per_s"] >= 5000

        db = tmp / "bill.sqlite"
        t = time.perf_counter()
        rows = build_bill_ledger(db)
        out["bill_build_s"] = round(time.perf_counter() - t, 2)
        out["charge_rows"] = rows
        conn = sqlite3.connect(db)
        raw = float("inf")
        for _ in range(REPEATS):
            t = time.perf_counter()
            conn.execute("SELECT SUM(ticks), SUM(seconds) FROM charges").fetchone()
            raw = min(raw, time.perf_counter() - t)
        conn.close()
        out["raw_sum_scan_s"] = round(raw, 4)
        with Ledger.open(db) as led:
            for by in ("job", "device", "mode", "day"):
                best = float("inf")
                for _ in range(REPEATS):
                    t = time.perf_counter()
                    make_bill(led, by)
                    best = min(best, time.perf_counter() - t)
                out[f"bill_{by}_inprocess_s"] = round(best, 4)
            t = time.perf_counter()
            assert check_ledger(led).ok
            out["check_1m_rows_s"] = round(time.perf_counter() - t, 2)  # re-rates every lease in Python
        cli = str(Path(sys.executable).with_name("starverse"))
        subprocess.run([cli, "version"], check=True, capture_output=True)  # warm the page cache / imports
        startup = cli_s = float("inf")
        for _ in range(REPEATS):
            t = time.perf_counter()
            subprocess.run([cli, "version"], check=True, capture_output=True)
            startup = min(startup, time.perf_counter() - t)
            t = time.perf_counter()
            res = subprocess.run([cli, "bill", "--db", str(db), "--json"], check=True, capture_output=True, text=True)
            cli_s = min(cli_s, time.perf_counter() - t)
        total = json.loads(res.stdout)["totals"][0]["charge_ticks"]
        assert total > 0
        out["bill_1m_rows_s"] = round(cli_s, 3)
        out["cli_startup_s"] = round(startup, 3)
        out["bill_1m_rows_minus_startup_s"] = round(cli_s - startup, 3)
        out["bill_vs_raw_scan_ratio"] = round(out["bill_job_inprocess_s"] / raw, 2)  # type: ignore[operator]
        out["bill_target_met"] = cli_s <= 1.0
    out["load_average_1m"] = round(os.getloadavg()[0], 2)
    out["cpus"] = os.cpu_count()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
