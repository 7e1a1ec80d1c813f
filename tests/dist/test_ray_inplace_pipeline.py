"""In-place recovery on Ray when a replica is a pipeline: 2 replicas x 2 stages as 4 Ray actors (a private
single-node session on 127.0.0.1). A stage's actor SIGKILLed mid-step: the launcher kills the other stage's actor
of that replica (typed as a replica loss), the other replica goes on alone, and a replacement replica (two new
actors) joins stage by stage with the live state; the math equals one process's (``_fit`` of
``test_inplace_pipeline.py`` checks it)."""

from __future__ import annotations

import pytest
from test_inplace_pipeline import _fit

from helpers import RAY_GROUP

from starverse.errors import LossCause
from starverse.testing import KillReplicaMidStep, WaitForReplicas

ray = pytest.importorskip("ray")
from starverse.providers.ray_inplace import RayInplaceLauncher  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.xdist_group(RAY_GROUP),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def test_a_lost_stage_actor_loses_its_replica_and_a_replacement_replica_joins_on_ray(tmp_path):
    assert not ray.is_initialized()  # the launcher starts (and stops) a private session
    launcher = RayInplaceLauncher(replace_after_s=0.0)
    res, _ = _fit(tmp_path, launcher, [KillReplicaMidStep(replica=3, step=2),  # rank 3: replica 1, stage 1
                                       WaitForReplicas(replicas=2, after_step=2, pause_s=1.0)])
    assert [(x.error.rank, x.error.cause) for x in launcher.losses] == [(3, LossCause.ACTOR_DIED),
                                                                        (2, LossCause.REPLICA)]
    # each actor's join is recorded once Ray placed it: the two may come in either order
    assert sorted((j.rank, j.warm) for j in launcher.joins) == [(2, False), (3, False)]
    sizes = [len(s) for _, s in res.shares_history]
    assert sizes[0] == 2 and 1 in sizes and sizes[-1] == 2, res.shares_history
    assert res.ranks[2].tokens > 0 and res.ranks[3].tokens > 0  # the replacement's actors trained
