"""Composing stage rows into a group's step (shared by the scalar and the batch estimator)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from starverse.costmodel import constants as C
from starverse.costmodel.rows import ModelNumbers, StageRows
from starverse.costmodel.shapes import BatchEstimate, Candidates, DeviceTable, ModelShape, TrainShape
from starverse.costmodel.stage import layer_costs, pipeline_step, stage_totals

FloatArray = npt.NDArray[np.float64]

PART_NAMES = ("compute", "memory", "tp_comm", "dp_comm", "pp_comm", "pipeline_bubble")
"""Order of the step-time parts (same as ``batch.BOTTLENECKS``)."""


def adapter_params_per_layer(shape: ModelShape, rank: int, tp: float | FloatArray = 1.0) -> float | FloatArray:
    """LoRA parameters one device holds of a layer: r*(in+out) for every linear (attention and MLP, all experts).

    Under tensor parallelism ``tp`` each adapter is split with its linear, as the runtime does
    (``runtime/parallel/tensor.py``): a column-split linear (q, k, v, gate, up) splits its ``B`` (out/tp x r) and
    keeps ``A`` (r x hidden) whole; a row-split one (o, down) splits ``A`` (r x in/tp) and keeps ``B`` whole. So
    the hidden-size side of every adapter is held whole on each TP rank and only the other side is divided.
    """
    whole, split = adapter_sides(shape)
    return rank * (whole + split / tp)


def adapter_sides(shape: ModelShape) -> tuple[float, float]:
    """Per layer and per unit of LoRA rank: (the hidden-size sides of the adapters, which TP keeps whole; the
    other sides, which TP splits)."""
    h, q = shape.hidden_size, shape.num_heads * shape.head_dim
    kv = shape.num_kv_heads * shape.head_dim
    linears_mlp = 3 if shape.gated_mlp else 2
    experts = max(shape.num_experts, 1)
    return float(h * (4 + linears_mlp * experts)), float((q + 2 * kv + q) + linears_mlp * shape.ffn_hidden_size * experts)


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
        tie=shape.tie_embeddings and shape.lm_head,
        rope=shape.rope,
        dropout=shape.dropout,
        attention_dropout=shape.attention_dropout,
        relu=shape.relu,
        parallel_block=shape.parallel_block,
        head=shape.lm_head,
        attention=train.attention,
        num_layers=float(shape.num_layers),
        params_per_layer=float(shape.params_per_layer),
        active_params_per_layer=float(shape.active_params_per_layer),
        embedding_params=float(shape.embedding_params),
        lm_head_params=float(shape.lm_head_params),
        adapter_params_per_layer=float(adapter_params_per_layer(shape, train.lora_rank)),
        adapter_whole_per_layer=train.lora_rank * adapter_sides(shape)[0],
        seq_len=float(train.seq_len),
        bytes_per_value=C.BYTES_PER_VALUE[train.precision],
        grad_bytes_per_value=4.0 if train.grad_reduce_fp32 else C.BYTES_PER_VALUE[train.precision],
        gemm_operand_bytes=C.GEMM_OPERAND_BYTES.get(train.precision, 0.0),
        mode=train.mode,
        schedule=train.schedule,
        virtual_stages=float(train.virtual_stages),
        sync_micro_steps=train.sync_micro_steps,
        recompute_early_stop=train.recompute_early_stop,
        extra_forwards=float(train.num_layer_forwards - 1),
        softmax_fusion=train.softmax_fusion,
        overlap_grad_reduce=train.overlap_grad_reduce,
        flat_grad_allreduce=train.flat_grad_allreduce,
        fp32_grad_copy=train.fp32_grad_copy,
        pipe_buffers_keep_outputs=train.pipe_buffers_keep_outputs,
        tp_comm_overlap=train.tp_comm_overlap,
        overlap_p2p_comm=train.overlap_p2p_comm,
        optimizer=train.optimizer,
    )


def combine(
    mn: ModelNumbers,
    costs: list[dict[str, FloatArray]],
    count: list[FloatArray],
    pp: FloatArray,
    m: FloatArray,
) -> dict[str, np.ndarray]:
    """Combine per-stage costs (one dict of (N,) arrays per stage row) into per-group results (N,).

    ``count[i][j]`` says how many real stages row i stands for in group j (0 = absent); the scalar path
    passes one row per stage with count 1, the batch path a few representative rows.
    """
    present = [c > 0 for c in count]
    # the slowest present stage sets the pace; ties keep the first row (same rule on both paths)
    t_max = np.where(present[0], costs[0]["stage_mb"], -np.inf)
    slow = np.zeros(t_max.shape, dtype=np.int64)
    t_sum = np.where(present[0], count[0] * costs[0]["stage_mb"], 0.0)
    for i in range(1, len(costs)):
        cand = np.where(present[i], costs[i]["stage_mb"], -np.inf)
        better = cand > t_max
        t_max = np.where(better, cand, t_max)
        slow = np.where(better, i, slow)
        t_sum = t_sum + np.where(present[i], count[i] * costs[i]["stage_mb"], 0.0)

    def pick(idx: np.ndarray, key: str) -> FloatArray:
        out = costs[0][key]
        for i in range(1, len(costs)):
            out = np.where(idx == i, costs[i][key], out)
        return np.asarray(out, dtype=np.float64)

    def worst(key: str) -> FloatArray:
        out = np.where(present[0], costs[0][key], -np.inf)
        for i in range(1, len(costs)):
            out = np.maximum(out, np.where(present[i], costs[i][key], -np.inf))
        return np.asarray(out, dtype=np.float64)

    _, bubble, pp_comm = pipeline_step(t_max, t_sum, worst("p2p"), pp, m, mn.virtual_stages, mn.schedule,
                                        mn.overlap_p2p_comm)
    compute = m * pick(slow, "gemm_mb")
    memory = m * pick(slow, "elem_mb") + worst("optimizer_s")
    tp_comm = m * pick(slow, "tp_mb")
    dp_comm = m * pick(slow, "z3_exposed_mb") + worst("dp_exposed_s") + worst("tied_s")
    step = compute + memory + tp_comm + dp_comm + pp_comm + bubble

    # memory: the stage with the least headroom
    head = np.where(present[0], costs[0]["memory_gb"] - costs[0]["capacity_gb"], -np.inf)
    tight = np.zeros(head.shape, dtype=np.int64)
    for i in range(1, len(costs)):
        cand = np.where(present[i], costs[i]["memory_gb"] - costs[i]["capacity_gb"], -np.inf)
        better = cand > head
        head = np.where(better, cand, head)
        tight = np.where(better, i, tight)
    parts = np.stack([compute, memory, tp_comm, dp_comm, pp_comm, bubble])
    return {
        "step_time_s": step,
        "compute_s": compute,
        "memory_s": memory,
        "tp_comm_s": tp_comm,
        "dp_comm_s": dp_comm,
        "pp_comm_s": pp_comm,
        "bubble_s": bubble,
        "weights_gb": pick(tight, "weights_gb"),
        "grads_gb": pick(tight, "grads_gb"),
        "optimizer_gb": pick(tight, "optimizer_gb"),
        "activations_gb": pick(tight, "activations_gb"),
        "memory_gb": pick(tight, "memory_gb"),
        "capacity_gb": pick(tight, "capacity_gb"),
        "fits": head <= 0.0,
        "bottleneck": np.argmax(parts, axis=0).astype(np.int64),
    }


def _measured(devices: DeviceTable, cand: Candidates, train: TrainShape) -> dict[str, FloatArray]:
    """Measured times of the candidates whose offer has a profile entry at their micro-batch, sequence length,
    TP and precision (NaN elsewhere); empty without profiles. A table over (offer, TP, micro-batch) filled
    from the profiles' entries, then one gather: the cost does not grow with the entries per candidate."""
    if devices.profiles is None:
        return {}
    k = cand.accelerator
    tp = cand.tp.astype(np.int64)
    mb = cand.micro_batch.astype(np.int64)
    table = np.full((len(devices.profiles), int(tp.max()) + 1, int(mb.max()) + 1, 4), np.nan)
    for ki, prof in enumerate(devices.profiles):
        if prof is None:
            continue
        if prof.optimizer_s_per_param is not None:
            table[ki, :, :, 3] = prof.optimizer_s_per_param
        for e in reversed(prof.entries):  # the first entry of a key wins, as in ModelProfile.entry
            if (e.seq_len, e.precision) == (train.seq_len, train.precision) and e.tp < table.shape[1] \
                    and e.micro_batch < table.shape[2]:
                table[ki, e.tp, e.micro_batch, :3] = (e.layer_forward_s + e.layer_backward_s, e.layer_forward_s,
                                                      e.head_forward_s + e.head_backward_s)
    vals = table[k, tp, mb]
    names = ("measured_layer_s", "measured_layer_forward_s", "measured_head_s", "measured_optimizer_s_per_param")
    return {name: vals[:, j] for j, name in enumerate(names)}


