"""A replica that hangs mid-step (SIGSTOP) with its connections left open does not hold the survivors for the
collective timeout (issue 11, items 1 and 2).

Replica 1 of 3 stops itself in the middle of step 3, after forking a child that holds copies of its sockets and stops
too (``HangReplicaMidStep(keep_connections=True)``): when the launcher kills the replica, its connections stay open,
as a host lost off the network leaves them, so a survivor blocked in the all-reduce gets no error from gloo. The
launcher finds the stopped replica by its heartbeat (8 s), kills it (a typed ``LostRankError``, cause ``heartbeat
timeout``) and announces the loss on its store; the survivors give up the collective at once, redo the step in a
quorum of two and finish. The collective timeout is 120 s and the job's 100 s: without the announcement the survivors
wait for the collective timeout and the job overruns. The final weights equal one process's training on the same
global batches.
"""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import time
from pathlib import Path

import torch

from helpers import SEQ, TinyLM, assert_same_as_one_process, process_gone, ramp_tokens
from starverse.elastic.inplace import InplaceLauncher
from starverse.errors import LossCause
from starverse.runtime.cluster import Cluster, local_plan
from starverse.runtime.launch import RankSpec
from starverse.runtime.trainer import Trainer
from starverse.testing import HUNG_FILE, HangReplicaMidStep

MB, GB, STEPS, HANG_AT = 2, 12, 6, 3
COLLECTIVE_S, JOB_S, HEARTBEAT_S = 120.0, 100.0, 8.0
"""HEARTBEAT_S: with 3 s, 2 of 9 runs at load 12-14 on 2 cores overran the job (cause not confirmed; docs/insurance.md)."""


def _release_holder(run_dir: Path) -> list[int]:
    """Kill the socket holder :class:`HangReplicaMidStep` left; the pids it wrote (replica, holder)."""
    path = run_dir / HUNG_FILE.format(rank=1)
    pids = [int(p) for p in path.read_text().split()] if path.exists() else []
    for pid in pids[1:]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def test_a_stopped_replica_with_open_connections_is_lost_by_its_heartbeat_and_the_survivors_go_on(tmp_path):
    ranks = tuple(RankSpec(r, "cpu", "cpu", num_threads=1) for r in range(3))
    torch.manual_seed(0)
    model = TinyLM()
    initial = copy.deepcopy(model)
    launcher = InplaceLauncher(heartbeat_s=0.2, heartbeat_timeout_s=HEARTBEAT_S)
    trainer = Trainer(Cluster(plan=local_plan(ranks, "tiny", 1, SEQ, GB, precision="fp32"), ranks=ranks),
                      callbacks=[HangReplicaMidStep(replica=1, step=HANG_AT, keep_connections=True)], run_dir=tmp_path,
                      lr=2e-2, warmup_steps=2, grad_clip=0.5, timeout_s=JOB_S, collective_timeout_s=COLLECTIVE_S,
                      recovery="in-place", launcher=launcher, progress=False, tensorboard=False)
    try:
        res = trainer.fit(model, dataset=ramp_tokens(), per_device_batch_size=MB, max_steps=STEPS, seq_len=SEQ,
                          global_batch=GB)
        done = time.time()
    finally:
        pids = _release_holder(tmp_path)
    [loss] = launcher.losses
    assert (loss.error.rank, loss.error.cause) == (1, LossCause.HEARTBEAT), loss.error
    stopped_at = (tmp_path / HUNG_FILE.format(rank=1)).stat().st_mtime
    # the heartbeat timeout, the survivors' re-quorum and the rest of the run: far below the collective timeout
    assert done - stopped_at < COLLECTIVE_S / 4, done - stopped_at
    assert len(pids) == 2 and process_gone(pids[0]) and process_gone(pids[1])  # the stopped replica, its holder
    sizes = [len(s) for _, s in res.shares_history]
    assert sizes[0] == 3 and sizes[-1] == 2 and all(sum(s) == GB // MB for _, s in res.shares_history)
    assert res.steps == STEPS
    assert_same_as_one_process(res, model, initial, trainer, STEPS, GB)
