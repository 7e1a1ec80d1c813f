"""The heterogeneous planner: which devices to rent and how to run the job on them (no torch).

``search(job, pool, catalog)`` returns ranked plans (``PlanResult``); ``plan_for(...)`` plans on a pool
given by the user; ``plan_for_devices(...)`` plans on a fixed set of devices within what the runtime executes
(``starverse.accelerate`` and the elastic re-plan use it). See ``docs/planner.md``.
"""

from __future__ import annotations

from starverse.planner.api import plan_for, search
from starverse.planner.devices import RUNTIME_CAPS, UNRESTRICTED, RuntimeCaps, plan_for_devices
from starverse.planner.job import (
    Constraints,
    Job,
    JobTrain,
    Objective,
    SearchOptions,
    job_from_dict,
    load_job,
)
from starverse.planner.pool import Offer, OfferSpec, Pool, PoolSpec, Pricing, load_pool, pool_from_dict
from starverse.planner.result import FrontierPoint, PlanResult, RankedPlan, SearchStats

__all__ = [
    "RUNTIME_CAPS",
    "UNRESTRICTED",
    "Constraints",
    "FrontierPoint",
    "Job",
    "JobTrain",
    "Objective",
    "Offer",
    "OfferSpec",
    "PlanResult",
    "Pool",
    "PoolSpec",
    "Pricing",
    "RankedPlan",
    "RuntimeCaps",
    "SearchOptions",
    "SearchStats",
    "job_from_dict",
    "load_job",
    "load_pool",
    "plan_for",
    "plan_for_devices",
    "pool_from_dict",
    "search",
]
