"""``scripts/loso.py`` (the leave-one-source-out refits, minutes of CPU on 2 cores) and ``scripts/make_docs.py
--check`` on its output (the planner searches of the docs' tables, ~1 minute more), started in the background
when the test session starts, for the two tests that check them (tests/unit/test_loso.py and
tests/unit/test_docs_tables.py).

Who runs them: the process that starts the session (tests/conftest.py's ``pytest_sessionstart``): pytest itself,
or pytest-xdist's controller, which runs no test. They run one after the other, each as its own process (group),
at the lowest CPU priority (:data:`BACKGROUND_NICE`): they take only CPU the tests leave idle, and no test's timing
is theirs to stretch. Each result is written whole into a file of one folder, named to the tests by the
environment (:data:`FOLDER_ENV`), which xdist's workers inherit: a test that needs one waits for its file
(:func:`wait_for`), at most :data:`LOSO_TIMEOUT_S` / :data:`DOCS_TIMEOUT_S`, and from then on the scripts run at
normal priority. A session that was not started so (the folder not set) runs them where the test asks. The
scripts, their arguments and the checks on their output are the same as a run in the test itself.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

FOLDER_ENV = "STARVERSE_TEST_SLOW_SCRIPTS"
"""The environment variable naming the folder of this session's results."""
CACHE_DIR = Path(tempfile.gettempdir()) / "starverse-test-cache"
"""Where ``scripts/loso.py``'s output is kept, under a key of everything it read (:func:`loso_key`)."""
LOSO_TIMEOUT_S = 600
"""How long a test waits for ``scripts/loso.py`` once it needs the document (counted from the wait)."""
DOCS_TIMEOUT_S = 780
"""How long the docs-tables test waits for ``scripts/make_docs.py --check`` (counted from the wait)."""
BACKGROUND_NICE = 19
"""The CPU priority (``nice``) of the scripts while no test waits for them."""
CHECKS = {"loso": REPO / "tests" / "unit" / "test_loso.py", "docs": REPO / "tests" / "unit" / "test_docs_tables.py"}
"""The test files that need each result."""


def loso_key() -> str:
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


def wanted(args: list[str], rootdir: Path) -> set[str]:
    """The results a session on ``args`` (pytest's positional arguments, ``testpaths`` when none) may need: those
    whose test file is one of the paths asked for or lies under one (``-k`` / ``-m`` are not read: a result
    no test asks for costs only idle CPU, and is stopped at the session's end)."""
    paths = [(rootdir / a.split("::", 1)[0]).resolve() for a in args]
    return {name for name, test in CHECKS.items() if any(p == test or p in test.parents for p in paths)}


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # whole, then renamed: a reader never sees half
    tmp.write_text(text)
    tmp.replace(path)


def _set_nice(pgid: int, nice: int) -> None:
    """Set the CPU priority of every process of group ``pgid`` (a script and its forked pool workers); raising
    it again needs CAP_SYS_NICE: without it the script keeps its priority (it only runs slower under load)."""
    with contextlib.suppress(PermissionError, ProcessLookupError):
        os.setpriority(os.PRIO_PGRP, pgid, nice)


