"""Crash safety: a process writing the ledger is SIGKILLed at random points, many times.

After every kill the ledger must open, pass the integrity check (no overlaps, every closed lease's charges
equal a fresh rating of it: none missing, torn or doubled), hold every operation the writer had seen
committed (its acknowledgement log), and at most one more per kill. Each restart of the writer recovers the
previous run's open leases and retries closing leases already closed, which must charge nothing more.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from starverse.billing import Ledger, check_ledger

T0 = 1_700_000_000
DEVICES = [f"n{i // 4}/gpu{i % 4}" for i in range(8)]
BUDGET_S = 15.0  # wall time of the kill loop
MIN_KILLS = 12


def writer(db: str, acks: str, seed: int) -> None:
    """Write random ledger operations forever, acknowledging each one after it committed."""
    from decimal import Decimal

    from starverse.billing import EventKind, LeasePricing, Ledger, PricingMode

    rng = random.Random(seed)
    out = open(acks, "a", buffering=1)  # noqa: SIM115 - lives until the process is killed
    led = Ledger.open(db)
    job = led.start_job("crash")
    t = max([T0, *(max(le.last_seen_s, le.end_s or 0) for le in led.leases(job))]) + 1
    for le in led.recover(job):
        out.write(f"recovered {le.id}\n")
    for le in led.leases(job)[-5:]:  # a retried close after a crash must charge nothing more
        led.close_lease(le.id)
    Path(acks + f".ready{seed}").touch()
    open_leases: dict[str, int] = {}
    while True:
        t += rng.randint(1, 40)
        op = rng.random()
        free = [d for d in DEVICES if d not in open_leases]
        if op < 0.35 and free:
            dev = rng.choice(free)
            mode = rng.choice([PricingMode.SPOT, PricingMode.ON_DEMAND, PricingMode.HOURLY])
            pricing = LeasePricing(mode, Decimal(rng.randint(1, 400)) / 100, "USD", rng.choice([1, 60]))
            le = led.open_lease(job, dev, "rtx-4090", pricing, at_s=t)
            open_leases[dev] = le.id
            out.write(f"open {le.id} {t}\n")
        elif op < 0.55 and open_leases:
            lease_id = rng.choice(list(open_leases.values()))
            if led.lease(lease_id).mode == PricingMode.SPOT:
                led.set_price(lease_id, Decimal(rng.randint(1, 400)) / 100, at_s=t)
        elif op < 0.85 and open_leases:
            dev = rng.choice(list(open_leases))
            lease_id = open_leases.pop(dev)
            rows = led.close_lease(lease_id, t)
            out.write(f"close {lease_id} {t} {sum(r.ticks for r in rows)}\n")
        elif op < 0.95:
            led.heartbeat(job, at_s=t)
        else:
            kind = rng.choice([EventKind.CHECKPOINT, EventKind.PREEMPTION, EventKind.RESUME])
            led.record_event(job, kind, at_s=t)


def read_acks(path: Path) -> list[list[str]]:
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.split("\n")[:-1]  # a torn last line (no newline yet) is not an acknowledgement
    return [line.split() for line in lines]


@pytest.mark.slow
def test_sigkill_at_random_points_loses_nothing_and_charges_nothing_twice(tmp_path: Path):
    db, acks = tmp_path / "ledger.sqlite", tmp_path / "acks.log"
    rng = random.Random(1234)
    deadline = time.monotonic() + BUDGET_S
    kills = 0
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    while kills < MIN_KILLS or time.monotonic() < deadline:
        proc = subprocess.Popen([sys.executable, __file__, str(db), str(acks), str(kills)], env=env,
                                stderr=subprocess.PIPE)
        # wait until it has recovered and is writing, then let it run a random while
        t_wait = time.monotonic() + 60
        while not Path(f"{acks}.ready{kills}").exists():
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < t_wait, "writer did not start"
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.3))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL
        kills += 1
        verify(db, read_acks(acks), kills)
    with Ledger.open(db) as led:
        led.recover()
        assert led.leases(open_only=True) == []
        assert check_ledger(led).ok
        num_leases = len(led.leases())
    assert kills >= MIN_KILLS and num_leases > 50
    res = subprocess.run([str(Path(sys.executable).with_name("starverse")), "bill", "--db", str(db), "--check"],
                         capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    assert f"{num_leases} leases" in res.stdout


def verify(db: Path, acks: list[list[str]], kills: int) -> None:
    """The ledger after a kill: intact, holding every acknowledged operation, each charged once."""
    opened = {int(a[1]): int(a[2]) for a in acks if a[0] == "open"}
    closed = {int(a[1]): (int(a[2]), int(a[3])) for a in acks if a[0] == "close"}
    with Ledger.open(db) as led:
        res = check_ledger(led)
        assert res.ok, res.problems
        leases = {le.id: le for le in led.leases()}
        for lease_id, start in opened.items():
            assert lease_id in leases, f"acknowledged lease {lease_id} lost"
            assert leases[lease_id].start_s == start
        for lease_id, (end, ticks) in closed.items():
            assert leases[lease_id].end_s == end, f"lease {lease_id} end changed"
            assert sum(r.ticks for r in led.charges(lease_id)) == ticks, f"lease {lease_id} charged twice"
        # each kill can cut off at most one acknowledgement
        assert len(leases) <= len(opened) + kills


if __name__ == "__main__":
    writer(sys.argv[1], sys.argv[2], int(sys.argv[3]))
