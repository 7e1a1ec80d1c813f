"""The server is SIGKILLed while jobs run and wait, then started again: nothing is lost, nothing runs twice.

A real ``starverse serve`` process (uvicorn + its worker process + runner processes): the kill takes the
server down at once; its worker gets SIGTERM from the kernel (parent-death signal) and has the runners
write emergency checkpoints. The restarted server's worker requeues the running jobs once their old
runners are gone and resumes them from their latest checkpoint; the queued one runs once.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from service_fixtures import TINY_JOB, free_port, make_settings, start_server

from starverse.service.db import Database, Job, JobEvent, migrate
from starverse.service.tenants import create_tenant, create_token

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def launches(folder: Path) -> list[dict]:
    path = folder / "launches.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


# SQLite: on PostgreSQL the claim and recovery statements are covered by test_queue.py (racing workers,
# recovery of dead workers' jobs) and a whole job by test_jobs.py; this test costs minutes of CPU
@pytest.mark.parametrize("db_url", [""], ids=["sqlite"])
def test_sigkill_and_restart_loses_nothing_and_runs_nothing_twice(tmp_path: Path, db_url: str) -> None:
    settings = make_settings(tmp_path / "root", db_url)
    migrate(settings.url)
    db = Database(settings.url)
    tenant = create_tenant(db, settings, "alice")
    headers = {"Authorization": f"Bearer {create_token(db, 'alice')}"}
    port = free_port()
    server = start_server(settings.root, db_url, port, slots=2)
    base = f"http://127.0.0.1:{port}"
    job = {**TINY_JOB, "train": {**TINY_JOB["train"], "steps": 24}, "checkpoint": {"interval_steps": 3}}
    ids = [httpx.post(f"{base}/api/jobs", headers=headers, json={"name": f"j{i}", "job": job}, timeout=30)
           .json()["id"] for i in range(3)]
    try:
        # two run (two slots), one waits; kill once the running ones have a checkpoint (bounded wait)
        deadline = time.monotonic() + 300
        while True:
            rows = [httpx.get(f"{base}/api/jobs/{i}", headers=headers, timeout=30).json() for i in ids]
            running = [r for r in rows if r["state"] == "running" and (r["last_step"] or 0) >= 4]
            if len(running) == 2:
                break
            assert time.monotonic() < deadline, rows
            time.sleep(0.3)
        assert sum(r["state"] == "queued" for r in rows) == 1
        os.kill(server.pid, signal.SIGKILL)
        server.wait()
        server = start_server(settings.root, db_url, port, slots=2)
        deadline = time.monotonic() + 400
        while True:
            rows = [httpx.get(f"{base}/api/jobs/{i}", headers=headers, timeout=30).json() for i in ids]
            if all(r["state"] not in ("queued", "running") for r in rows):
                break
            assert time.monotonic() < deadline, rows
            time.sleep(0.5)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=120)
    assert [r["state"] for r in rows] == ["succeeded"] * 3, rows
    assert all(r["last_step"] == 24 for r in rows)
    with db.session() as s:
        for jid in ids:
            row = s.get(Job, jid)
            assert row is not None and row.fresh_starts == 1, (jid, row.fresh_starts if row else None)
            folder = settings.tenant_dir(tenant.id) / "jobs" / jid
            runs = launches(folder)
            starts = [x for x in runs if x["event"] == "start"]
            ends = [x for x in runs if x["event"] == "end"]
            # launches never overlap: each start comes after the previous launch's end
            for a, b in zip(ends, starts[1:], strict=False):
                assert b["at"] >= a["at"]
            kinds = [e.kind for e in s.query(JobEvent).filter(JobEvent.job_id == jid).order_by(JobEvent.id)]
            if row.launches > 1:
                assert "recovered" in kinds
        relaunched = [jid for jid in ids if s.get(Job, jid).launches > 1]  # type: ignore[union-attr]
    assert len(relaunched) == 2  # the two that were running; the queued one ran once
    db.dispose()
