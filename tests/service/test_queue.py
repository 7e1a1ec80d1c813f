"""The jobs table as a queue: workers racing for the same queued jobs each get a disjoint share (one
conditional UPDATE per claim), and recovery leaves alone a job whose worker is alive. On SQLite and
PostgreSQL; no runner is started (launch is recorded instead)."""

from __future__ import annotations

import threading
from typing import Any

from service_fixtures import TINY_JOB, Service

from starverse.service.db import Database, Job, JobState
from starverse.service.settings import ServiceSettings
from starverse.service.worker import Worker


class RecordingWorker(Worker):
    """A worker whose launches are recorded, not run."""

    def __init__(self, settings: ServiceSettings):
        super().__init__(settings, Database(settings.url))
        self.launched: list[str] = []

    def _launch(self, s: Any, job: Job) -> None:
        self.launched.append(job.id)


def test_racing_workers_claim_each_job_once(service: Service) -> None:
    from dataclasses import replace

    alice = service.tenant("alice")
    ids = {service.client.post("/api/jobs", headers=alice, json={"job": TINY_JOB}).json()["id"] for _ in range(12)}
    settings = replace(service.settings, worker_slots=12)
    workers = [RecordingWorker(settings) for _ in range(4)]
    barrier = threading.Barrier(len(workers))

    def go(w: RecordingWorker) -> None:
        barrier.wait()
        w.claim()

    threads = [threading.Thread(target=go, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    claimed = [jid for w in workers for jid in w.launched]
    assert sorted(claimed) == sorted(ids)  # every job once, none twice
    with service.db.session() as s:
        owners = {j.id: j.worker_id for j in s.query(Job).all()}
        assert {j.state for j in s.query(Job).all()} == {JobState.RUNNING.value}
    for w in workers:
        assert all(owners[jid] == w.id for jid in w.launched)
        w.db.dispose()


def test_recovery_requeues_only_jobs_of_dead_workers(service: Service) -> None:
    alice = service.tenant("alice")
    a = service.client.post("/api/jobs", headers=alice, json={"job": TINY_JOB}).json()["id"]
    b = service.client.post("/api/jobs", headers=alice, json={"job": TINY_JOB}).json()["id"]
    live = RecordingWorker(service.settings)
    live.start()  # holds its lock: alive
    with service.db.session() as s:
        for jid, owner in ((a, live.id), (b, "f" * 32)):  # b's worker never held a lock: dead
            job = s.get(Job, jid)
            assert job is not None
            job.state, job.worker_id = JobState.RUNNING.value, owner
    other = RecordingWorker(service.settings)
    assert other.recover() == 1
    with service.db.session() as s:
        assert s.get(Job, a).state == "running"  # type: ignore[union-attr]
        assert s.get(Job, b).state == "queued"  # type: ignore[union-attr]
    for w in (live, other):
        w.db.dispose()
