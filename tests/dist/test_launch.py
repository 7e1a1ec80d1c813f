"""launch(): real spawned ranks on 127.0.0.1; a dead rank fails the job fast with its name and signal."""

from __future__ import annotations

import os
import signal
import time

import pytest

from starverse.errors import (
    ConfigError,
    DistributedError,
    JobTimeoutError,
    LossCause,
    LostRankError,
    RankCodeError,
)
from starverse.providers.local import LocalLauncher
from starverse.runtime.launch import RankSpec, launch


def _sum_ranks(env, offset):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(env.rank + offset)])
    dist.all_reduce(t)
    return (env.rank, os.environ["MASTER_ADDR"], t.item())


def _die(env, victim, how):
    import torch
    import torch.distributed as dist

    if env.rank == victim:
        if how == "signal":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "exit":
            os._exit(7)
        if how == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)  # alive but silent: only the heartbeat shows it is gone
        if how == "user":
            raise ConfigError("dataset 'x' is empty")
        raise RuntimeError("boom in rank code")
    # The survivors block in a collective the victim never joins: they must not hang.
    t = torch.ones(1)
    dist.all_reduce(t)
    time.sleep(60)
    return t.item()


def _ranks(n):
    return [RankSpec(rank=r, device_kind="cpu", device="cpu", num_threads=1) for r in range(n)]


def test_launch_runs_real_ranks_and_returns_in_rank_order():
    out = launch(_sum_ranks, _ranks(3), timeout_s=120, args=(10,))
    assert out == [(0, "127.0.0.1", 33.0), (1, "127.0.0.1", 33.0), (2, "127.0.0.1", 33.0)]


def test_killed_rank_fails_fast_naming_rank_and_signal():
    t0 = time.monotonic()
    with pytest.raises(DistributedError, match=r"rank 1 \(cpu, cpu\) killed by signal SIGKILL") as err:
        launch(_die, _ranks(2), timeout_s=100, args=(1, "signal"), collective_timeout_s=60)
    assert (err.value.failed_rank, err.value.rank_exitcode) == (1, -signal.SIGKILL)
    e = err.value
    assert isinstance(e, LostRankError) and (e.rank, e.device_kind, e.cause, e.signal) == (1, "cpu", LossCause.SIGNAL, 9)
    # Far below the collective timeout: the launcher noticed the death itself.
    assert time.monotonic() - t0 < 50


def test_rank_exception_is_reported_with_its_message():
    with pytest.raises(DistributedError, match=r"rank 0 \(cpu, cpu\) failed: RuntimeError: boom in rank code") as err:
        launch(_die, _ranks(2), timeout_s=100, args=(0, "raise"), collective_timeout_s=60)
    e = err.value
    assert isinstance(e, RankCodeError) and (e.rank, e.error) == (0, "RuntimeError: boom in rank code")
    assert e.traceback is not None and "boom in rank code" in e.traceback


def test_user_error_inside_a_rank_is_reraised_as_itself():
    with pytest.raises(ConfigError, match="dataset 'x' is empty"):
        launch(_die, _ranks(2), timeout_s=100, args=(1, "user"), collective_timeout_s=60)


def test_job_timeout_stops_all_ranks():
    with pytest.raises(JobTimeoutError, match=r"did not finish within 3 s \(0/2 ranks done\)") as err:
        launch(_die, _ranks(2), timeout_s=3, args=(5, "none"), collective_timeout_s=60)
    assert (err.value.timeout_s, err.value.num_done, err.value.world_size) == (3, 0, 2)


def test_exit_without_a_result_is_a_lost_rank_with_its_exit_code():
    with pytest.raises(LostRankError, match=r"rank 1 \(cpu, cpu\) exit code 7 without reporting") as err:
        launch(_die, _ranks(2), timeout_s=100, args=(1, "exit"), collective_timeout_s=60)
    assert (err.value.cause, err.value.exit_status, err.value.signal) == (LossCause.EXIT_CODE, 7, None)


def test_a_stopped_rank_is_lost_by_its_heartbeat():
    fast = LocalLauncher(heartbeat_s=0.2, heartbeat_timeout_s=3.0)
    with pytest.raises(LostRankError, match=r"rank 1 \(cpu, cpu\) sent no heartbeat for \d+ s") as err:
        launch(_die, _ranks(2), timeout_s=100, args=(1, "stop"), collective_timeout_s=60, launcher=fast)
    assert (err.value.rank, err.value.cause) == (1, LossCause.HEARTBEAT)


def test_rank_numbers_must_be_contiguous():
    with pytest.raises(DistributedError, match=r"ranks must be 0..1, got \[0, 2\]"):
        launch(_sum_ranks, [RankSpec(0, "cpu"), RankSpec(2, "cpu")], timeout_s=5, args=(0,))


def _hang(env):
    import torch
    import torch.distributed as dist

    if env.rank == 1:
        time.sleep(120)  # alive but stuck: only the collective timeout can end the peer's wait
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def test_a_hung_peer_ends_in_a_collective_timeout_not_a_hang():
    t0 = time.monotonic()
    with pytest.raises(DistributedError, match=r"rank 0 \(cpu, cpu\) failed: .*(?i:timed? ?out)") as err:
        launch(_hang, _ranks(2), timeout_s=100, collective_timeout_s=3)
    assert err.value.failed_rank == 0
    assert "A peer did not join a collective within collective_timeout_s" in str(err.value)
    assert time.monotonic() - t0 < 60
