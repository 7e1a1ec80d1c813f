"""Twenty tenants at once against a real ``starverse serve``: they submit concurrently, their jobs run side
by side, and while and after they run each tenant's jobs list, bills (by job and by day) and balance show
its own job only, to the tick.

Twenty is issue 12's number, kept. What the test costs is mostly process start-ups (each job is a runner process
and its rank process, each importing torch: ~4 s of CPU apiece), not its 2 training steps; status is asked only of
the jobs still active, so the polling takes no CPU from them."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
from service_fixtures import TINY_JOB, free_port, make_settings, start_server

from starverse.service.db import Database, migrate
from starverse.service.tenants import create_tenant, create_token

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
N = 20


# SQLite: the PostgreSQL variants of the claim and isolation paths run in the other service tests
@pytest.mark.parametrize("db_url", [""], ids=["sqlite"])
def test_twenty_concurrent_tenants_bills_never_mix(tmp_path: Path, db_url: str) -> None:
    settings = make_settings(tmp_path / "root", db_url)
    migrate(settings.url)
    db = Database(settings.url)
    names = [f"t{i:02d}" for i in range(N)]
    headers = {}
    for n in names:
        create_tenant(db, settings, n)
        headers[n] = {"Authorization": f"Bearer {create_token(db, n)}"}
    db.dispose()
    port = free_port()
    server = start_server(settings.root, db_url, port, slots=4)
    base = f"http://127.0.0.1:{port}"
    job = {**TINY_JOB, "train": {**TINY_JOB["train"], "steps": 2}, "checkpoint": {"interval_steps": 2}}
    seen_foreign: list[str] = []
    done = threading.Event()
    try:
        def submit(n: str) -> str:
            r = httpx.post(f"{base}/api/jobs", headers=headers[n], json={"name": f"job-of-{n}", "job": job},
                           timeout=120)
            assert r.status_code == 201, r.text
            return str(r.json()["id"])

        with ThreadPoolExecutor(max_workers=N) as pool:
            ids = dict(zip(names, pool.map(submit, names), strict=True))
        assert len(set(ids.values())) == N

        def watch(n: str) -> None:
            # while jobs run: a tenant's views never show another tenant's job
            with httpx.Client(base_url=base, headers=headers[n], timeout=120) as c:
                while not done.is_set():
                    mine = {j["id"] for j in c.get("/api/jobs").json()}
                    keys = {x["key"] for x in c.get("/api/bill?by=job").json()["lines"]}
                    if mine != {ids[n]} or not keys <= {ids[n]}:
                        seen_foreign.append(f"{n}: jobs {mine}, bill {keys}")
                    done.wait(1.0)

        watchers = [threading.Thread(target=watch, args=(n,), daemon=True) for n in names[:5]]
        for t in watchers:
            t.start()
        # only the jobs still queued or running are asked again: twenty status requests a second would take
        # CPU from the jobs on a 2-core machine (a job in a final state never leaves it)
        deadline = time.monotonic() + 1300
        states: dict[str, str] = {}
        while True:
            for n in names:
                if states.get(n) in (None, "queued", "running"):
                    states[n] = httpx.get(f"{base}/api/jobs/{ids[n]}", headers=headers[n], timeout=120).json()["state"]
            if all(s not in ("queued", "running") for s in states.values()):
                break
            assert time.monotonic() < deadline, states
            time.sleep(1.0)
        done.set()
        for t in watchers:
            t.join(timeout=130)
        assert not seen_foreign, seen_foreign[:3]
        assert set(states.values()) == {"succeeded"}, states

        grand = 0
        for n in names:
            with httpx.Client(base_url=base, headers=headers[n], timeout=120) as c:
                jid = ids[n]
                job_bill = c.get(f"/api/jobs/{jid}/bill").json()
                # a lease of a fast machine can open and close within one second (0 ticks): the check is that
                # the job has its own closed lease and that only its ticks are on its tenant's bill
                assert job_bill["job"] == jid and job_bill["leases"] and job_bill["open_leases"] == 0
                by_job = c.get("/api/bill?by=job").json()
                assert {x["key"] for x in by_job["lines"]} <= {jid}
                assert sum(x["charge_ticks"] for x in by_job["lines"]) == job_bill["charge_ticks"]
                by_day = c.get("/api/bill?by=day").json()
                assert sum(x["charge_ticks"] for x in by_day["lines"]) == job_bill["charge_ticks"]
                assert Decimal(by_job["balance"]["remaining"]) == Decimal("5") - Decimal(job_bill["net"])
                grand += job_bill["charge_ticks"]
    finally:
        done.set()
        server.terminate()
        server.wait(timeout=180)
    # every tick billed belongs to exactly one tenant: the tenants' bills add up to all the jobs' ledgers
    from starverse.billing import Ledger

    total = 0
    for path in settings.tenants_dir.glob("*/jobs/*/run/ledger.sqlite"):
        with Ledger.open(path, create=False) as ledger:
            total += sum(ledger.spent_ticks(j) for j in ledger.jobs())
    assert total == grand
