"""Sharded replicas for in-place recovery: a device kind's devices split into equal replica groups, ZeRO 1-3 inside
each (what ``starverse.runtime.ft_shard`` runs: each plan group one torchft replica; ZeRO-2/3 with FSDP2).

The search makes one group per device kind, and a sharded group is one replica to in-place recovery (its loss
would leave none). When the runtime recovers in place (:attr:`~starverse.planner.devices.RuntimeCaps.sharded_replicas`),
:func:`sharded_replica_plans` proposes, for every group size ``G >= 2`` that divides every kind's count and leaves
at least two groups, the plan of ``count / G`` groups of ``G`` replicas per kind, one stage, TP 1, no offload, for
each ZeRO stage (1 up to the caps' ``max_zero_stage``) and recompute setting the caps allow. Each is priced by the
scalar cost model like any plan (``rank_plan``): inside a group, ZeRO over ``G`` ranks (ZeRO-1: its gradient ring,
a 1/G optimizer shard and the parameter broadcast; ZeRO-2/3: FSDP2's per-micro-batch collectives and 1/G shards);
across groups, the joint ring of the whole gradient over every rank of every group
(:func:`~starverse.costmodel.batch.joint_sync_s`) minus the group's own, the same volume as the runtime's sum
inside the replica followed by each shard's all-reduce across replicas (``2(G-1)/G + 2(R-1)/(RG) = 2(N-1)/N`` of
the gradient bytes). ``plan_for_devices`` ranks them with the search's plans, so the simplest-within-5 % rule keeps
ZeRO-0 replicas unless they do not fit or are slower.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from functools import reduce
from typing import Any

from starverse.errors import ConfigError
from starverse.plan import Group, Plan, Stage
from starverse.planner.build import network_for, pricing_for, rank_plan, train_spec
from starverse.planner.job import Job
from starverse.planner.policy import resolve_objective
from starverse.planner.pool import Pool
from starverse.planner.result import RankedPlan
from starverse.planner.space import RECOMPUTE_CODES, Setting


def group_sizes(devices: Mapping[str, int]) -> list[int]:
    """Replica-group sizes ``G >= 2`` dividing every kind's count and leaving at least two groups, smallest first."""
    counts = [int(n) for n in devices.values()]
    common = reduce(math.gcd, counts, 0)
    total = sum(counts)
    return [g for g in range(2, common + 1) if common % g == 0 and total // g >= 2]


def sharded_replica_plans(job_for: Callable[[int, str], Job], pool: Pool, catalog: Any, spec: Any,
                          devices: Mapping[str, int], settings: Sequence[tuple[int, str]]) -> list[RankedPlan]:
    """The ranked sharded-replica plans on exactly ``devices`` (see the module docstring) for each ``(ZeRO stage,
    recompute)`` of ``settings``; those that do not fit or break a constraint are left out. ``job_for(zero,
    recompute)``: the job with that setting fixed."""
    offers = {o.accelerator: o.name for o in pool.offers}
    names = [offers[acc] for acc in devices]
    out: list[RankedPlan] = []
    for size in group_sizes(devices):
        for zero, rc in settings:
            job, _ = resolve_objective(job_for(zero, rc), pool)
            setting = Setting(zero_stage=zero, recompute=RECOMPUTE_CODES[rc], offload=0)
            groups = [Group(replicas=size, stages=[Stage(accelerator=acc, layers=int(spec.num_layers))])
                      for acc, n in devices.items() for _ in range(int(n) // size)]
            plan = Plan(model=job.model, train=train_spec(job, job.train.mode, setting, False), groups=groups,
                        network=network_for(pool, names), pricing=pricing_for(pool, names))
            ranked = _ranked(job, pool, catalog, spec, plan, devices, offers, len(groups), size)
            if ranked is not None:
                out.append(ranked)
    return out


def _ranked(job: Job, pool: Pool, catalog: Any, spec: Any, plan: Plan, devices: Mapping[str, int],
            offers: Mapping[str, str], num_groups: int, size: int) -> RankedPlan | None:
    """``plan`` with the cost model's micro-batch and share of each group written in, ranked (None: no fit)."""
    from starverse.costmodel import estimate

    try:
        est = estimate(plan, catalog, spec)
    except ConfigError:  # the global batch does not split over these groups
        return None
    if not est.fits:
        return None
    gb = plan.train.global_batch
    groups = [g.model_copy(update={"micro_batch": e.micro_batch, "batch_share": e.sequences_per_step / gb})
              for g, e in zip(plan.groups, est.groups, strict=True)]
    plan = plan.model_copy(update={"groups": groups})
    kind = "single" if len(devices) == 1 else "hetero-dp"
    note = (f"sharded replicas for in-place recovery: {num_groups} groups of {size} ranks, "
            f"ZeRO-{plan.train.zero_stage} inside each (each group one torchft replica)")
    return rank_plan(job, pool, catalog, spec, plan, {offers[a]: int(n) for a, n in devices.items()}, kind,
                     alternative=False, notes=(note,))


__all__ = ["group_sizes", "sharded_replica_plans"]
