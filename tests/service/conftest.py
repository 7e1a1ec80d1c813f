"""Fixtures of the service tests: a service over SQLite and over a real PostgreSQL server started here.

The PostgreSQL server is started once per session with Debian's ``initdb``/``pg_ctl`` in a temporary
directory, listening on 127.0.0.1 only (as the ``postgres`` user when the tests run as root, which
PostgreSQL refuses); each test gets its own database. Without PostgreSQL installed the PostgreSQL variants
are skipped with the reason, except on CI (``CI=true``), where they must run.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from service_fixtures import Service, free_port, make_settings

from starverse.service.app import create_app


def _pg_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    hits = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return hits[-1] if hits else None


def _missing(what: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{what} is missing on CI; .ci/run installs it (apt-get install -y postgresql)")
    pytest.skip(f"{what} not installed (apt-get install postgresql); the PostgreSQL variants run on CI")


@pytest.fixture(scope="session")
def pg_server() -> Iterator[str]:
    """A PostgreSQL server on 127.0.0.1 in a temporary directory; yields its base URL."""
    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    if not initdb or not pg_ctl:
        _missing("PostgreSQL (initdb, pg_ctl)")
    base = Path(tempfile.mkdtemp(prefix="starverse-pg-"))
    prefix: list[str] = []
    if os.geteuid() == 0:  # postgres refuses to run as root
        if shutil.which("runuser") is None:
            _missing("runuser")
        shutil.chown(base, "postgres", "postgres")
        prefix = ["runuser", "-u", "postgres", "--"]
    port = free_port()
    data = base / "data"
    subprocess.run([*prefix, initdb, "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8"],
                   check=True, capture_output=True)
    opts = f"-p {port} -k {base} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
    subprocess.run([*prefix, pg_ctl, "-D", str(data), "-o", opts, "-l", str(base / "log"), "-w", "start"],
                   check=True, capture_output=True)
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}"
    finally:
        subprocess.run([*prefix, pg_ctl, "-D", str(data), "-m", "immediate", "stop"], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


def new_pg_database(base_url: str) -> str:
    """A fresh database on the test server; returns its URL."""
    import psycopg

    name = "t_" + uuid.uuid4().hex[:12]
    with psycopg.connect(base_url + "/postgres", autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return f"{base_url}/{name}"


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest) -> str:
    """The database of a test: SQLite in the service root (empty URL), or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return ""
    return new_pg_database(request.getfixturevalue("pg_server"))


@pytest.fixture
def make_service(tmp_path: Path, db_url: str) -> Iterator[Callable[..., Service]]:
    """A factory of services over the test's database (keyword arguments go to ServiceSettings)."""
    made: list[Service] = []

    def make(**kw: Any) -> Service:
        settings = make_settings(tmp_path / f"root{len(made)}", db_url, **kw)
        app = create_app(settings)
        svc = Service(settings, app.state.ctx.db, TestClient(app))
        made.append(svc)
        return svc

    yield make
    for svc in made:
        svc.stop_workers()
        svc.client.close()
        svc.client.app.state.ctx.close()  # type: ignore[attr-defined]


@pytest.fixture
def service(make_service: Callable[..., Service]) -> Service:
    """A service with default settings (no worker running)."""
    return make_service()