def measured_times(devices: DeviceTable, cand: Candidates, train: TrainShape) -> dict[str, FloatArray]:
    """The measured-profile fields of :class:`~starverse.costmodel.rows.StageRows` for ``cand`` (empty without
    profiles): the same lookup the batch estimator applies, for callers that build their own stage rows (the
    planner's heterogeneous pipelines)."""
    return _measured(devices, cand, train)


def attention_rates(devices: DeviceTable, attention: str, k: np.ndarray) -> FloatArray | None:
    """The rows' attention-core TFLOP/s for ``train.attention`` (``flash2``: FlashAttention-2's)."""
    rates = devices.attention_tflops
    if attention == "flash2" and devices.flash2_attention_tflops is not None:
        rates = devices.flash2_attention_tflops
    return None if rates is None else rates[k]


def _rows_for(
    devices: DeviceTable, cand: Candidates, layers: FloatArray, first: bool | np.ndarray, last: np.ndarray,
    stage_index: FloatArray, measured: dict[str, FloatArray] | None = None, attention: str = "auto",
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
        intra_node_gb_per_s=devices.intra_node_at(k, cand.tp),
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
        attention_tflops=attention_rates(devices, attention, k),
        flash_attention=(np.ones(n, dtype=np.bool_) if devices.flash_attention is None
                         else devices.flash_attention[k]),
        host_collectives=None if devices.host_collectives is None else devices.host_collectives[k],
        compiled_memory=None if devices.compiled_memory is None else devices.compiled_memory[k],
        matrix_unit=None if devices.matrix_unit is None else devices.matrix_unit[k],
        **(measured or {}),
    )


