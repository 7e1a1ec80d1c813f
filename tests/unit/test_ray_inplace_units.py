"""RayInplaceLauncher without a cluster: what it refuses, what it is to the supervisor, the loss's wording."""

from __future__ import annotations

import pytest

from starverse.elastic.inplace import InplaceLauncher
from starverse.errors import ConfigError, LossCause
from starverse.providers.failures import lost_actor
from starverse.runtime.launch import RankSpec

pytest.importorskip("ray")
from starverse.providers.ray import RayLauncher
from starverse.providers.ray_inplace import RayInplaceLauncher


def test_warm_spares_are_refused_on_ray_and_it_is_an_inplace_launcher_for_the_supervisor():
    with pytest.raises(ConfigError, match="warm spares are not built on Ray"):
        RayInplaceLauncher(warm_spares=True)
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
