"""Which recovery a fit runs: ``Trainer.recovery`` (``recovery:`` in a job file) against what in-place recovery
can run (:func:`inplace_refusal`), the replica each rank of a multi-rank replica belongs to, and the results of
an in-place run with lost ranks.

The in-place modules (``ft_*``) are imported only where a plan is checked for them: the sharded and pipelined
replica trainers add about 2 s of imports (measured here, 2 cores) that a checkpoint-restart fit never needs.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from starverse.errors import DistributedError
from starverse.plan import Plan
from starverse.runtime.launch import RankSpec
from starverse.runtime.parallel.pipeline_layout import PipelineLayout
from starverse.runtime.rank_job import RankResult

log = logging.getLogger(__name__)


RECOVERY_MODES = ("restart", "in-place")
"""Values of ``Trainer.recovery`` (``recovery:`` in a job file)."""


def recovery_for(recovery: str, plan: Plan) -> str:
    """``recovery``, or ``restart`` with one logged line when in-place recovery does not run ``plan``."""
    refusal = inplace_refusal(plan) if recovery == "in-place" else None
    if refusal is None:
        return recovery
    log.warning("recovery: in-place recovers replicas of one rank, one pipeline or one ZeRO group each; this plan "
                "(%s) has %s, so it runs with checkpoint-restart", ", ".join(
                    f"{g.replicas} replica(s) of {g.devices_per_replica} {g.stages[0].accelerator}" for g in plan.groups),
                refusal)
    return "restart"



def inplace_supported(plan: Plan) -> bool:
    """True if in-place recovery can run ``plan`` (see :func:`inplace_refusal`)."""
    return inplace_refusal(plan) is None


def inplace_refusal(plan: Plan) -> str | None:
    """Why in-place recovery cannot run ``plan`` (None: it can): every replica one rank holding the whole model,
    or one pipeline (a stage per rank, no TP, every replica cut alike, GPipe or 1F1B, no recompute: its stage
    chunks are not wrapped for it in place), or a sharded group (``ft_shard.shard_replica_error``); no offload."""
    t = plan.train
    if t.zero_stage:
        from starverse.runtime.ft_shard import shard_replica_error

        return shard_replica_error(plan)
    if t.offload != "none":
        return f"offload {t.offload} (sharded replicas are built without offload)"
    if all(g.devices_per_replica == 1 for g in plan.groups):
        return None
    from starverse.runtime.ft_pipe import pipeline_replica_error

    layout = PipelineLayout.from_plan(plan)
    if not layout.is_pipelined:
        return "replicas of several ranks without a pipeline"
    if t.recompute != "none":
        return f"recompute {t.recompute} inside a pipelined replica"
    return pipeline_replica_error(layout)


def tag_replicas(ranks: list[RankSpec], plan: Plan, layout: PipelineLayout) -> list[RankSpec]:
    """The ranks of an in-place run with replicas of several ranks (a pipeline; a ZeRO group), each told its
    replica (the launcher starts, loses and replaces a replica's ranks together: ``REPLICA_ENV``)."""
    from starverse.runtime.ft_group import REPLICA_ENV
    from starverse.runtime.ft_shard import shard_replicas

    replica = shard_replicas(plan) if plan.train.zero_stage else [p.replica for p in layout.places]
    return [dataclasses.replace(r, env=(*r.env, (REPLICA_ENV, str(replica[r.rank])))) for r in ranks]


def fill_lost(results: list[Any]) -> list[RankResult]:
    """An in-place run's results with each rank lost for good (``None``) reported as having trained nothing."""
    done = [r for r in results if r is not None]
    if not done:  # every replica lost (a launcher that does not raise it itself): the supervisor restarts
        raise DistributedError("every replica of the in-place run was lost; nothing holds the live state")
    return [r if r is not None else dataclasses.replace(done[0], tokens=0, compute_s=0.0, share=0) for r in results]

