"""Pieces of in-place recovery that need no replicas: the credit of a loss survived in place, the shares after a
membership change, the job file's `recovery` field, and torchft's manager server bound to the loopback."""

from __future__ import annotations

from datetime import timedelta

import psutil
import pytest

from starverse.billing.insurance import CreditKind, Event, EventKind, credit_intervals
from starverse.elastic.job import load_job
from starverse.errors import ConfigError
from starverse.runtime.ft import loopback_manager_server, replica_shares


def _ev(i: int, kind: EventKind, at: int, step: int | None = None, **detail) -> Event:
    return Event(i, 1, None, kind, at, step, detail)


def test_a_loss_survived_in_place_credits_only_the_step_in_flight():
    events = [_ev(1, EventKind.CHECKPOINT, 100, 10), _ev(2, EventKind.PREEMPTION, 160, 14, in_place_from_s=158),
              _ev(3, EventKind.RESUME, 161, 14)]
    got = [(k, a, b) for k, _, a, b in credit_intervals(0, events)]
    assert got == [(CreditKind.REDO, 158, 160), (CreditKind.RESTART, 160, 161)]
    # the same loss with a restart redoes everything since the checkpoint
    events[1] = _ev(2, EventKind.PREEMPTION, 160, 14)
    assert next((k, a, b) for k, _, a, b in credit_intervals(0, events)) == (CreditKind.REDO, 100, 160)


def test_shares_kept_while_members_stay_and_the_whole_batch_redistributed_when_they_change():
    assert replica_shares(12, [(0, 0.1), (1, 0.1), (2, 0.3)], [4, 4, 4], [0, 1, 2]) == [4, 4, 4]
    after_loss = replica_shares(12, [(0, 0.1), (2, 0.3)], [4, 4, 4], [0, 1, 2])
    assert sum(after_loss) == 12 and after_loss[0] > after_loss[1]  # the faster replica takes more
    joined = replica_shares(12, [(0, 0.1), (1, 0.0), (2, 0.1)], [6, 6], [0, 2])  # an unmeasured joiner
    assert joined == [4, 4, 4]
    # a pipelined replica's schedule needs a share of at least its stages (1F1B), even when it is slow
    assert replica_shares(8, [(0, 0.1), (1, 5.0)], None, None, min_share=2) == [6, 2]


def test_the_launcher_groups_a_pipelines_ranks_and_stops_them_as_one_replica():
    from starverse.elastic.inplace import replica_members, stopped_with_replica
    from starverse.errors import LossCause
    from starverse.providers.failures import lost_process
    from starverse.runtime.ft_group import REPLICA_ENV
    from starverse.runtime.launch import RankSpec

    plain = [RankSpec(r, "cpu") for r in range(3)]
    assert replica_members(plain) == {0: (0,), 1: (1,), 2: (2,)}
    piped = [RankSpec(r, "cpu", env=((REPLICA_ENV, str(r // 2)),)) for r in range(4)]
    assert replica_members(piped) == {0: (0, 1), 1: (2, 3)}
    partner = stopped_with_replica(piped[2], lost_process(piped[3], -9))
    assert (partner.rank, partner.cause) == (2, LossCause.REPLICA) and "rank 3" in str(partner)


def _job(tmp_path, extra: str):
    (tmp_path / "c.txt").write_text("hello " * 100)
    p = tmp_path / "job.yaml"
    p.write_text("dataset: c.txt\n" + extra)
    return p


def test_recovery_field_accepts_restart_and_in_place_and_names_a_bad_value(tmp_path):
    assert load_job(_job(tmp_path, "")).recovery == "restart"
    assert load_job(_job(tmp_path, "recovery: in-place\nreplace_after_s: 2\n")).replace_after_s == 2
    with pytest.raises(ConfigError) as e:
        load_job(_job(tmp_path, "recovery: inplace\n"))
    assert "recovery" in str(e.value) and "in-place" in str(e.value)


def test_the_manager_server_listens_and_advertises_on_the_loopback_only():
    from starverse.elastic.inplace import Lighthouse

    lighthouse = Lighthouse()
    try:
        server = loopback_manager_server(
            replica_id="r0", lighthouse_addr=lighthouse.address, hostname="somehost", bind="[::]:0",
            store_addr="127.0.0.1:1", world_size=1, heartbeat_interval=timedelta(milliseconds=100),
            connect_timeout=timedelta(seconds=5), quorum_retries=0)
        try:
            assert server.address().startswith("http://127.0.0.1:")
            port = int(server.address().rsplit(":", 1)[1])
            mine = [c for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
            assert {c.laddr.ip for c in mine if c.laddr.port == port} == {"127.0.0.1"}
            assert all(c.laddr.ip == "127.0.0.1" for c in mine if c.laddr.port == int(lighthouse.address.rsplit(":", 1)[1]))
        finally:
            server.shutdown()
    finally:
        lighthouse.shutdown()
