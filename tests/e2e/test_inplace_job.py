"""`starverse train` with `recovery: in-place` (issue 11 items 2 and 5): a rank SIGKILLed mid-run costs no
restart and no lost step, every socket of the job (torchft's Lighthouse, managers and gloo included) listens on
127.0.0.1 only, and the ledger ends the lost lease at the loss, credits only the step in flight and checks."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import psutil
import pytest
from test_survive import _bill_check, _env, _job, _listening, _loopback, _wait_step

from helpers import CLI
from starverse.providers.local import RANK_PROCESS_NAME

pytestmark = pytest.mark.slow


def _ranks(pid: int) -> list[psutil.Process]:
    """The replica processes under the supervisor ``pid`` (spawned, or forked from a fork server): by name."""
    prefix = RANK_PROCESS_NAME.format(rank="")
    return [p for p in psutil.Process(pid).children(recursive=True) if p.name().startswith(prefix)]


@pytest.mark.timeout(600)
def test_inplace_job_survives_a_sigkill_on_loopback_and_bills_the_step_in_flight(tmp_path):
    steps = 30  # enough steps after the kill at step 3 that a loaded machine's socket listing cannot outlast the run
    job = _job(tmp_path, steps, extra="recovery: in-place\n", checkpoint="interval_steps: 5, keep_last: 2")
    job.write_text(job.read_text().replace("cpu_ranks: 2", "cpu_ranks: 3"))
    proc = subprocess.Popen([*CLI, "train", str(job), "--json"], cwd=tmp_path, env=_env(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    _wait_step(proc, tmp_path, 3)
    ranks = _ranks(proc.pid)
    assert len(ranks) == 3, ranks
    # every listening socket: the supervisor's (Lighthouse, start barrier, metrics) and the replicas' (torchft
    # manager, its store, gloo)
    listening = _listening([psutil.Process(proc.pid), *ranks])
    assert len(listening) >= 4 and [x for x in listening if not _loopback(x[1])] == [], listening
    os.kill(ranks[1].pid, signal.SIGKILL)
    out, err = proc.communicate(timeout=500)
    assert proc.returncode == 0, err[-3000:]
    res = json.loads(out)
    assert res["final_step"] == steps and res["lost_steps"] == 0
    [attempt] = res["attempts"]  # no restart
    assert attempt["outcome"] == "completed" and len(attempt["replicas_lost"]) == 1, attempt
    bill = res["bill"]
    lost = [le for le in bill["leases"] if le["device"].endswith(f"/rank{attempt['replicas_lost'][0]}")]
    others = [le for le in bill["leases"] if le not in lost]
    assert len(lost) == 1 and len(others) == 2 and bill["open_leases"] == 0
    assert lost[0]["seconds"] < min(le["seconds"] for le in others)  # its lease ended at the loss
    kinds = [e["kind"] for e in bill["events"]]
    assert kinds.count("preemption") == 1 and kinds.count("resume") == 1, kinds
    _bill_check(tmp_path)
