"""Fixtures shared by the unit tests."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


CACHE_DIR = Path(tempfile.gettempdir()) / "starverse-test-cache"
"""Where :func:`loso_document` keeps the script's output, under a key of everything it read."""

LOSO_TIMEOUT_S = 600
"""How long a test waits for ``scripts/loso.py`` once it needs the document (counted from the wait)."""
DOCS_TIMEOUT_S = 780
"""How long the docs-tables test waits for ``scripts/make_docs.py --check`` (counted from the wait)."""
BACKGROUND_NICE = 19
"""The CPU priority (``nice``) of the scripts while other tests run: they take only what those leave idle."""


def _loso_key() -> str:
    """A hash of what ``scripts/loso.py``'s output depends on: the script, every file of the package (the cost
    model, the catalog, the fit), the validation cases, the catalog's extra inputs (a probe profile: their
    stamps, ``catalog_version``), and the Python, NumPy and SciPy that ran it."""
    from starverse.catalog.loader import catalog_version

    h = hashlib.sha256(catalog_version().encode())
    files = [REPO / "scripts" / "loso.py"]
    for top in (REPO / "src" / "starverse", REPO / "data" / "validation"):
        files += sorted(p for p in top.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    for p in files:
        h.update(str(p.relative_to(REPO)).encode() + b"\0" + p.read_bytes() + b"\0")
    h.update(sys.version.encode())
    for dist in ("numpy", "scipy"):
        h.update(metadata.version(dist).encode())
    return h.hexdigest()


def _set_nice(pgid: int, nice: int) -> None:
    """Set the CPU priority of every process of group ``pgid`` (a script and its forked pool workers); lowering
    it needs CAP_SYS_NICE: without it the script keeps its priority (it only runs slower under other load)."""
    with contextlib.suppress(PermissionError, ProcessLookupError):
        os.setpriority(os.PRIO_PGRP, pgid, nice)


class SlowScripts:
    """``scripts/loso.py`` (the leave-one-source-out refits, minutes of CPU on 2 cores) and ``scripts/make_docs.py
    --check`` on its output (the planner searches of the docs' tables, ~1 minute more), run one after the other
    in a thread of this session, each as its own process (group).

    Why in the background: the other unit tests run in this one process, one CPU, so on a 2-core machine the
    second core is mostly idle while they run. :meth:`start` (at the first unit test) runs the scripts at the
    lowest CPU priority (:data:`BACKGROUND_NICE`): they take only CPU that the tests leave, and a test's timing
    is not theirs to stretch. The first test that needs a result waits for it (and the tests that need one run
    last: tests/unit/conftest.py's ``pytest_collection_modifyitems``); from then on the scripts run at normal
    priority and the wait is bounded as the inline run was (:data:`LOSO_TIMEOUT_S`, :data:`DOCS_TIMEOUT_S`).
    The scripts, their arguments and the checks on their output are the same as a run in the test itself."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slow-scripts")
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[str] | None = None
        self._urgent = False
        self._closed = False
        self._loso: Future[dict[str, Any]] | None = None
        self._docs: Future[subprocess.CompletedProcess[str]] | None = None
        self._tmp = Path(tempfile.mkdtemp(prefix="starverse-slow-scripts-"))

    def start(self, docs: bool) -> None:
        """Queue the loso refits and (``docs``) the docs check behind them, at background priority."""
        self._loso_future()
        if docs:
            self._docs_future()

    def loso(self) -> dict[str, Any]:
        """``scripts/loso.py``'s document (waits for it: at most :data:`LOSO_TIMEOUT_S` from now)."""
        return self._wait(self._loso_future(), LOSO_TIMEOUT_S, "scripts/loso.py")

    def docs_check(self) -> subprocess.CompletedProcess[str]:
        """``scripts/make_docs.py --check --loso FILE`` on this session's loso document (waits for it)."""
        return self._wait(self._docs_future(), DOCS_TIMEOUT_S, "scripts/make_docs.py --check")

    def close(self) -> None:
        """Stop a script still running (an interrupted session) and drop the queue."""
        with self._lock:
            self._closed = True
            if self._proc is not None and self._proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._proc.pid, signal.SIGKILL)
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _loso_future(self) -> Future[dict[str, Any]]:
        with self._lock:
            if self._loso is None:
                self._loso = self._pool.submit(self._run_loso)
            return self._loso

    def _docs_future(self) -> Future[subprocess.CompletedProcess[str]]:
        loso = self._loso_future()
        with self._lock:
            if self._docs is None:
                self._docs = self._pool.submit(self._run_docs, loso)
            return self._docs

    def _wait(self, fut: Future[Any], timeout_s: float, what: str) -> Any:
        with self._lock:  # a test waits: no longer in the background
            self._urgent = True
            if self._proc is not None:
                _set_nice(self._proc.pid, 0)
        try:
            return fut.result(timeout=timeout_s)
        except FutureTimeout:
            self.close()
            raise AssertionError(f"{what} did not finish within {timeout_s} s of the test asking") from None

    def _run(self, args: list[str]) -> subprocess.CompletedProcess[str]:
        with self._lock:
            if self._closed:
                raise RuntimeError("the session's slow scripts were stopped")
            proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, start_new_session=True)
            # before the script forks its pool workers (after its imports), so they inherit the priority
            if not self._urgent:
                _set_nice(proc.pid, BACKGROUND_NICE)
            self._proc = proc
        out, err = proc.communicate()
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def _run_loso(self) -> dict[str, Any]:
        cached = CACHE_DIR / f"loso-{_loso_key()}.json"
        if cached.is_file():
            doc: dict[str, Any] = json.loads(cached.read_text())
            return doc
        res = self._run([str(REPO / "scripts" / "loso.py")])
        assert res.returncode == 0, res.stderr
        doc = json.loads(res.stdout)
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".{id(doc)}.tmp")  # written whole, then renamed: a reader never sees half of it
        tmp.write_text(res.stdout)
        tmp.replace(cached)
        return doc

    def _run_docs(self, loso: Future[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
        # make_docs runs as its own process: its planner searches fork workers, and a fork of the test process
        # (its threads, the signal handlers earlier tests left) once hung
        path = self._tmp / "loso.json"  # scripts/loso.py's output of this session, not a second refit
        path.write_text(json.dumps(loso.result()))
        return self._run([str(REPO / "scripts" / "make_docs.py"), "--check", "--loso", str(path)])


def _needs(item: pytest.Item, fixture: str) -> bool:
    return fixture in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests that wait for :class:`SlowScripts` run last (in collection order otherwise), so the scripts
    have the whole unit run to use the idle core."""
    items.sort(key=lambda item: _needs(item, "loso_document"))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def slow_scripts() -> Iterator[SlowScripts]:
    """This session's :class:`SlowScripts`."""
    scripts = SlowScripts()
    yield scripts
    scripts.close()


@pytest.fixture(scope="session", autouse=True)
def _start_slow_scripts(request: pytest.FixtureRequest) -> None:
    """At the first unit test: start the scripts in the background if a test of this session needs them. Not
    under pytest-xdist: every worker collects every test, so each would run them (they run when asked there)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    items = request.session.items
    if any(_needs(item, "loso_document") for item in items):
        scripts: SlowScripts = request.getfixturevalue("slow_scripts")
        scripts.start(docs=any(_needs(item, "docs_check") for item in items))


@pytest.fixture(scope="session")
def loso_document(slow_scripts: SlowScripts) -> dict[str, Any]:
    """What ``scripts/loso.py`` prints for the repository's data/validation (run once per session: the
    leave-one-source-out refits take minutes on 2 cores; test_loso checks it, test_docs_tables renders from it).
    A run's output is kept under a hash of every file it read (:func:`_loso_key`): a later session on the same
    files reads it back instead of refitting; any change to the package, the script or the cases refits."""
    return slow_scripts.loso()


@pytest.fixture(scope="session")
def docs_check(slow_scripts: SlowScripts, loso_document: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """``scripts/make_docs.py --check --loso FILE`` (FILE: :func:`loso_document`) as it ran in this session."""
    return slow_scripts.docs_check()
