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

ORPHANING = """
import subprocess, sys, time
from starverse.providers.reaper import start_reaper
reaper = start_reaper()
sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])  # the tree is never empty
# a child that starts a grandchild and exits: the grandchild is orphaned (reparented away from this tree)
child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; g = subprocess.Popen([sys.executable, "
                          "'-c', 'import time; time.sleep(300)']); print(g.pid, flush=True); time.sleep(1.5)"],
                         stdout=subprocess.PIPE, text=True)
print(child.stdout.readline().strip(), reaper.pid, flush=True)
child.wait()
print("orphaned", flush=True)
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


def test_a_descendant_orphaned_before_the_parent_dies_is_killed_too():
    """A process once seen in the tree and orphaned since (its parent exited; or the parent died while the reaper
    read /proc, cutting the tree it read short) is still the reaper's to kill."""
    parent = subprocess.Popen([sys.executable, "-c", ORPHANING], stdout=subprocess.PIPE, text=True)
    grandchild, reaper = map(int, parent.stdout.readline().split())
    try:
        assert parent.stdout.readline().strip() == "orphaned"
        time.sleep(1.5)  # snapshots of the tree without the orphan
        assert _alive(grandchild)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert _until(lambda: not _alive(grandchild)), "the reaper did not kill the orphaned grandchild"
        assert _until(lambda: not _alive(reaper))
    finally:
        if _alive(grandchild):
            os.kill(grandchild, signal.SIGKILL)


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
