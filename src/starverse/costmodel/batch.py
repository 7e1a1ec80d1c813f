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
  each group's ``step_time_s`` for its own batch share, the plan's step time is the largest group time plus
  that group's :func:`joint_sync_s` (what the one gradient ring over every group's replicas costs beyond the
  group's own ring, which its ``step_time_s`` already holds).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from starverse.costmodel.comm import ring_allreduce_s
from starverse.costmodel.constants import GRADIENT_BUCKET_BYTES, NETWORK_EFFICIENCY
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
    "joint_sync_s",
    "sharded_sync_s",
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


def sharded_sync_s(stage_bytes: float, replicas: Sequence[float], devices_per_node: Sequence[float],
                   cross_group_gbps: float) -> FloatArray:
    """Per group: extra step time of the gradient sync between groups whose replicas shard the gradients
    (ZeRO-2/3 inside each group): the group's own reduce-scatter (in its step) leaves each rank ``1/replicas`` of
    ``stage_bytes``, and only that shard is all-reduced across the groups, one ring per shard index over one rank
    of each group; every rank of a node sends its shard at once, so each gets ``1/devices_per_node`` of the node's
    cross-group link (``cross_group_gbps`` at the network efficiency). This is how XLA reduces a parameter sharded
    over a TPU slice and replicated over slices (MaxText's FSDP over ICI, data parallelism over DCN), PyTorch FSDP's
    ``HYBRID_SHARD``, and the runtime's sharded replicas (each shard all-reduced across torchft replicas); a
    framework with one ring over every rank (DeepSpeed, Megatron; ZeRO 0-1): :func:`joint_sync_s`. Zeros for a
    single group."""
    r = np.asarray(replicas, dtype=np.float64)
    if r.shape[0] <= 1:
        return np.zeros(r.shape, dtype=np.float64)
    shard = stage_bytes / np.maximum(r, 1.0)
    bus = cross_group_gbps / 8.0 * NETWORK_EFFICIENCY / np.maximum(np.asarray(devices_per_node, dtype=np.float64), 1.0)
    count = np.maximum(np.ceil(shard / GRADIENT_BUCKET_BYTES), 1.0)
    return ring_allreduce_s(shard, float(r.shape[0]), bus, count)


def joint_sync_s(stage_bytes: float, replicas: Sequence[float], bus_gb_per_s: Sequence[float],
                 share: Sequence[float], cross_group_gbps: float) -> FloatArray:
    """Per group: extra step time of the data-parallel gradient all-reduce when several groups replicate
    the same stages; the step is the largest ``group step time + extra``.

    DeepSpeed and Megatron reduce a stage's gradients in ONE process group over all its data-parallel ranks,
    whatever accelerator they sit on (NCCL ring; AMP's own cost model charges the same: a ring of all ``dp``
    ranks at the slowest link on it, ``dp_cost`` in DachengLi1/AMP src/cost_het_cluster.py). So every group
    waits for ``ring(sum replicas)`` at the slowest edge of that ring: each group's own ring bus
    (``bus_gb_per_s``, :func:`~starverse.costmodel.comm.dp_ring_bus`) and the link between groups
    (``cross_group_gbps`` per node at the network efficiency, of which a ring gets its NIC ``share``),
    instead of its own ring over ``replicas[g]`` ranks that its step time already holds: the extra is the
    joint ring minus that own ring. With one replica per group and full share it is the ring of
    ``len(replicas)`` ranks over the link. ``stage_bytes``: gradient bytes one ring reduces (one stage's
    shard of one TP rank; stages and TP ranks sync in parallel). Zeros for a single group."""
    r = np.asarray(replicas, dtype=np.float64)
    if r.shape[0] <= 1:
        return np.zeros(r.shape, dtype=np.float64)
    own_bus = np.asarray(bus_gb_per_s, dtype=np.float64)
    cross = cross_group_gbps / 8.0 * NETWORK_EFFICIENCY * np.asarray(share, dtype=np.float64)
    ring_bus = float(min(own_bus.min(), cross.min()))
    count = max(np.ceil(stage_bytes / GRADIENT_BUCKET_BYTES), 1.0)
    joint = ring_allreduce_s(stage_bytes, float(r.sum()), ring_bus, count)
    own = ring_allreduce_s(stage_bytes, r, own_bus, count)
    return np.asarray(np.maximum(joint - own, 0.0), dtype=np.float64)
