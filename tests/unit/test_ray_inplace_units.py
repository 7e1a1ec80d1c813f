"""RayInplaceLauncher without a cluster: what it refuses, what it is to the supervisor, the loss's wording."""

from __future__ import annotations

import pytest

from starverse.elastic.inplace import InplaceLauncher
from starverse.errors import ConfigError, LossCause
from starverse.providers.failures import lost_actor
from starverse.runtime.launch import RankSpec

pytest.importorskip("ray")
from starverse.providers.ray import RayLauncher
from starverse.providers.ray_inplace import RayInplaceLauncher, driver_host


def test_it_is_an_inplace_launcher_for_the_supervisor_and_refuses_bad_options():
    assert RayInplaceLauncher().warm_spares is False and RayInplaceLauncher(warm_spares=True).warm_spares
    with pytest.raises(ConfigError, match="bind must be one of auto, loopback, node"):
        RayInplaceLauncher(bind="everywhere")
    launcher = RayInplaceLauncher(replace_after_s=1.0, ray=RayLauncher(kind_resources={"rtx-4090": "rtx-4090"}))
    assert isinstance(launcher, InplaceLauncher)  # the supervisor and the ledger read losses / joins from it
    assert launcher.losses == [] and launcher.joins == [] and launcher.nodes() == {} and launcher.pids() == {}
    with pytest.raises(ConfigError, match="replace_after_s"):
        RayInplaceLauncher(replace_after_s=-1.0)


def test_a_lost_actor_that_the_others_survived_says_so():
    spec = RankSpec(1, "cpu", "cpu", 1)
    survived = lost_actor(spec, "node died", node="127.0.0.1", survived=True)
    stopped = lost_actor(spec, "node died", node="127.0.0.1")
    assert survived.cause == stopped.cause == LossCause.ACTOR_DIED and survived.node == "127.0.0.1"
    assert "the other replicas went on without it" in str(survived)
    assert "the other ranks were stopped" in str(stopped)


def test_a_job_file_turns_warm_spares_on_for_ray_or_off_locally(tmp_path, monkeypatch):
    from starverse.elastic.job import load_job
    from starverse.jobs.run import PreparedJob
    from starverse.providers.local import LocalLauncher
    from starverse.providers.ray import RayLauncher

    base = "model: tiny.json\ndataset: corpus.txt\nrecovery: in-place\nreplace_after_s: 0\n"
    for text, local, on_ray in [("", True, False), ("warm_spares: true\n", True, True),
                                ("warm_spares: false\n", False, False)]:
        (tmp_path / "job.yaml").write_text(base + text)
        job = load_job(tmp_path / "job.yaml")
        fake = type("P", (), {"job": job, "callbacks": type("C", (), {"billing": None})()})()
        assert PreparedJob._inplace_launcher(fake, LocalLauncher()).warm_spares is local  # type: ignore[arg-type]
        assert PreparedJob._inplace_launcher(fake, RayLauncher()).warm_spares is on_ray  # type: ignore[arg-type]


def test_the_replicas_meet_on_the_loopback_unless_a_node_is_elsewhere():
    loop, mixed = ["127.0.0.1", "127.0.0.1"], ["10.0.0.1", "10.0.0.2"]
    assert driver_host("auto", loop, "127.0.0.1") is None  # one machine: everything on 127.0.0.1
    assert driver_host("auto", mixed, "10.0.0.1") == "10.0.0.1"  # the driver's node IP; each actor binds its own
    assert driver_host("loopback", mixed, "10.0.0.1") is None
    assert driver_host("node", loop, "127.0.0.1") == "127.0.0.1"


def test_the_lighthouse_manager_and_store_bind_and_advertise_the_address_they_are_given():
    """What a replica on another host needs (there: the node IPs); here another loopback address, 127.0.0.2, shows
    that the address given is the one used (not 127.0.0.1, not every interface)."""
    from datetime import timedelta

    import psutil

    from starverse.elastic.inplace import Lighthouse
    from starverse.runtime.ft_group import loopback_manager_server

    host = "127.0.0.2"
    launcher = RayInplaceLauncher()
    lighthouse, store, extra = launcher._coordination(2, 10.0, host)
    server = loopback_manager_server(
        host, replica_id="r0", lighthouse_addr=lighthouse.address, hostname="somehost", bind="[::]:0",
        store_addr=f"{host}:1", world_size=1, heartbeat_interval=timedelta(milliseconds=100),
        connect_timeout=timedelta(seconds=5), quorum_retries=0)
    try:
        assert isinstance(lighthouse, Lighthouse) and extra["ft_host"] == host
        assert lighthouse.address.startswith(f"http://{host}:") and server.address().startswith(f"http://{host}:")
        ports = {int(lighthouse.address.rsplit(":", 1)[1]), int(server.address().rsplit(":", 1)[1]), int(store.port)}
        listening = [c for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        assert {c.laddr.port for c in listening if c.laddr.ip == host} >= ports
        assert not [c for c in listening if c.laddr.port in ports and c.laddr.ip != host]
    finally:
        server.shutdown()
        lighthouse.shutdown()
