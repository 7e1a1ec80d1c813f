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
from pathlib import Path

import pytest

from starverse.elastic.inplace import InplaceLauncher
from starverse.errors import DistributedError, LostRankError
from starverse.runtime.ft import EXTRA_JOINER
from starverse.runtime.launch import RankSpec
from starverse.runtime.trainer import _fill_lost


def _wait_for(path: Path) -> None:
    while not path.exists():
        time.sleep(0.01)


def _die_then_replacement_finds_no_one(env, folder: str) -> None:
    """Rank 1 dies; rank 0 dies once rank 1's replacement runs; that replacement returns None after that."""
    marks = Path(folder)
    if env.extra.get(EXTRA_JOINER):
        if env.rank == 1:
            (marks / "joiner1").touch()
            _wait_for(marks / "rank0-gone")
            time.sleep(0.5)
        return None  # as train_replica's replacement that found no one to join
    if env.rank == 0:
        _wait_for(marks / "joiner1")
        (marks / "rank0-gone").touch()
    os.kill(os.getpid(), signal.SIGKILL)
    return None


def test_every_replica_lost_while_a_replacement_starts_is_a_lost_rank_error(tmp_path):
    launcher = InplaceLauncher(replace_after_s=0.0, warm_spares=False)
    ranks = [RankSpec(r, "cpu", "cpu", num_threads=1) for r in range(2)]
    with pytest.raises(LostRankError) as err:
        launcher.launch(_die_then_replacement_finds_no_one, ranks, timeout_s=120, collective_timeout_s=20,
                        args=(str(tmp_path),))
    assert err.value.rank == 0 and err.value.signal == signal.SIGKILL
    assert [loss.error.rank for loss in launcher.losses] == [1, 0]
    assert (launcher.joins[0].rank, launcher.joins[0].warm) == (1, False)


def test_fill_lost_of_no_result_is_a_typed_error():
    with pytest.raises(DistributedError):
        _fill_lost([None, None])