def evaluate_uniform(model: ModelShape, train: TrainShape, devices: DeviceTable, cand: Candidates) -> BatchEstimate:
    """The batch estimator: layer costs once per candidate, then 4 representative stage rows (first,
    heavier middle, lighter middle, last) weighted by how many stages each stands for."""
    mn = model_numbers(model, train)
    f = np.float64
    n = len(cand)
    L = float(model.num_layers)
    pp = cand.pp.astype(f)
    base = np.floor(L / pp)
    rem = L - base * pp  # the first `rem` stages take one layer more
    single = pp <= 1
    no = np.zeros(n, dtype=np.bool_)
    n_heavy_mid = np.clip(rem - 1.0, 0.0, np.maximum(pp - 2.0, 0.0))
    n_light_mid = np.maximum(pp - 2.0 - n_heavy_mid, 0.0)
    first_layers = np.where(rem > 0, base + 1.0, base)
    rows = _rows_for(devices, cand, first_layers, True, single, np.zeros(n), _measured(devices, cand, train),
                     train.attention)
    lc = layer_costs(mn, rows)
    specs = [
        (first_layers, np.ones(n, dtype=np.bool_), single, np.zeros(n), np.ones(n)),
        (base + 1.0, no, no, np.ones(n), n_heavy_mid),
        (base, no, no, np.maximum(rem, 1.0), n_light_mid),
        (base, no, ~no, pp - 1.0, np.where(single, 0.0, 1.0)),
    ]
    costs = [stage_totals(mn, rows, lc, lay, fi, la, idx) for lay, fi, la, idx, _ in specs]
    out = combine(mn, costs, [c for *_, c in specs], pp, cand.num_micro_batches.astype(f))
    return finish(mn, out, devices, cand, train.seq_len)


def finish(mn: ModelNumbers, out: dict[str, np.ndarray], devices: DeviceTable, cand: Candidates,
           seq_len: int) -> BatchEstimate:
    """Throughput, utilisation, power and cost of uniform groups."""
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
