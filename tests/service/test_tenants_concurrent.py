"""Twenty tenants at once: they submit concurrently, their jobs run side by side, and while and after they
run each tenant's jobs list, bills (by job and by day) and balance show its own job only, to the tick."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal

import pytest
from service_fixtures import TINY_JOB, Service

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
N = 20


# SQLite: the PostgreSQL variants of the claim and isolation paths run in the other service tests
@pytest.mark.parametrize("db_url", [""], ids=["sqlite"])
def test_twenty_concurrent_tenants_bills_never_mix(make_service) -> None:  # type: ignore[no-untyped-def]
    svc: Service = make_service(worker_slots=4)
    names = [f"t{i:02d}" for i in range(N)]
    headers = {n: svc.tenant(n) for n in names}
    job = {**TINY_JOB, "train": {**TINY_JOB["train"], "steps": 2}, "checkpoint": {"interval_steps": 2}}

    def submit(n: str) -> str:
        r = svc.client.post("/api/jobs", headers=headers[n], json={"name": f"job-of-{n}", "job": job})
        assert r.status_code == 201, r.text
        return str(r.json()["id"])

    with ThreadPoolExecutor(max_workers=N) as pool:
        ids = dict(zip(names, pool.map(submit, names), strict=True))
    assert len(set(ids.values())) == N
    svc.start_worker()
    seen_foreign: list[str] = []
    done = threading.Event()

    def watch(n: str) -> None:
        # while jobs run: a tenant's views never show another tenant's job
        while not done.is_set():
            mine = {j["id"] for j in svc.client.get("/api/jobs", headers=headers[n]).json()}
            keys = {x["key"] for x in svc.client.get("/api/bill?by=job", headers=headers[n]).json()["lines"]}
            if mine != {ids[n]} or not keys <= {ids[n]}:
                seen_foreign.append(f"{n}: jobs {mine}, bill {keys}")
            done.wait(0.5)

    watchers = [threading.Thread(target=watch, args=(n,)) for n in names[:5]]
    for t in watchers:
        t.start()
    try:
        finals = {n: svc.wait(headers[n], ids[n], timeout_s=1100) for n in names}
    finally:
        done.set()
        for t in watchers:
            t.join()
    assert not seen_foreign, seen_foreign[:3]
    assert {f["state"] for f in finals.values()} == {"succeeded"}

    grand = 0
    for n in names:
        h, jid = headers[n], ids[n]
        job_bill = svc.client.get(f"/api/jobs/{jid}/bill", headers=h).json()
        assert job_bill["job"] == jid and job_bill["charge_ticks"] > 0
        by_job = svc.client.get("/api/bill?by=job", headers=h).json()
        assert [(x["key"], x["charge_ticks"]) for x in by_job["lines"]] == [(jid, job_bill["charge_ticks"])]
        by_day = svc.client.get("/api/bill?by=day", headers=h).json()
        assert sum(x["charge_ticks"] for x in by_day["lines"]) == job_bill["charge_ticks"]
        bal = by_job["balance"]
        assert Decimal(bal["remaining"]) == Decimal("5") - Decimal(job_bill["net"])
        grand += job_bill["charge_ticks"]
    # every tick billed belongs to exactly one tenant: the tenants' bills add up to all the jobs' ledgers
    from starverse.billing import Ledger

    total = 0
    for path in svc.settings.tenants_dir.glob("*/jobs/*/run/ledger.sqlite"):
        with Ledger.open(path, create=False) as ledger:
            total += sum(ledger.spent_ticks(j) for j in ledger.jobs())
    assert total == grand
