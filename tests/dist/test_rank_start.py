"""How ranks start (providers/local.py): forked from a fork server by default on Linux, ``spawn`` on request.

A forked rank runs with the launcher's environment of the moment (not the server's, frozen when it started),
never outlives a launcher killed with SIGKILL (nor does the server; the ranks do not wait for the server's exit),
and a bad start method is one clear error.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from starverse.elastic.runlock import RunLock
from starverse.errors import ConfigError
from starverse.providers.forkserver_zygote import SERVER_PROCESS_NAME
from starverse.providers.local import (
    RANK_PROCESS_NAME,
    START_METHOD_ENV,
    LocalLauncher,
    rank_context,
    start_method,
)
from starverse.runtime.launch import RankSpec

pytestmark = pytest.mark.slow

LINUX = sys.platform.startswith("linux")


def _ranks(n: int) -> list[RankSpec]:
    return [RankSpec(rank=r, device_kind="cpu", device="cpu", num_threads=1) for r in range(n)]


def _seen(env, names):
    return {n: os.environ.get(n) for n in names}, Path(f"/proc/{os.getpid()}/comm").read_text().strip()


@pytest.mark.skipif(not LINUX, reason="the fork server is the default on Linux only")
def test_a_forked_rank_sees_the_launchers_environment_at_its_start(monkeypatch):
    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    assert start_method() == "forkserver"
    monkeypatch.setenv("SV_TEST_GONE", "before")
    launcher = LocalLauncher()
    names = ("SV_TEST_GONE", "SV_TEST_NEW")
    # the first launch starts the server (if no test did before) with SV_TEST_GONE set
    first = launcher.launch(_seen, _ranks(2), timeout_s=120, args=(names,))
    assert [seen for seen, _ in first] == [{"SV_TEST_GONE": "before", "SV_TEST_NEW": None}] * 2
    assert [comm for _, comm in first] == [RANK_PROCESS_NAME.format(rank=r) for r in range(2)]
    monkeypatch.delenv("SV_TEST_GONE")
    monkeypatch.setenv("SV_TEST_NEW", "after")
    second = launcher.launch(_seen, _ranks(2), timeout_s=120, args=(names,))
    assert [seen for seen, _ in second] == [{"SV_TEST_GONE": None, "SV_TEST_NEW": "after"}] * 2


def _gc_state(env):
    import gc

    return gc.isenabled(), gc.get_freeze_count()


@pytest.mark.skipif(not LINUX, reason="the fork server is the default on Linux only")
def test_a_forked_rank_collects_garbage_and_skips_the_servers_preload(monkeypatch):
    """The server imports its preload with the collector off (forkserver_exit) and turns it on again, freezing the
    preload, before any rank is forked (forkserver_ready): a rank collects, never walking the preload's objects."""
    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    for enabled, frozen in LocalLauncher().launch(_gc_state, _ranks(2), timeout_s=120):
        assert enabled and frozen > 100_000


def test_a_bad_start_method_is_one_clear_error(monkeypatch):
    monkeypatch.setenv(START_METHOD_ENV, "fork")
    with pytest.raises(ConfigError, match=f"{START_METHOD_ENV}='fork': not a start method; to fix: set it to one "
                                          "of forkserver, forkserver-exec, spawn or unset it"):
        rank_context()
    monkeypatch.setenv(START_METHOD_ENV, "spawn")
    assert rank_context().get_start_method() == "spawn"


LAUNCHER = textwrap.dedent("""
    import contextlib, os, sys, time
    from pathlib import Path
    from starverse.elastic.runlock import RunLock
    from starverse.providers.local import LocalLauncher, rank_server
    from starverse.runtime.launch import RankSpec

    def _wait(env, out):
        Path(out, "tmp").joinpath(f"rank{env.rank}").write_text(f"{os.getpid()} {os.getppid()}")
        os.replace(Path(out, "tmp", f"rank{env.rank}"), Path(out, f"rank{env.rank}"))
        time.sleep(600)

    if __name__ == "__main__":
        ranks = [RankSpec(rank=r, device_kind="cpu", device="cpu", num_threads=1) for r in range(2)]
        with contextlib.ExitStack() as job:
            if sys.argv[2] == "job":  # as a job's supervisor runs: the run dir locked, the server forked from here
                job.enter_context(RunLock(Path(sys.argv[1], "run")))
                assert job.enter_context(rank_server()) is not None
            LocalLauncher().launch(_wait, ranks, timeout_s=600, args=(sys.argv[1],))
""")


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE  # a rank of a stopped server stays a zombie: it is dead
    except psutil.NoSuchProcess:
        return False


