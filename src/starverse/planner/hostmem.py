"""Host memory that CPU offload needs, per node, and whether the pool's nodes have it.

ZeRO-Offload (Ren et al. 2021, §4) keeps on the host, per trainable parameter of the device's shard, the
fp32 master weight and the two Adam moments (12 B; 8 B when training in fp32, where the weights are the
master copy) and the gradients copied down for the CPU optimizer step (one value each); ZeRO-Infinity's
``optimizer+params`` also keeps the device's share of the weights there. A node holds ``devices_per_node``
devices, each with its own shard, so the node needs that many shards (the worst stage's, conservatively).

The same function serves the search (arrays over options, even layer split) and a concrete plan (its
stages), so the vectorised search and the reported plan agree.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

from starverse.costmodel.batch import OFFLOAD_CODES, ModelShape, TrainShape
from starverse.costmodel.constants import BYTES_PER_VALUE, QLORA_BYTES_PER_PARAM
from starverse.costmodel.group import adapter_params_per_layer
from starverse.costmodel.memory import optimizer_state_bytes
from starverse.plan import Plan

FloatArray = npt.NDArray[np.float64]

HOST_USABLE_FRACTION = 0.9
"""Share of a node's RAM that offloaded state may take: the rest is left to the OS, the page cache, pinned
transfer buffers and the data loader (an assumption, stated here rather than hidden in a figure)."""


def host_gb_per_device(model: ModelShape, train: TrainShape, layers: FloatArray, first: FloatArray,
                       last: FloatArray, tp: FloatArray, pp: FloatArray, replicas: FloatArray,
                       zero_stage: FloatArray, offload: FloatArray) -> FloatArray:
    """Host GB one device's offloaded state takes, for a stage of ``layers`` layers (vectorised; 0 where
    nothing is offloaded). ``first``/``last``: the stage holds the embedding / the LM head."""
    bv = BYTES_PER_VALUE[train.precision]
    tie = float(model.tie_embeddings) * (np.asarray(pp) > 1)
    params = (layers * model.params_per_layer + first * model.embedding_params
              + last * (model.lm_head_params + model.embedding_params * tie)) / tp
    if train.mode == "full":
        trainable = params
    else:
        trainable = layers * adapter_params_per_layer(model, train.lora_rank, tp)
    base_bytes = QLORA_BYTES_PER_PARAM if train.mode == "qlora" else bv
    shard_o = np.where(zero_stage >= 1, replicas, 1.0)
    shard_w = np.where(zero_stage >= 3, replicas, 1.0)
    opt_bytes = optimizer_state_bytes(train.optimizer, bv)
    state = np.where(offload >= 1, trainable / shard_o * (opt_bytes + bv), 0.0)
    weights = np.where(offload >= 2, params * base_bytes / shard_w, 0.0)
    return np.asarray((state + weights) / 1e9, dtype=np.float64)


def uniform_host_gb_per_node(model: ModelShape, train: TrainShape, tp: npt.ArrayLike, pp: npt.ArrayLike,
                             replicas: npt.ArrayLike, zero_stage: npt.ArrayLike, offload: npt.ArrayLike,
                             devices_per_node: npt.ArrayLike) -> FloatArray:
    """Host GB per node of groups with the layers split evenly over ``pp`` stages (the first ``L % pp``
    stages one layer more): the worse of the first and the last stage, times the devices of one node."""
    tp_a, pp_a, r, z, off = (np.asarray(x, dtype=np.float64) for x in (tp, pp, replicas, zero_stage, offload))
    base, extra = np.divmod(float(model.num_layers), pp_a)
    first_layers = base + (extra > 0)
    last_layers = base  # the extra layers go to the first stages
    one = np.ones_like(pp_a)
    single = pp_a <= 1
    first = host_gb_per_device(model, train, first_layers, one, np.where(single, 1.0, 0.0), tp_a, pp_a, r, z, off)
    last = host_gb_per_device(model, train, last_layers, np.where(single, 1.0, 0.0), one, tp_a, pp_a, r, z, off)
    per_device = np.maximum(first, np.where(single, 0.0, last))
    on_node = np.minimum(np.asarray(devices_per_node, dtype=np.float64), tp_a * pp_a * r)
    return np.asarray(per_device * on_node, dtype=np.float64)


def host_ok(need_gb: FloatArray, host_memory_gb: FloatArray) -> npt.NDArray[np.bool_]:
    """Offloaded state fits the usable share of the node's RAM (a node of unknown RAM fits nothing)."""
    cap = np.where(np.isnan(host_memory_gb), 0.0, host_memory_gb) * HOST_USABLE_FRACTION
    return np.asarray((need_gb <= 0.0) | (need_gb <= cap), dtype=np.bool_)


def plan_host_gb_per_node(plan: Plan, spec: object, devices_per_node: Mapping[str, int]) -> dict[str, float]:
    """Host GB each node of each accelerator of ``plan`` needs (0 when nothing is offloaded)."""
    model = ModelShape.from_spec(spec)
    train = TrainShape.from_train(plan.train)
    off = float(OFFLOAD_CODES[plan.train.offload])
    z = float(plan.train.zero_stage)
    out: dict[str, float] = {}
    for g in plan.groups:
        stages = g.expanded_stages()
        n = len(stages)
        for i, s in enumerate(stages):
            gb = float(host_gb_per_device(
                model, train, np.asarray(float(s.layers)), np.asarray(float(i == 0)), np.asarray(float(i == n - 1)),
                np.asarray(float(s.tp)), np.asarray(float(n)), np.asarray(float(g.replicas)), np.asarray(z),
                np.asarray(off)))
            dpn = devices_per_node.get(s.accelerator, 1)
            on_node = min(dpn, math.prod((s.tp, g.replicas)) * sum(1 for x in stages if x.accelerator == s.accelerator))
            out[s.accelerator] = max(out.get(s.accelerator, 0.0), gb * on_node)
    return out
