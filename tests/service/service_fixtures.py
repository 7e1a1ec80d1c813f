"""Helpers of the service tests: the tiny job, a service under test with an optional worker thread."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fastapi.testclient import TestClient

from helpers import TINY
from starverse.service.db import Database
from starverse.service.settings import ServiceSettings
from starverse.service.storage import register_platform
from starverse.service.tenants import create_tenant, create_token
from starverse.service.worker import Worker

TINY_JOB: dict[str, Any] = {
    "model": "tiny", "dataset": "corpus",
    "train": {"steps": 6, "seq_len": 16, "global_batch": 2, "micro_batch": 2, "rebalance_every": 0},
    "checkpoint": {"interval_steps": 2, "async_save": False},
    "pool": {"currency": "USD", "offers": [{"accelerator": "cpu", "count": 4, "price_per_hour": 3.6,
                                          "billing_granularity_s": 60}]},
}
"""A job that trains a one-layer llama for a few steps on one CPU rank, priced so the bill is not zero (billed
by the minute: a lease of a fast machine can open and close within one second)."""


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serve_in_thread(app: Any, http: Any) -> Iterator[int]:
    """``app`` served by uvicorn on 127.0.0.1 with the HTTP protocol class ``http`` (its parser, as `starverse
    serve` runs it), in a daemon thread: the bytes a TestClient will not send reach it over a socket. Yields the
    port; stops the server on exit."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_level="critical",
                                           http=http))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@dataclass
class Service:
    """A service under test: its settings, database, HTTP client and (optionally) a worker thread."""

    settings: ServiceSettings
    db: Database
    client: TestClient
    workers: list[Worker] = field(default_factory=list)
    _threads: list[threading.Thread] = field(default_factory=list)

    def tenant(self, name: str, **kw: Any) -> dict[str, str]:
        """A new tenant; returns the headers of a token of it."""
        create_tenant(self.db, self.settings, name, **kw)
        return {"Authorization": f"Bearer {create_token(self.db, name)}"}

    def start_worker(self) -> Worker:
        """A worker polling in a thread of this process (its runners are real processes)."""
        w = Worker(self.settings, Database(self.settings.url))
        w.start()

        def loop() -> None:
            while not w._stop:
                w.poll_once()
                time.sleep(self.settings.poll_s)

        t = threading.Thread(target=loop, daemon=True)
        t.start()
        self.workers.append(w)
        self._threads.append(t)
        return w

    def stop_workers(self) -> None:
        """Stop the worker threads and their runners (SIGTERM: they checkpoint), waiting for them."""
        for w in self.workers:
            w.request_stop()
        for t in self._threads:
            t.join(timeout=30)
        for w in self.workers:
            for r in w.running.values():
                r.proc.terminate()
            for r in w.running.values():
                r.proc.wait(timeout=120)

    def wait(self, headers: dict[str, str], job_id: str, states: tuple[str, ...] = ("succeeded", "failed", "stopped"),
             timeout_s: float = 240) -> dict[str, Any]:
        """Poll the job's status until it is in one of ``states`` (a bounded wait, not a timing assertion)."""
        deadline = time.monotonic() + timeout_s
        while True:
            doc: dict[str, Any] = self.client.get(f"/api/jobs/{job_id}", headers=headers).json()
            if doc["state"] in states:
                return doc
            if time.monotonic() > deadline:
                log = self.client.get(f"/api/jobs/{job_id}/logs", headers=headers).text
                raise AssertionError(f"job {job_id} still {doc['state']} after {timeout_s} s; log:\n{log[-3000:]}")
            time.sleep(0.3)


def make_settings(root: Path, db_url: str, **kw: Any) -> ServiceSettings:
    """Settings of a test service with the platform's tiny model and a small corpus registered."""
    settings = ServiceSettings(root=root, database_url=db_url, poll_s=0.2, cpu_ranks=1, **kw)
    src = root.parent / f"{root.name}-src"
    src.mkdir(parents=True, exist_ok=True)
    (src / "tiny.json").write_text(json.dumps(TINY))
    readme = Path(__file__).resolve().parents[2] / "README.md"
    (src / "corpus.txt").write_text(readme.read_text() * 2)
    register_platform(settings, "models", "tiny", src / "tiny.json")
    register_platform(settings, "datasets", "corpus", src / "corpus.txt")
    return settings


def start_server(root: Path, db_url: str, port: int, slots: int) -> subprocess.Popen[bytes]:
    """``starverse serve`` on 127.0.0.1:port; returns once /api/health answers (bounded)."""
    cmd = [str(Path(sys.executable).parent / "starverse"), "serve", "--root", str(root), "--port", str(port),
           "--slots", str(slots)]
    if db_url:
        cmd += ["--database", db_url]
    log = (root / f"serve-{port}-{time.time():.0f}.log").open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, f"server exited with {proc.returncode}"
        assert time.monotonic() < deadline, "server did not answer within 120 s"
        time.sleep(0.3)
