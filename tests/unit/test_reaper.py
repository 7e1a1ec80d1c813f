"""The reaper kills what a SIGKILLed process started (and nothing after a normal stop)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reaper reads /proc")

PARENT = """
import subprocess, sys, time
from starverse.providers.reaper import start_reaper, stop_reaper
reaper = start_reaper()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
print(child.pid, reaper.pid, flush=True)
if sys.argv[1] == "stop":
    time.sleep(1.5)
    child.kill()
    stop_reaper(reaper)
    print("stopped", flush=True)
time.sleep(300)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1][0] != "Z"


def _until(cond, timeout_s: float = 30.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.1)
    return False


def test_a_killed_parent_takes_its_descendants_along():
    parent = subprocess.Popen([sys.executable, "-c", PARENT, "kill"], stdout=subprocess.PIPE, text=True)
    child, reaper = map(int, parent.stdout.readline().split())
    time.sleep(1.5)  # at least one snapshot of the parent's tree
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    # the child left the parent's session (a killpg would miss it) and was reparented: only the reaper sees it
    assert _until(lambda: not _alive(child)), "the reaper did not kill the orphan"
    assert _until(lambda: not _alive(reaper))


def test_a_stopped_reaper_kills_nothing():
    parent = subprocess.Popen([sys.executable, "-c", PARENT, "stop"], stdout=subprocess.PIPE, text=True)
    try:
        _, reaper = map(int, parent.stdout.readline().split())
        assert parent.stdout.readline().strip() == "stopped"
        assert _until(lambda: not _alive(reaper))
        assert parent.poll() is None  # the reaper never touched its (living) parent
    finally:
        parent.kill()
        parent.wait()
