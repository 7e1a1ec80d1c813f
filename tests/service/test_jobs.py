"""Jobs through the service with a real worker and real runner processes: progress, checkpoints, stop with an
emergency checkpoint, resume, rollback, the bill; a prepaid balance that runs out stops the job with a
checkpoint. Tiny CPU jobs of a few steps."""

from __future__ import annotations

import json
from decimal import Decimal

import pytest
from service_fixtures import TINY_JOB, Service

from starverse.service.tenants import top_up

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _launches(svc: Service, tenant_dir_job: str) -> list[dict]:
    path = svc.settings.root / tenant_dir_job / "launches.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_job_runs_reports_progress_checkpoints_and_bill_then_stop_resume_rollback(service: Service) -> None:
    alice = service.tenant("alice")
    service.start_worker()
    job = {**TINY_JOB, "train": {**TINY_JOB["train"], "steps": 8}}
    jid = service.client.post("/api/jobs", headers=alice, json={"name": "lifecycle", "job": job}).json()["id"]
    done = service.wait(alice, jid)
    assert done["state"] == "succeeded", service.client.get(f"/api/jobs/{jid}/logs", headers=alice).text
    assert done["last_step"] == 8 and done["launches"] == 1

    prog = service.client.get(f"/api/jobs/{jid}/progress", headers=alice).json()
    steps = [s["step"] for s in prog["samples"]]
    assert steps == sorted(steps) and steps[-1] == 8
    assert all(s["loss"] is not None and s["loss"] > 0 for s in prog["samples"])
    assert any(s["tokens_per_s"] for s in prog["samples"]) and any(s["shares"] == [1.0] for s in prog["samples"])
    kinds = [e["kind"] for e in prog["events"]]
    assert kinds[0] == "queued" and "started" in kinds and kinds[-1] == "succeeded"

    ckpts = service.client.get(f"/api/jobs/{jid}/checkpoints", headers=alice).json()
    assert [c["step"] for c in ckpts][-1] == 8 and {2, 4, 6} & {c["step"] for c in ckpts}
    bill = service.client.get(f"/api/jobs/{jid}/bill", headers=alice).json()
    # billed by the minute (TINY_JOB's pool): any lease of a second or more costs 0.06 USD
    assert bill["job"] == jid and bill["open_leases"] == 0 and bill["leases"]
    assert bill["charge_ticks"] == sum(x["charge_ticks"] for x in bill["leases"])
    assert bill["leases"][0]["price_per_hour"] == "3.6"
    # the tenant's bill by job has exactly this job; the balance went down by its charges
    tb = service.client.get("/api/bill?by=job", headers=alice).json()
    # a lease under one billed second has no charge row, hence no line (a fast machine finishes 8 steps in it)
    assert [line["key"] for line in tb["lines"]] == ([jid] if bill["charge_ticks"] else [])
    assert sum(line["charge_ticks"] for line in tb["lines"]) == bill["charge_ticks"]
    assert Decimal(tb["balance"]["remaining"]) == Decimal("5") - Decimal(bill["net"])
    day = service.client.get("/api/bill?by=day", headers=alice).json()
    assert sum(x["charge_ticks"] for x in day["lines"]) == bill["charge_ticks"]

    # the same progress as server-sent events; the stream ends with the job
    with service.client.stream("GET", f"/api/jobs/{jid}/stream", headers=alice) as r:
        text = "".join(r.iter_text())
    assert r.headers["content-type"].startswith("text/event-stream")
    assert text.index("event: progress") < text.index("event: end") and '"step": 8' in text

    # rollback to an earlier checkpoint: the job runs again from there to the end
    back = min(c["step"] for c in ckpts)
    r = service.client.post(f"/api/jobs/{jid}/rollback", headers=alice, json={"step": back})
    assert r.status_code == 200 and r.json()["state"] == "queued"
    again = service.wait(alice, jid)
    assert again["state"] == "succeeded" and again["launches"] == 2
    starts = [x for x in _launches(service, f"tenants/{_tid(service, alice)}/jobs/{jid}") if x["event"] == "start"]
    assert [x["resume_from"] for x in starts] == [None, back]
    events = service.client.get(f"/api/jobs/{jid}/progress", headers=alice).json()["events"]
    assert any(e["kind"] == "started" and f"rollback to step {back}" in e["detail"] for e in events)


def _tid(svc: Service, headers: dict[str, str]) -> str:
    return str(svc.client.get("/api/whoami", headers=headers).json()["id"])


