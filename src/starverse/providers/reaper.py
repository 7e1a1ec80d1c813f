"""A watchdog that kills what a process started once that process is gone (``python -m starverse.providers.reaper PID``).

A private Ray session's daemons are started by the supervisor, and some of them (Ray's dashboard and
runtime-env agents, started by the raylet) do not die with it: a supervisor killed with SIGKILL left them
running under PID 1. The reaper runs in its own session (a ``killpg`` of the supervisor's group does not reach
it), snapshots the supervisor's descendants every ``period_s`` from ``/proc`` (keeping those orphaned since), and
reads its stdin: ``stop`` ends it quietly (the session was shut down normally); end of file without it (the
supervisor died) makes it SIGKILL every process of its snapshots that is still the same process (same start
time), then exit.
Linux only (``/proc``); elsewhere :func:`start_reaper` returns None.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a process, or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()  # after "pid (comm) "
    return int(fields[1]), int(fields[19])


def _same(pid: int, start: int) -> bool:
    """Whether ``pid`` is still the process that started at ``start`` (not gone, not a reused pid)."""
    st = _stat(pid)
    return st is not None and st[1] == start


def descendants(root: int) -> dict[int, int]:
    """Every descendant of ``root`` as pid -> start time."""
    table: dict[int, tuple[int, int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            st = _stat(int(entry.name))
            if st is not None:
                table[int(entry.name)] = st
    out: dict[int, int] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, start) in table.items():
            if ppid == parent and pid not in out:
                out[pid] = start
                frontier.append(pid)
    return out


def watch(root: int, stdin: IO[str], period_s: float = 1.0) -> int:
    """The reaper's loop (see the module docstring); returns how many processes it killed."""
    snapshot: dict[int, int] = {}
    me = os.getpid()
    while True:
        # every process that was ever a descendant and is still that process: one orphaned since (its parent
        # exited, or the supervisor died while /proc was being read, so the tree read was cut short) is kept
        snapshot = {p: s for p, s in snapshot.items() if _same(p, s)}
        snapshot.update({p: s for p, s in descendants(root).items() if p != me})
        ready, _, _ = select.select([stdin], [], [], period_s)
        if not ready:
            continue
        line = stdin.readline()
        if line.strip() == "stop":
            return 0
        if line:
            continue
        killed = 0
        for pid, start in snapshot.items():
            if _same(pid, start):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
        return killed


def start_reaper() -> subprocess.Popen[str] | None:
    """Start a reaper for this process; stop it with :func:`stop_reaper` after a normal shutdown."""
    if not sys.platform.startswith("linux"):
        return None
    return subprocess.Popen([sys.executable, "-m", "starverse.providers.reaper", str(os.getpid())],
                            stdin=subprocess.PIPE, text=True, start_new_session=True)


def stop_reaper(proc: subprocess.Popen[str] | None) -> None:
    """End a reaper quietly (what it watched was shut down normally)."""
    if proc is None or proc.stdin is None:
        return
    with contextlib.suppress(OSError):
        proc.stdin.write("stop\n")
        proc.stdin.close()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5.0)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C to the terminal is for the supervisor
    watch(int(sys.argv[1]), sys.stdin)