def _left(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those of ``procs`` still running after up to 30 s."""
    deadline = time.monotonic() + 30
    while (alive := [p for p in procs if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


@pytest.mark.skipif(not LINUX, reason="a rank's death with its parent is Linux's PR_SET_PDEATHSIG")
@pytest.mark.parametrize("method", ["forkserver", "spawn", "job"])
def test_no_rank_outlives_a_launcher_killed_with_sigkill(tmp_path, method):
    """``job``: the server forked from the launcher (``rank_server``), which holds its run dir's lock: neither the
    server nor the ranks keep that lock once the launcher is dead, even while the server cannot exit yet."""
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, START_METHOD_ENV: "forkserver" if method == "job" else method}
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path), method], env=env, cwd=tmp_path)
    server = None
    try:
        deadline = time.monotonic() + 240
        while not all((tmp_path / f"rank{r}").is_file() for r in range(2)):
            assert proc.poll() is None, f"the launcher exited ({proc.returncode}) before its ranks started"
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.1)
        pids = [tuple(int(x) for x in (tmp_path / f"rank{r}").read_text().split()) for r in range(2)]
        parents = {ppid for _, ppid in pids}
        procs = [psutil.Process(pid) for pid, _ in pids]
        if method == "spawn":
            assert parents == {proc.pid}
        else:  # both ranks were forked by the one server, a child of the launcher
            (server,) = parents
            assert server != proc.pid and psutil.Process(server).ppid() == proc.pid
            assert (psutil.Process(server).name() == SERVER_PROCESS_NAME) == (method == "job")
            # a stopped server cannot exit: the ranks' heartbeats must see the launcher gone by themselves
            os.kill(server, signal.SIGSTOP)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        if method == "job":  # the next supervisor of this run dir is not refused while the (stopped) server lives
            RunLock(tmp_path / "run").acquire().release()
        assert _left(procs) == [], "ranks outlived their launcher"
        if server is not None:
            os.kill(server, signal.SIGCONT)
            assert _left([psutil.Process(server)]) == [], "the fork server outlived its launcher"
    finally:
        if proc.poll() is None:
            proc.kill()
        if server is not None:  # never leave a stopped server behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(server, signal.SIGKILL)


def test_the_servers_fast_exit_is_inert_outside_the_server():
    """``forkserver_exit`` ends the server with ``os._exit`` at shutdown; imported anywhere else it must do nothing
    (an ``os._exit`` registered with atexit would skip the process's earlier exit handlers, like this one)."""
    code = ("import atexit, gc; atexit.register(print, 'atexit ran'); import starverse.providers.forkserver_exit; "
            "import starverse.providers.forkserver_ready; print(gc.isenabled(), gc.get_freeze_count())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout) == (0, "True 0\natexit ran\n"), out.stderr


_EARLY = '''
import sys
from starverse.providers.local import LocalLauncher, start_rank_server
from starverse.runtime.launch import RankSpec

MODULE = "transformers.models.llama.modeling_llama"


def seen(env):
    return MODULE in sys.modules


if __name__ == "__main__":
    assert start_rank_server([MODULE])
    assert "transformers" not in sys.modules  # this process never imported it
    ranks = [RankSpec(rank=r, device_kind="cpu", device="cpu", num_threads=1) for r in range(2)]
    print(LocalLauncher().launch(seen, ranks, timeout_s=120))
'''


@pytest.mark.skipif(not LINUX, reason="the fork server is the default on Linux only")
def test_a_server_started_early_preloads_the_modules_it_is_given(tmp_path, monkeypatch):
    """``start_rank_server`` (what a job does once checked, before its model is built) starts the server with the
    given modules in its preload: the ranks have them although the launcher had not imported them."""
    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    script = tmp_path / "early.py"
    script.write_text(_EARLY)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    assert (out.returncode, out.stdout) == (0, "[True, True]\n"), out.stderr[-3000:]