SQLITE_ONLY = pytest.mark.parametrize("db_url", [""], ids=["sqlite"])
"""Tests whose database paths the PostgreSQL lifecycle and restart tests already cover (they cost minutes)."""


@SQLITE_ONLY
def test_stop_writes_an_emergency_checkpoint_and_resume_continues(service: Service) -> None:
    alice = service.tenant("alice")
    service.start_worker()
    job = {**TINY_JOB, "train": {**TINY_JOB["train"], "steps": 400},
           "checkpoint": {"interval_steps": 1000, "async_save": False}}
    jid = service.client.post("/api/jobs", headers=alice, json={"job": job}).json()["id"]
    service.wait(alice, jid, states=("running",))
    # wait until it has trained a step (bounded), then stop it
    import time

    deadline = time.monotonic() + 240
    while (service.client.get(f"/api/jobs/{jid}", headers=alice).json()["last_step"] or 0) < 2:
        assert time.monotonic() < deadline, "the job never reached step 2"
        time.sleep(0.3)
    assert service.client.post(f"/api/jobs/{jid}/stop", headers=alice).json()["stop_requested"] is True
    stopped = service.wait(alice, jid)
    assert stopped["state"] == "stopped" and "emergency checkpoint" in stopped["stop_reason"]
    assert stopped["exit_code"] == 3
    ckpts = service.client.get(f"/api/jobs/{jid}/checkpoints", headers=alice).json()
    assert ckpts and ckpts[-1]["reason"] == "notice" and ckpts[-1]["step"] >= 2
    # resume: it continues from the emergency checkpoint, then we stop it again (no need to train 400 steps)
    assert service.client.post(f"/api/jobs/{jid}/resume", headers=alice, json={}).json()["state"] == "queued"
    running = service.wait(alice, jid, states=("running",))
    assert running["launches"] == 2
    starts = []
    deadline = time.monotonic() + 240
    while len(starts) < 2:
        assert time.monotonic() < deadline
        starts = [x for x in _launches(service, f"tenants/{_tid(service, alice)}/jobs/{jid}") if x["event"] == "start"]
        time.sleep(0.3)
    events = service.client.get(f"/api/jobs/{jid}/progress", headers=alice).json()["events"]
    assert any("resuming from its latest checkpoint" in e["detail"] for e in events)
    service.client.post(f"/api/jobs/{jid}/stop", headers=alice)
    assert service.wait(alice, jid)["state"] == "stopped"
    with service.db.session() as s:
        from starverse.service.db import Job

        row = s.get(Job, jid)
        assert row is not None and row.fresh_starts == 1


@SQLITE_ONLY
def test_a_drained_balance_stops_the_job_with_a_checkpoint(service: Service) -> None:
    # 36 USD/h per device = 0.01 USD/s; 0.05 USD of credit lasts a few seconds of training
    poor = service.tenant("poor", credit=Decimal("0.05"))
    service.start_worker()
    job = {**TINY_JOB, "train": {**TINY_JOB["train"], "steps": 100000},
           "checkpoint": {"interval_steps": 100000, "async_save": False},
           "pool": {"currency": "USD", "offers": [{"accelerator": "cpu", "count": 4, "price_per_hour": 36}]}}
    jid = service.client.post("/api/jobs", headers=poor, json={"job": job}).json()["id"]
    # at load the ranks can take longer to start than the credit lasts: the job then stops before its first step
    # (nothing to checkpoint: "... before it started training"); a top-up and a resume give it longer
    for top in (Decimal("0.2"), Decimal("1"), None):
        done = service.wait(poor, jid)
        assert done["state"] == "stopped", service.client.get(f"/api/jobs/{jid}/logs", headers=poor).text[-2000:]
        assert "balance exhausted" in done["stop_reason"]
        if "before it started training" not in done["stop_reason"] or top is None:
            break
        top_up(service.db, service.settings, "poor", top)
        assert service.client.post(f"/api/jobs/{jid}/resume", headers=poor, json={}).json()["state"] == "queued"
    assert "before it started training" not in done["stop_reason"], done
    ckpts = service.client.get(f"/api/jobs/{jid}/checkpoints", headers=poor).json()
    assert ckpts, "no checkpoint at the stop"
    assert ckpts[-1]["step"] == done["last_step"]
    bal = service.client.get("/api/balance", headers=poor).json()
    # overshoot bounded by one billing interval of the one device (the ledger's budget guard)
    assert Decimal(bal["remaining"]) > Decimal("-0.05")
    # a stopped tenant with nothing left cannot submit more
    r = service.client.post("/api/jobs", headers=poor, json={"job": TINY_JOB})
    assert r.status_code in (201, 402)
