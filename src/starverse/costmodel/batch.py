"""Vectorised cost model over many candidate *groups* at once (the planner's inner loop).

Contract (the planner codes against this; keep names stable, add fields freely):

* A **candidate** is one group of a plan: ``replicas`` identical pipelines of ``pp`` stages, every stage a
  tensor-parallel group of ``tp`` devices of ONE accelerator, the model's layers split evenly over the
  stages (the first ``L % pp`` stages take one layer more; the embedding sits on the first stage, the final
  norm and LM head on the last). It runs ``micro_batch`` sequences per micro-batch and
  ``num_micro_batches`` micro-batches per replica per optimizer step, so the group processes
  ``replicas * micro_batch * num_micro_batches`` sequences per step.
* Everything per candidate is a numpy array of shape ``(N,)`` (:class:`Candidates`); everything shared
  (model shape, training settings, accelerator table) is a small object built once per search.
* :func:`estimate_batch` returns a :class:`BatchEstimate` of ``(N,)`` arrays. No Python loop over
  candidates; one call of 100,000 candidates takes well under a second.
* The scalar :func:`starverse.costmodel.estimate` evaluates a plan through the very same stage
  functions (``costmodel.stage`` and ``costmodel.group``), so for a one-group plan with an even layer split both agree to
  floating-point rounding (tested).
* Heterogeneous data parallelism (several groups of different accelerators) is composed by the caller:
  each group's ``step_time_s`` for its own batch share, the plan's step time is the slowest group plus
  :func:`cross_group_sync_s` (the gradient all-reduce between groups over ``cross_group_gbps``).
"""

from __future__ import annotations

import numpy as np

from starverse.costmodel.comm import ring_allreduce_s
from starverse.costmodel.group import evaluate_uniform
from starverse.costmodel.shapes import (
    BOTTLENECKS,
    OFFLOAD_CODES,
    RECOMPUTE_CODES,
    BatchEstimate,
    Candidates,
    DeviceTable,
    FloatArray,
    ModelShape,
    TrainShape,
    uses_dropout,
)

__all__ = [
    "BOTTLENECKS",
    "OFFLOAD_CODES",
    "RECOMPUTE_CODES",
    "BatchEstimate",
    "Candidates",
    "DeviceTable",
    "ModelShape",
    "TrainShape",
    "cross_group_sync_s",
    "estimate_batch",
    "uses_dropout",
]


def estimate_batch(
    model: ModelShape,
    train: TrainShape,
    devices: DeviceTable,
    candidates: Candidates,
) -> BatchEstimate:
    """Estimate N candidate groups at once (see the module docstring for what a candidate is).

    Args:
        model: from ``ModelShape.from_spec(load_model(...))``.
        train: shared settings (sequence length, precision, schedule, LoRA).
        devices: accelerator table; ``candidates.accelerator`` indexes its rows.
        candidates: N candidate groups (tp must divide heads and KV heads and tp <= devices_per_node:
            the caller filters; invalid rows give ``fits=False`` rather than an exception).

    Returns:
        A :class:`BatchEstimate` of ``(N,)`` arrays. ``micro_batch`` is taken as given (the planner
        enumerates it); pick the fastest row among those with ``fits``.
    """
    return evaluate_uniform(model, train, devices, candidates)


def cross_group_sync_s(param_bytes: FloatArray | float, num_groups: int, cross_group_gbps: float) -> FloatArray:
    """Exposed time of the gradient all-reduce between ``num_groups`` groups (one ring over the
    cross-group links at ``cross_group_gbps`` per node, ring all-reduce volume 2(n-1)/n).

    ``param_bytes`` is the gradient bytes each group contributes (per pipeline stage when stages sync
    in parallel). Zero for a single group.
    """
    n = max(int(num_groups), 1)
    return ring_allreduce_s(np.asarray(param_bytes, dtype=np.float64), n, cross_group_gbps / 8.0)
