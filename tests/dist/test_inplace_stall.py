"""A survivor's failed collective must not hold the other survivors until the collective timeout.

When a replica dies mid-step, the survivor that touches the dead peer first fails its all-reduce at once; another
survivor may instead be waiting in the same all-reduce for data from *that* survivor (gloo's algorithm routes
through it), and waits until the collective timeout unless the first one closes its connections. The Lighthouse
forms no new quorum meanwhile: the waiting survivor heartbeats without asking to join, and a quorum needs more than
half of the heartbeating replicas (and waits up to its join timeout for the rest). Before the fix the step was
redone only after the collective timeout (the benchmarks' 60 s stall; here the Lighthouse logged "only have 1
participants, need at least half of 2 healthy workers" until the collective timed out). Both bounds are 600 s
here and the launch must finish within 120 s. The replicas are plain ``TorchftSync`` groups on the in-place
launcher's Lighthouse (no model); rank 0 enters the failing all-reduce after rank 2, so that rank 2 waits on
rank 0 (the order seen to stall).
"""

from __future__ import annotations

import os
import signal
import time

import torch

from starverse.elastic.inplace import InplaceLauncher
from starverse.runtime.ft_group import EXTRA_LIGHTHOUSE, TorchftSync
from starverse.runtime.ft_join import start_barrier
from starverse.runtime.launch import RankSpec

NEVER_S = 600.0
"""The collective timeout and the Lighthouse's join timeout: a stall would last this long."""


def _lose_rank_1_mid_step(env) -> dict:
    sync = TorchftSync(f"replica{env.rank:04d}", str(env.extra[EXTRA_LIGHTHOUSE]), env.collective_timeout_s,
                       dict, lambda sd: None)
    start_barrier(env)
    try:
        first = sync.start_step()
        t = torch.ones(1000, dtype=torch.float64)
        assert sync.allreduce_sum(t) and sync.commit() and first.size == 3
        sync.start_step()  # the second step's quorum holds all three
        if env.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if env.rank == 0:
            time.sleep(0.5)  # rank 2 is in the all-reduce first, waiting on rank 0
        t = torch.ones(1000, dtype=torch.float64)
        failed_ok = sync.allreduce_sum(t)
        failed_commit = sync.commit()
        again = sync.start_step()  # the new quorum: the two survivors
        t = torch.full((1000,), float(env.rank), dtype=torch.float64)
        ok = sync.allreduce_sum(t)
        return {"failed": (failed_ok, failed_commit), "size": again.size, "ok": ok, "commit": sync.commit(),
                "sum": float(t[0])}
    finally:
        sync.shutdown()


def test_survivors_requorum_without_waiting_for_the_collective_timeout():
    launcher = InplaceLauncher()
    ranks = [RankSpec(r, "cpu", "cpu", num_threads=1) for r in range(3)]
    results = launcher.launch(_lose_rank_1_mid_step, ranks, timeout_s=120, collective_timeout_s=NEVER_S)
    assert [loss.error.rank for loss in launcher.losses] == [1]
    assert results[1] is None
    for r in (0, 2):
        assert results[r] == {"failed": (False, False), "size": 2, "ok": True, "commit": True, "sum": 2.0}, results
