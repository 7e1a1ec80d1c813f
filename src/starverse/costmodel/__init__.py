"""The training cost model: time, memory, money and power of a plan, from first principles (numpy only).

``estimate(plan)`` for one plan (heterogeneous groups and pipelines included); ``estimate_batch`` for the
planner's inner loop over many candidate groups. Both run the same stage functions. Constants and their
sources: :mod:`starverse.costmodel.constants` and docs/costmodel.md.
"""

from __future__ import annotations

from starverse.costmodel.batch import cross_group_sync_s, estimate_batch
from starverse.costmodel.shapes import (
    BOTTLENECKS,
    OFFLOAD_CODES,
    RECOMPUTE_CODES,
    BatchEstimate,
    Candidates,
    DeviceTable,
    ModelShape,
    TrainShape,
)
from starverse.costmodel.step import Estimate, GroupEstimate, StageMemory, check_plan, estimate

__all__ = [
    "BOTTLENECKS",
    "OFFLOAD_CODES",
    "RECOMPUTE_CODES",
    "BatchEstimate",
    "Candidates",
    "DeviceTable",
    "Estimate",
    "GroupEstimate",
    "ModelShape",
    "StageMemory",
    "TrainShape",
    "check_plan",
    "cross_group_sync_s",
    "estimate",
    "estimate_batch",
]