class SlowScripts:
    """The scripts of one session, run in a thread of the process that started it; results in ``folder``:
    ``loso.json`` (the document), ``docs.json`` (the check's return code and output), or ``NAME.error``."""

    def __init__(self, folder: Path, names: set[str]) -> None:
        self.folder = folder
        self._names = names
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[str] | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._main, name="slow-scripts", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop a script still running (a session that ends or is interrupted first)."""
        with self._lock:
            self._closed = True
            if self._proc is not None and self._proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._proc.pid, signal.SIGKILL)
        self._thread.join(timeout=30)
        shutil.rmtree(self.folder, ignore_errors=True)

    def _main(self) -> None:
        try:
            doc = self._loso()
        except Exception as e:
            _write(self.folder / "loso.error", f"scripts/loso.py: {e}")
            _write(self.folder / "docs.error", "scripts/make_docs.py --check: not run, scripts/loso.py failed")
            return
        _write(self.folder / "loso.json", json.dumps(doc))
        if "docs" not in self._names:
            return
        try:
            res = self._run([str(REPO / "scripts" / "make_docs.py"), "--check", "--loso",
                             str(self.folder / "loso.json")])
        except Exception as e:
            _write(self.folder / "docs.error", f"scripts/make_docs.py --check: {e}")
            return
        _write(self.folder / "docs.json", json.dumps({"returncode": res.returncode, "stdout": res.stdout,
                                                      "stderr": res.stderr}))

    def _loso(self) -> dict[str, Any]:
        cached = CACHE_DIR / f"loso-{loso_key()}.json"
        if cached.is_file():
            doc: dict[str, Any] = json.loads(cached.read_text())
            return doc
        res = self._run([str(REPO / "scripts" / "loso.py")])
        if res.returncode != 0:
            raise RuntimeError(f"exit {res.returncode}: {res.stderr[-4000:]}")
        doc = json.loads(res.stdout)
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        _write(cached, res.stdout)
        return doc

    def _run(self, args: list[str]) -> subprocess.CompletedProcess[str]:
        # make_docs runs as its own process: its planner searches fork workers, and a fork of a test process
        # (its threads, the signal handlers earlier tests left) once hung
        with self._lock:
            if self._closed:
                raise RuntimeError("the session's slow scripts were stopped")
            proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, start_new_session=True)
            # before the script forks its pool workers (after its imports), so they inherit the priority
            if not (self.folder / "urgent").exists():
                _set_nice(proc.pid, BACKGROUND_NICE)
            self._proc = proc
            _write(self.folder / "pgid", str(proc.pid))
        out, err = proc.communicate()
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def start(names: set[str]) -> SlowScripts:
    """Start the scripts for ``names`` in a new folder, named in :data:`FOLDER_ENV` for this process's children."""
    folder = Path(tempfile.mkdtemp(prefix="starverse-slow-scripts-"))
    os.environ[FOLDER_ENV] = str(folder)
    scripts = SlowScripts(folder, names)
    scripts.start()
    atexit.register(scripts.close)  # a session that ends first stops them (close twice is harmless)
    return scripts


def wait_for(name: str) -> Any:
    """This session's result ``name`` (``loso``: the document; ``docs``: the check's ``CompletedProcess``),
    waiting for it at normal priority; started here if the session did not start it."""
    folder_s = os.environ.get(FOLDER_ENV)
    if folder_s is None:
        start({"loso", "docs"} if name == "docs" else {"loso"})
        folder_s = os.environ[FOLDER_ENV]
    folder = Path(folder_s)
    (folder / "urgent").touch()  # a test waits: no longer in the background
    with contextlib.suppress(FileNotFoundError, ValueError):
        _set_nice(int((folder / "pgid").read_text()), 0)
    timeout_s = LOSO_TIMEOUT_S if name == "loso" else DOCS_TIMEOUT_S
    what = "scripts/loso.py" if name == "loso" else "scripts/make_docs.py --check"
    deadline = time.monotonic() + timeout_s
    while not (folder / f"{name}.json").is_file():
        if (folder / f"{name}.error").is_file():
            raise AssertionError((folder / f"{name}.error").read_text())
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not finish within {timeout_s} s of the test asking")
        with contextlib.suppress(FileNotFoundError, ValueError):  # the next script's group, once it starts
            _set_nice(int((folder / "pgid").read_text()), 0)
        time.sleep(0.5)
    doc = json.loads((folder / f"{name}.json").read_text())
    if name == "loso":
        return doc
    return subprocess.CompletedProcess(["scripts/make_docs.py", "--check"], doc["returncode"], doc["stdout"],
                                       doc["stderr"])
