"""Every replica of an in-place run lost while a replacement was starting: a typed loss, never an IndexError.

The replicas here are plain processes (no torchft, no model): rank 1 dies, its replacement starts, rank 0 dies
before the replacement joins, and the replacement, finding no one to join, returns None (as
``runtime.ft.train_replica`` does). Before the fix the launcher returned ``[None, None]`` and the trainer's
``_fill_lost`` raised ``IndexError``; now the launcher raises the last :class:`LostRankError` (the supervisor
then restarts from the last checkpoint) and ``_fill_lost`` of no result raises a typed error.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from starverse.elastic.inplace import InplaceLauncher
from starverse.errors import DistributedError, LostRankError
from starverse.runtime.ft import EXTRA_JOINER
from starverse.runtime.launch import RankSpec
from starverse.runtime.trainer import _fill_lost


def _die_then_replacement_finds_no_one(env) -> None:
    if env.extra.get(EXTRA_JOINER):
        time.sleep(2.0)  # its first quorum: alone (rank 0 died meanwhile)
        return None
    time.sleep(0.2 if env.rank == 1 else 1.0)
    os.kill(os.getpid(), signal.SIGKILL)
    return None


def test_every_replica_lost_while_a_replacement_starts_is_a_lost_rank_error():
    launcher = InplaceLauncher(replace_after_s=0.0, warm_spares=False)
    ranks = [RankSpec(r, "cpu", "cpu", num_threads=1) for r in range(2)]
    with pytest.raises(LostRankError) as err:
        launcher.launch(_die_then_replacement_finds_no_one, ranks, timeout_s=60, collective_timeout_s=20)
    assert err.value.rank == 0 and err.value.signal == signal.SIGKILL
    assert [loss.error.rank for loss in launcher.losses] == [1, 0]
    assert [(j.rank, j.warm) for j in launcher.joins] == [(1, False), (0, False)]  # both replaced, cold


def test_fill_lost_of_no_result_is_a_typed_error():
    with pytest.raises(DistributedError):
        _fill_lost([None, None])
