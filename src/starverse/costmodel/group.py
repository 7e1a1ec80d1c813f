"""Composing stage rows into a group's step (shared by the scalar and the batch estimator)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from starverse.costmodel import constants as C
from starverse.costmodel.stage import ModelNumbers, StageRows, pipeline_step, stage_costs

if TYPE_CHECKING:  # pragma: no cover
    from starverse.costmodel.batch import BatchEstimate, Candidates, DeviceTable, ModelShape, TrainShape

FloatArray = npt.NDArray[np.float64]

PART_NAMES = ("compute", "memory", "tp_comm", "dp_comm", "pp_comm", "pipeline_bubble")
"""Order of the step-time parts (same as ``batch.BOTTLENECKS``)."""


def adapter_params_per_layer(shape: ModelShape, rank: int) -> float:
    """LoRA parameters of one layer: r*(in+out) for every linear (attention and MLP, all experts)."""
    h, q = shape.hidden_size, shape.num_heads * shape.head_dim
    kv = shape.num_kv_heads * shape.head_dim
    f = shape.ffn_hidden_size
    attn = (h + q) + 2 * (h + kv) + (q + h)
    mlp = (3 if shape.gated_mlp else 2) * (h + f) * max(shape.num_experts, 1)
    return float(rank * (attn + mlp))


def model_numbers(shape: ModelShape, train: TrainShape) -> ModelNumbers:
    """Scalars for :func:`stage_costs`."""
    return ModelNumbers(
        h=float(shape.hidden_size),
        q_dim=float(shape.num_heads * shape.head_dim),
        kv_dim=float(shape.num_kv_heads * shape.head_dim),
        head_dim=float(shape.head_dim),
        ffn=float(shape.ffn_hidden_size),
        vocab=float(shape.vocab_size),
        gated=shape.gated_mlp,
        num_experts=float(shape.num_experts),
        top_k=float(shape.experts_per_token if shape.num_experts > 0 else 1),
        tie=shape.tie_embeddings,
        rope=shape.rope,
        dropout=shape.dropout,
        num_layers=float(shape.num_layers),
        params_per_layer=float(shape.params_per_layer),
        active_params_per_layer=float(shape.active_params_per_layer),
        embedding_params=float(shape.embedding_params),
        lm_head_params=float(shape.lm_head_params),
        adapter_params_per_layer=adapter_params_per_layer(shape, train.lora_rank),
        seq_len=float(train.seq_len),
        bytes_per_value=C.BYTES_PER_VALUE[train.precision],
        mode=train.mode,
        schedule=train.schedule,
        virtual_stages=float(train.virtual_stages),
    )


def combine(
    mn: ModelNumbers,
    costs: dict[str, FloatArray],
    present: FloatArray,
    count: FloatArray,
    pp: FloatArray,
    m: FloatArray,
) -> dict[str, FloatArray]:
    """Combine per-stage costs of shape (S, N) into per-group results of shape (N,).

    ``count[i, j]`` says how many real stages row i stands for in group j (0 = absent); the scalar path
    passes one row per stage with count 1, the batch path a few representative rows.
    """
    mask = present > 0
    neg = np.where(mask, costs["stage_mb"], -np.inf)
    slowest = np.argmax(neg, axis=0)[None, :]

    def at_slowest(key: str) -> FloatArray:
        return np.asarray(np.take_along_axis(costs[key], slowest, axis=0)[0], dtype=np.float64)

    def worst(key: str) -> FloatArray:
        return np.asarray(np.max(np.where(mask, costs[key], -np.inf), axis=0), dtype=np.float64)

    t_max = at_slowest("stage_mb")
    t_sum = np.sum(count * np.where(mask, costs["stage_mb"], 0.0), axis=0)
    p2p = worst("p2p")
    steady, bubble, pp_comm = pipeline_step(t_max, t_sum, p2p, pp, m, mn.virtual_stages, mn.schedule)
    compute = m * at_slowest("gemm_mb")
    memory = m * at_slowest("elem_mb") + worst("optimizer_s")
    tp_comm = m * at_slowest("tp_mb")
    dp_comm = m * at_slowest("z3_exposed_mb") + worst("dp_exposed_s")
    step = compute + memory + tp_comm + dp_comm + pp_comm + bubble
    # the memory of the worst stage (the one with the largest total)
    worst_mem = np.argmax(np.where(mask, costs["memory_gb"], -np.inf), axis=0)[None, :]

    def at_worst_mem(key: str) -> FloatArray:
        return np.asarray(np.take_along_axis(costs[key], worst_mem, axis=0)[0], dtype=np.float64)

    fits = np.all(~mask | (costs["memory_gb"] <= costs["capacity_gb"]), axis=0)
    parts = np.stack([compute, memory, tp_comm, dp_comm, pp_comm, bubble])
    del steady
    return {
        "step_time_s": step,
        "compute_s": compute,
        "memory_s": memory,
        "tp_comm_s": tp_comm,
        "dp_comm_s": dp_comm,
        "pp_comm_s": pp_comm,
        "bubble_s": bubble,
        "weights_gb": at_worst_mem("weights_gb"),
        "grads_gb": at_worst_mem("grads_gb"),
        "optimizer_gb": at_worst_mem("optimizer_gb"),
        "activations_gb": at_worst_mem("activations_gb"),
        "memory_gb": at_worst_mem("memory_gb"),
        "capacity_gb": at_worst_mem("capacity_gb"),
        "fits": fits,
        "bottleneck": np.argmax(parts, axis=0).astype(np.int64),
    }


def _rows_for(
    devices: DeviceTable, cand: Candidates, layers: FloatArray, first: bool | np.ndarray, last: np.ndarray,
    stage_index: FloatArray,
) -> StageRows:
    k = cand.accelerator
    f = np.float64
    tp = cand.tp.astype(f)
    pp = cand.pp.astype(f)
    n = len(cand)
    return StageRows(
        peak_tflops=devices.peak_tflops[k],
        gemm_efficiency=devices.gemm_efficiency[k],
        memory_gb=devices.memory_gb[k],
        memory_bw_gb_per_s=devices.memory_bw_gb_per_s[k],
        intra_node_gb_per_s=devices.intra_node_gb_per_s[k],
        devices_per_node=devices.devices_per_node[k].astype(f),
        inter_node_gbps=devices.inter_node_gbps[k],
        tp=tp,
        layers=layers,
        first=np.broadcast_to(np.asarray(first, dtype=np.bool_), (n,)),
        last=np.broadcast_to(np.asarray(last, dtype=np.bool_), (n,)),
        stage_index=stage_index,
        pp=pp,
        replicas=cand.replicas.astype(f),
        micro_batch=cand.micro_batch.astype(f),
        num_micro_batches=cand.num_micro_batches.astype(f),
        zero_stage=cand.zero_stage.astype(f),
        recompute=cand.recompute.astype(f),
        offload=cand.offload.astype(f),
        sequence_parallel=cand.sequence_parallel,
        pipeline_devices=tp * pp,
    )


def evaluate_uniform(model: ModelShape, train: TrainShape, devices: DeviceTable, cand: Candidates) -> BatchEstimate:
    """The batch estimator: 4 representative stage rows per candidate (first, heavier middle, lighter
    middle, last) weighted by how many stages each stands for."""

    mn = model_numbers(model, train)
    f = np.float64
    L = float(model.num_layers)
    pp = cand.pp.astype(f)
    base = np.floor(L / pp)
    rem = L - base * pp  # the first `rem` stages take one layer more
    single = pp <= 1
    ones = np.ones(len(cand), dtype=f)
    zeros = np.zeros(len(cand), dtype=f)
    # rows: first stage, middle stages with base+1 layers, middle stages with base layers, last stage
    n_heavy_mid = np.clip(rem - 1.0, 0.0, np.maximum(pp - 2.0, 0.0))
    n_light_mid = np.maximum(pp - 2.0 - n_heavy_mid, 0.0)
    specs = [
        (np.where(rem > 0, base + 1.0, base), True, single, zeros, ones),
        (base + 1.0, False, np.zeros(len(cand), bool), ones, n_heavy_mid),
        (base, False, np.zeros(len(cand), bool), np.maximum(rem, 1.0), n_light_mid),
        (base, False, np.ones(len(cand), bool), pp - 1.0, np.where(single, 0.0, 1.0)),
    ]
    per_row = [stage_costs(mn, _rows_for(devices, cand, lay, fi, la, idx)) for lay, fi, la, idx, _ in specs]
    costs = {key: np.stack([r[key] for r in per_row]) for key in per_row[0]}
    count = np.stack([c for *_, c in specs])
    out = combine(mn, costs, count, count, pp, cand.num_micro_batches.astype(f))
    return finish(mn, out, devices, cand, train.seq_len)


def finish(mn: ModelNumbers, out: dict[str, FloatArray], devices: DeviceTable, cand: Candidates,
           seq_len: int) -> BatchEstimate:
    """Throughput, utilisation, power and cost of uniform groups."""
    from starverse.costmodel.batch import BatchEstimate

    k = cand.accelerator
    num_devices = cand.num_devices
    tokens = cand.sequences_per_step.astype(np.float64) * seq_len
    tokens_per_s = tokens / out["step_time_s"]
    model_tflops = mn.model_flops_per_token() * tokens_per_s / num_devices / 1e12
    return BatchEstimate(
        step_time_s=out["step_time_s"],
        compute_s=out["compute_s"],
        memory_s=out["memory_s"],
        tp_comm_s=out["tp_comm_s"],
        pp_comm_s=out["pp_comm_s"],
        dp_comm_s=out["dp_comm_s"],
        bubble_s=out["bubble_s"],
        weights_gb=out["weights_gb"],
        grads_gb=out["grads_gb"],
        optimizer_gb=out["optimizer_gb"],
        activations_gb=out["activations_gb"],
        memory_gb=out["memory_gb"],
        capacity_gb=out["capacity_gb"],
        fits=out["fits"],
        tokens_per_s=tokens_per_s,
        model_tflops_per_device=model_tflops,
        mfu=model_tflops / devices.peak_tflops[k],
        power_kw=num_devices * devices.tdp_w[k] / 1000.0,
        cost_per_hour=num_devices * devices.price_per_hour[k],
        bottleneck=out["bottleneck"],
        num_devices=num_devices,
    )
