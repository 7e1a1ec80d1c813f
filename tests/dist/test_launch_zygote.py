"""A job's fork server forked from the launcher (providers/forkserver_zygote.py, ``rank_server``).

The server is a copy of the launcher, made to look like a freshly exec'd server: it holds none of the launcher's
files, locks or sockets, runs none of its signal handlers or exit handlers, prints none of its buffered output
again; its ranks see the launcher's environment of the moment, configure logging themselves and skip the copied
objects in their collections. A launcher running threads gets the exec'd server instead, and so does one that asks
for it. (Killed launchers: ``test_rank_start.test_no_rank_outlives_a_launcher_killed_with_sigkill[job]``.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from starverse.providers.local import START_METHOD_ENV

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux fork server")]

_JOB = textwrap.dedent('''
    import atexit, json, logging, os, signal, socket, sqlite3, sys, time
    from pathlib import Path
    from starverse.elastic.runlock import RunLock
    from starverse.providers.local import LocalLauncher, rank_server
    from starverse.runtime.launch import RankSpec


    def seen(env):
        import gc
        root = logging.getLogger()
        return {"ppid": os.getppid(), "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
                "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
                "gc": [gc.isenabled(), gc.get_freeze_count()], "late": os.environ.get("SV_LATE"),
                "root": [type(h).__name__ for h in root.handlers], "level": root.level}


    if __name__ == "__main__":
        out = Path(sys.argv[1])
        atexit.register(print, "atexit ran")
        signal.signal(signal.SIGTERM, lambda *_: print("supervisor's handler ran"))
        signal.signal(signal.SIGINT, lambda *_: None)
        logging.basicConfig(filename=out / "launcher.log", level=logging.INFO)
        db = sqlite3.connect(out / "ledger.sqlite")
        db.execute("create table t (x)")
        tcp = socket.create_server(("127.0.0.1", 0))
        ranks = [RankSpec(rank=r, device_kind="cpu", device="cpu", num_threads=1) for r in range(2)]
        with RunLock(out / "run"):
            print("once", end="")  # buffered (stdout is a pipe): written by this process only
            with rank_server() as pid:
                os.environ["SV_LATE"] = "set after the fork"
                ranks_saw = LocalLauncher().launch(seen, ranks, timeout_s=120)
                # read once it served: between the fork and its first request it may not have got rid of them yet
                fds = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
                holder = os.fork()  # a child that holds a copy of the server's alive pipe: the stop must not wait
                if holder == 0:
                    time.sleep(120)
                    os._exit(0)
                t0 = time.monotonic()
            stop_s = time.monotonic() - t0
            os.kill(holder, signal.SIGKILL)
            os.waitpid(holder, 0)
        print()
        print(json.dumps({"pid": pid, "fds": fds, "ranks": ranks_saw, "reaped": not Path(f"/proc/{pid}").exists(),
                          "tcp": f"socket:[{os.fstat(tcp.fileno()).st_ino}]", "stop_s": stop_s}))
''')


def _run(tmp_path, script: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "job.py"
    path.write_text(script)
    return subprocess.run([sys.executable, str(path), str(tmp_path)], cwd=tmp_path, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=240)


def test_the_forked_server_keeps_nothing_of_the_launcher_but_what_ranks_need(tmp_path):
    out = _run(tmp_path, _JOB, {START_METHOD_ENV: "forkserver"})
    assert out.returncode == 0, out.stderr[-3000:]
    first, second, third = out.stdout.splitlines()
    assert (first, third) == ("once", "atexit ran"), out.stdout  # neither printed again by the server or a rank
    res = json.loads(second)
    # no file, lock or socket of the launcher is open in the server: a dead launcher's run dir is free at once
    held = {str(tmp_path / "run" / "supervisor.lock"), str(tmp_path / "ledger.sqlite"), str(tmp_path / "launcher.log"),
            res["tcp"]}
    assert held.isdisjoint(res["fds"]), res["fds"]
    # the rest: stdio, the listener, the alive pipe, the server loop's own signal pipe and selector
    assert all(fd == "/dev/null" or fd.startswith(("pipe:", "socket:", "anon_inode:[eventpoll]")) for fd in res["fds"])
    for rank in res["ranks"]:
        assert rank["ppid"] == res["pid"]
        assert rank["sigterm"] and rank["sigint"]  # the supervisor's handlers are gone
        assert rank["late"] == "set after the fork"  # the launcher's environment at the rank's start
        assert rank["root"] == ["StreamHandler"] and rank["level"] == 30  # its own basicConfig, not the launcher's
        assert rank["gc"][0] and rank["gc"][1] > 100_000  # collects, never walking the copied objects
    assert res["reaped"] and res["stop_s"] < 60  # stopped and reaped at the end of the job it was forked for
    assert "supervisor's handler ran" not in out.stdout


_THREADED = textwrap.dedent('''
    import logging, sys, threading
    from starverse.providers import forkserver_zygote
    from starverse.providers.local import LocalLauncher, rank_server
    from starverse.runtime.launch import RankSpec


    def pid(env):
        import os
        return os.getppid()


    if __name__ == "__main__":
        logging.basicConfig(level=logging.DEBUG, stream=sys.stdout, format="%(name)s: %(message)s")
        stop = threading.Event()
        worker = threading.Thread(target=stop.wait)
        worker.start()
        ranks = [RankSpec(rank=r, device_kind="cpu", device="cpu", num_threads=1) for r in range(2)]
        try:
            with rank_server() as forked:
                parents = LocalLauncher().launch(pid, ranks, timeout_s=120)
        finally:
            stop.set()
        worker.join()
        print("forked", forked, "parents", len(set(parents)), forkserver_zygote.fork_refusal())
''')


@pytest.mark.parametrize("method", ["forkserver", "forkserver-exec"])
def test_a_launcher_with_threads_or_asking_for_it_gets_the_execd_server(tmp_path, method):
    out = _run(tmp_path, _THREADED, {START_METHOD_ENV: method})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[-1] == "forked None parents 1 None", out.stdout  # one (exec'd) server; no thread left at the end
    refused = ("starverse.providers.forkserver_zygote: fork server: not forked from this process (2 Python threads "
               "run); starting a fresh interpreter")
    assert (refused in lines) == (method == "forkserver"), out.stdout


_NATIVE = textwrap.dedent('''
    import os
    import numpy
    import torch
    from starverse.providers.forkserver_zygote import fork_refusal

    numpy.ones((300, 300)) @ numpy.ones((300, 300))  # OpenBLAS's pool runs (on more than one core)
    print(fork_refusal(), len(os.listdir("/proc/self/task")))  # shut down: the process may fork
    torch.set_num_threads(2)
    torch.ones(256, 256) @ torch.ones(256, 256)  # torch's OpenMP pool: refused
    print(fork_refusal())
''')


def test_a_native_thread_pool_refuses_the_fork_but_openblas_is_shut_down_first(tmp_path):
    out = _run(tmp_path, _NATIVE, {})
    assert out.returncode == 0, out.stderr[-3000:]
    shut_down, refused = out.stdout.splitlines()
    assert shut_down == "None 1", out.stdout
    threads, _, why = refused.partition(" ")
    assert int(threads) > 1 and why == "threads run (native ones: a thread pool or a library's own thread)", out.stdout
