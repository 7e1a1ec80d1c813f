"""The one implementation of the cost model: per-stage costs over arrays of stage rows, and their
composition into a pipeline step.

A *stage row* is one pipeline stage of one group (an accelerator, a TP degree, a number of layers, its
position in the pipeline, the group's batch and memory settings). Both the scalar ``estimate()`` (one row
per real stage) and the planner's ``estimate_batch()`` (a few representative rows per candidate) call
:func:`stage_costs` and :func:`pipeline_step`, so they agree by construction.

Notation: b micro-batch, s sequence, T = b*s tokens, h hidden, t TP degree, p pipeline stages,
m micro-batches per replica per step, n data-parallel replicas, L layers on the stage.
"""

from __future__ import annotations

import numpy as np

from starverse.costmodel import constants as C
from starverse.costmodel.comm import (
    collective_latency_s,
    dp_ring_bus,
    dp_ring_members,
    group_bus_gb_per_s,
    nccl_latency_s,
    ring_allreduce_s,
)
from starverse.costmodel.matmul import gemm_time_s
from starverse.costmodel.memory import held_parameters, layer_activations, loss_width, stage_memory
from starverse.costmodel.rows import BoolArray, FloatArray, ModelNumbers, StageRows, compiled


def _f(x: object) -> FloatArray:
    return np.asarray(x, dtype=np.float64)


def attention_is_eager(mn: ModelNumbers, rows: StageRows) -> BoolArray:
    """Rows that run unfused attention: all for ``eager``, none for ``flash``, and for ``auto`` the
    accelerators without a fused attention kernel (``StageRows.flash_attention``)."""
    if mn.attention == "eager":
        return np.ones(rows.tp.shape, dtype=np.bool_)
    if mn.attention in ("flash", "flash2"):
        return np.zeros(rows.tp.shape, dtype=np.bool_)
    return np.asarray(~rows.flash_attention, dtype=np.bool_)


def _softmax_batches_per_block(row_len: FloatArray) -> FloatArray:
    """Rows of scores one CUDA block of Megatron's warp softmax kernels handles for rows of ``row_len`` keys
    (``get_batch_per_block`` in megatron/fused_kernels/scaled_masked_softmax.h): 128 threads, a warp of
    min(next power of two, 32) lanes per row, 2 rows per warp up to 128 keys."""
    pow2 = np.exp2(np.ceil(np.log2(np.maximum(row_len, 1.0))))
    return np.asarray(128.0 / np.minimum(pow2, 32.0) * np.where(pow2 <= 128.0, 2.0, 1.0), dtype=np.float64)


def fused_softmax_runs(mn: ModelNumbers, rows: StageRows) -> BoolArray:
    """Rows whose eager attention gets Megatron's fused causal softmax kernel (``train.softmax_fusion``;
    ``FusedScaleMaskSoftmax.is_kernel_available``): true everywhere for ``always``. Else the kernel needs
    16 < s <= its longest row (4096; 2048 in bigscience's 2022 fork), s % 4 == 0 and the score batches
    (micro-batch x heads per TP rank) divisible by 4 and by the batches per block — which the 2022 fork computed
    from the heads per rank in place of the sequence (arguments passed out of order), so that e.g. 26 heads per
    rank at micro-batch 2 (52 batches, 8 per block) or 8 heads at micro-batch 2 (16 batches, 32 per block) fell
    back to the torch softmax while 16 heads x 2 (32, 16 per block) did not. ``unfused-fp16``: nowhere."""
    if mn.softmax_fusion == "always":
        return np.ones(rows.tp.shape, dtype=np.bool_)
    if mn.softmax_fusion == "unfused-fp16":
        return np.zeros(rows.tp.shape, dtype=np.bool_)
    s = mn.seq_len
    heads = np.rint(mn.q_dim / mn.head_dim / rows.tp)
    batches = rows.micro_batch * heads
    bsc = mn.softmax_fusion == "megatron-bsc-2022"
    longest = 2048.0 if bsc else 4096.0
    per_block = _softmax_batches_per_block(heads if bsc else np.full_like(heads, s))
    ok = (16.0 < s <= longest) and s % 4.0 == 0.0
    return np.asarray(ok & (np.mod(batches, 4.0) == 0.0) & (np.mod(batches, per_block) == 0.0), dtype=np.bool_)


def forwards_again(mn: ModelNumbers, rows: StageRows) -> FloatArray:
    """Forwards of each layer per micro-batch beyond the one whose activations backward uses: the recomputed
    one under full recompute and any extra forward the framework runs (``ModelNumbers.extra_forwards``:
    AMP's Megatron-LM 1.1.5 runs every layer twice). They cost the forward's compute, TP collectives and
    kernel launches again, not stored activations."""
    return np.asarray((rows.recompute == 2).astype(np.float64) + mn.extra_forwards, dtype=np.float64)


def eager_score_bytes(mn: ModelNumbers, rows: StageRows, rc_any: FloatArray) -> FloatArray:
    """HBM bytes per s x s score element of one layer and micro-batch that eager attention's softmax and dropout
    move, forward (each forward run: the first, a recomputed one, AMP's second) and backward. 16-bit scores: the
    passes of the path the softmax takes (``constants.SOFTMAX_PASS_BYTES``: Megatron's fused causal kernel, or
    the torch fallback where ``train.softmax_fusion`` says the kernel does not run) and of dropout
    (``EAGER_DROPOUT_SCORE_BYTES`` each way); the score GEMMs' own bytes are in their roofline. fp32 scores keep
    the earlier per-score accounting (``constants.EAGER_SCORE_BYTES``)."""
    runs = 1.0 + rc_any + mn.extra_forwards
    bv = mn.bytes_per_value
    if bv >= 4.0:
        # fp32 scores: the fused softmax kernel is fp16/bf16 only; the torch path scales and masks apart
        value_scale = bv / 2.0
        fwd = C.EAGER_SCORE_BYTES * value_scale + C.EAGER_UNFUSED_SOFTMAX_BYTES + (
            (C.EAGER_DROPOUT_SCORE_BYTES - 1.0) * value_scale + 1.0 if mn.attention_dropout else 0.0)
        return np.asarray(fwd * (runs + C.BACKWARD_ELEMENTWISE_FACTOR) + 0.0 * rows.tp, dtype=np.float64)
    fused_f, fused_b = C.SOFTMAX_PASS_BYTES["fused"]
    torch_f, torch_b = C.SOFTMAX_PASS_BYTES["torch-fp16" if mn.softmax_fusion == "unfused-fp16" else "torch-fp32"]
    fused = fused_softmax_runs(mn, rows)
    dropout = C.EAGER_DROPOUT_SCORE_BYTES if mn.attention_dropout else 0.0
    fwd_b = np.where(fused, fused_f, torch_f) + dropout
    bwd_b = np.where(fused, fused_b, torch_b) + dropout
    return np.asarray(fwd_b * runs + bwd_b, dtype=np.float64)


def layer_costs(mn: ModelNumbers, rows: StageRows) -> dict[str, FloatArray]:
    """Costs that do not depend on where a stage sits or how many layers it holds: per layer, per
    micro-batch, per device (the batch path computes these once per candidate)."""
    bv = mn.bytes_per_value
    t = rows.tp
    # context parallelism: a rank holds 1/cp of each sequence's tokens; its queries attend to all s keys
    tokens = rows.micro_batch * mn.seq_len / mn.cp
    s = mn.seq_len
    h = mn.h
    full_mode = mn.mode == "full"
    rc_full = (rows.recompute == 2).astype(np.float64)
    rc_any = (rows.recompute >= 1).astype(np.float64)
    # matmuls: the block's non-matmul ops run again in its backward (their elementwise bytes, and the TP
    # all-reduces: the runtime's op SAC keeps no collective's output); dots (JAX's policy): the elementwise work
    # again, but no collective: XLA's saved dot outputs are the collectives' results
    rc_mm = (rows.recompute == 3).astype(np.float64)
    rc_dots = (rows.recompute == 4).astype(np.float64)
    rerun = rc_mm + rc_dots  # the block's non-matmul forward runs again
    # JAX's remat (an XLA program) runs again only what the backward reads: under full recompute not the matmuls
    # whose outputs only feed the residual sum (the MLP's down projection; in a parallel block the attention's
    # output projection too), nor their TP reductions (a sequential block rebuilds its mid-layer residual: one
    # all-reduce's time), as XLA's compiled step of scanned layers shows (scripts/jax_saved_residuals.py)
    on_xla = np.asarray(compiled(rows), dtype=np.float64)
    jax_full = rc_full * on_xla
    # PyTorch's non-reentrant checkpoint with early stop (``TrainSpec.recompute_early_stop``) stops at the last
    # tensor the backward saved: in a dense block whose MLP output is not dropped, the down projection's saved
    # input, packed before its GEMM runs; the GEMM and the TP reduction after it are not run again (a parallel
    # block's attention projection runs before the MLP's saved tensors are back, so it is run again). Not with
    # LoRA: the down projection's adapter saves its input after the frozen GEMM has run
    stops_early = mn.recompute_early_stop and mn.num_experts == 0 and not mn.dropout and full_mode
    torch_full = rc_full * (1.0 - on_xla) * float(stops_early)
    fw_again = forwards_again(mn, rows)
    sp = rows.sequence_parallel & (t > 1)

    # ---- matmuls of one layer, forward, per device --------------------------------------------------
    ob = mn.gemm_operand_bytes or bv  # FP8 GEMMs read 1-byte operands (constants.GEMM_OPERAND_BYTES)
    out_proj = gemm_time_s(tokens, _f(h), mn.q_dim / t, rows, bv, operand_bytes=ob)
    g = gemm_time_s(tokens, (mn.q_dim + 2 * mn.kv_dim) / t, _f(h), rows, bv, operand_bytes=ob) + out_proj
    up = (2.0 if mn.gated else 1.0) * mn.ffn / t
    if mn.num_experts > 0:
        per_expert = tokens * mn.top_k / mn.num_experts
        g = g + gemm_time_s(per_expert, up, _f(h), rows, bv, mn.num_experts, ob)
        down = gemm_time_s(per_expert, _f(h), mn.ffn / t, rows, bv, mn.num_experts, ob)
        g = g + down + gemm_time_s(tokens, _f(mn.num_experts), _f(h), rows, bv, operand_bytes=ob)
    else:
        g = g + gemm_time_s(tokens, up, _f(h), rows, bv, operand_bytes=ob)
        down = gemm_time_s(tokens, _f(h), mn.ffn / t, rows, bv, operand_bytes=ob)
        g = g + down
    # the projections whose outputs only feed the residual sum (not run again by JAX's remat: jax_full)
    g_out = down + out_proj if mn.parallel_block else down
    bwd_gemm = 2.0 if full_mode else 1.0  # frozen base weights: no weight gradients
    g_run = g * (1.0 + bwd_gemm + fw_again) - g_out * jax_full - down * torch_full  # the linear GEMMs, every pass
    heads = mn.q_dim / mn.head_dim / t
    bw = rows.memory_bw_gb_per_s * (1e9 * C.MEMORY_BW_EFFICIENCY)
    eager = attention_is_eager(mn, rows)
    # fused causal attention: 2 matmuls of T x s x d per head, lower triangle only; backward recomputes
    # the scores (FlashAttention): 2.5x the forward matmul work
    attn_flops = 4.0 * tokens * (s + 1.0) / 2.0 * mn.q_dim / t
    attn_rate = (rows.peak_tflops * rows.gemm_efficiency if rows.attention_tflops is None
                 else rows.attention_tflops)
    a = attn_flops / (attn_rate * 1e12 * mn.head_dim / (mn.head_dim + C.ATTENTION_HEAD_DIM_HALF))
    # host-side launch time of the layer's kernels (forward, backward, recomputed forward), exposed where
    # the framework synchronises the device per micro-step; counted with the matmuls (a measured profile
    # below includes it)
    host_issue = C.HOST_OVERHEAD_PER_LAYER_S * (1.0 + fw_again / 3.0)
    host = host_issue if mn.sync_micro_steps else 0.0 * rc_full
    gemm_layer = g_run + a * (1.0 + 2.5 + rc_any + mn.extra_forwards) + host
    attn_forward = a  # the attention core's matmuls, one forward
    attn_elem = np.zeros_like(a)
    if eager.any():
        # materialised s x s scores per head: two batched matmuls over the full square (masked after),
        # backward 2x; softmax and dropout make passes over memory (eager_score_bytes)
        ss = _f(s)
        a_e = gemm_time_s(ss / mn.cp, ss, _f(mn.head_dim), rows, bv, 2.0 * rows.micro_batch * heads)
        scores = rows.micro_batch * heads * s * s / mn.cp
        gemm_layer = np.where(eager, g_run + a_e * (1.0 + 2.0 + rc_any + mn.extra_forwards) + host, gemm_layer)
        attn_forward = np.where(eager, a_e, a)
        attn_elem = np.where(eager, scores / bw * eager_score_bytes(mn, rows, rc_any), attn_elem)

    # ---- memory-bound elementwise work of one layer ------------------------------------------------
    # per token, values moved forward: 2 norms (read+write h) and 2 residual adds (read 2, write 1);
    # replicated over TP ranks unless sequence parallel
    rep_values = 10.0 * h
    act_values = (3.0 if mn.gated else 2.0) * mn.ffn * max(mn.top_k, 1.0)
    if mn.rope:
        act_values += 2.0 * (mn.q_dim + mn.kv_dim)
    # attention reads Q, K, V and writes O forward; backward reads Q, K, V, O, dO and writes
    # dQ, dK, dV: on average 2x the forward bytes, the same factor as the other elementwise work
    act_values += 2.0 * (mn.q_dim + mn.kv_dim)
    tp_rep = np.where(sp, t, 1.0)
    fwd_bytes = tokens * bv * (rep_values / tp_rep + act_values / t)
    if mn.mode == "qlora":
        # dequantise the 4-bit base to 16 bit for every use (read 0.5 B, write 2 B per parameter)
        fwd_bytes = fwd_bytes + (mn.params_per_layer / t) * 2.5
    elem_layer = fwd_bytes / bw * (1.0 + C.BACKWARD_ELEMENTWISE_FACTOR + fw_again + rerun) + attn_elem

    # ---- TP collectives of one layer: 2 all-reduces forward, 2 backward (+2 recomputed forward) ----
    # TP ranks are consecutive (Megatron's rank order): a group wider than a node fills each node it spans, so
    # its ring is the only one on those nodes' NICs (NCCL: each channel's ring leaves a node once), not one of
    # devices_per_node rings sharing them
    tp_bus = group_bus_gb_per_s(t, np.minimum(t, rows.devices_per_node), rows.intra_node_gb_per_s,
                                rows.devices_per_node, rows.inter_node_gbps)
    ar = ring_allreduce_s(tokens * (h * bv), t, tp_bus, 1.0, collective_latency_s(rows.host_collectives, True))
    latency = collective_latency_s(rows.host_collectives)
    tp_layer = ar * (4.0 + 2.0 * (fw_again + rc_mm) - jax_full * (2.0 if mn.parallel_block else 1.0) - torch_full)
    if mn.tp_comm_overlap:
        # TP all-gathers / reduce-scatters split into chunks pipelined with the linear layers' GEMMs
        # (Transformer Engine userbuffers; Wang et al. ASPLOS'23 "Overlap communication with dependent
        # computation via decomposition"): exposed only where longer than those GEMMs; while overlapped
        # it still occupies SMs (OVERLAP_SM_FRACTION of its duration, as the overlapped DP collectives)
        tp_layer = np.maximum(tp_layer - g_run, 0.0) + C.OVERLAP_SM_FRACTION * tp_layer
    if mn.cp > 1.0:
        # ring attention (Megatron context parallelism; Liu et al. 2023, "Ring Attention with Blockwise
        # Transformers"): cp - 1 steps pass each rank's K and V chunk around the CP ring forward, K, V and
        # their gradients backward (3x the forward volume), each step overlapped with the attention of the
        # chunk before: exposed only where longer, and occupying SMs while overlapped. CP ranks follow the TP
        # ranks (Megatron rank order tp-cp-dp-pp): the ring stays on the node's links while tp x cp fits a
        # node, else every TP rank's ring crosses the node's NIC at once
        kv = 3.0 * (mn.cp - 1.0) * tokens * 2.0 * mn.kv_dim / t * bv
        on_node = t * mn.cp <= rows.devices_per_node
        link = np.where(on_node & (rows.intra_node_gb_per_s > 0), rows.intra_node_gb_per_s * C.LINK_EFFICIENCY,
                        rows.inter_node_gbps * (C.NETWORK_EFFICIENCY / 8.0) / t)
        kv_s = kv / (link * 1e9) + 3.0 * (mn.cp - 1.0) * C.COLLECTIVE_LATENCY_S
        attn_s = a * (1.0 + 2.5 + rc_any)
        tp_layer = tp_layer + np.maximum(kv_s - attn_s, 0.0) + C.OVERLAP_SM_FRACTION * np.minimum(kv_s, attn_s)

    if not mn.sync_micro_steps:
        # asynchronous launches: the device waits for the host where a layer's work is shorter than the
        # time to issue its kernels (launch-bound small layers and micro-batches)
        gemm_layer = gemm_layer + np.maximum(host_issue - (gemm_layer + elem_layer + tp_layer), 0.0)

    head_gemm = gemm_time_s(tokens, mn.vocab / t, _f(h), rows, bv) * (1.0 + bwd_gemm) * float(mn.head)
    head_elem = tokens * (loss_width(mn, t) * C.CROSS_ENTROPY_BYTES_PER_LOGIT) / bw
    emb_elem = tokens * (3.0 * h * bv) / bw
    if rows.measured_layer_s is not None and rows.measured_head_s is not None \
            and rows.measured_layer_forward_s is not None:
        # a measured profile replaces the compute terms it contains (matmuls, attention, elementwise)
        has = np.isfinite(rows.measured_layer_s)
        # PyTorch's early stop skips the down projection in the recomputed forward: its analytic share of the
        # forward (linear GEMMs, attention, elementwise passes) of the measured forward
        skipped = torch_full * rows.measured_layer_forward_s * down / (g + attn_forward + fwd_bytes / bw)
        gemm_layer = np.where(has, rows.measured_layer_s + fw_again * rows.measured_layer_forward_s - skipped,
                              gemm_layer)
        elem_layer = np.where(has, 0.0, elem_layer)
        has_head = np.isfinite(rows.measured_head_s)
        head_gemm = np.where(has_head, rows.measured_head_s, head_gemm)
        head_elem = np.where(has_head, 0.0, head_elem)
        emb_elem = np.where(has_head, 0.0, emb_elem)

    # Megatron's torch softmax fallback in fp32 (16-bit scores, the fused kernel not run, not unfused-fp16)
    fp32_softmax = ~fused_softmax_runs(mn, rows) & (mn.softmax_fusion != "unfused-fp16") & (bv < 4.0)
    layer_act, attn_transient, stored_per_layer = layer_activations(mn, rows, tokens, tp_rep, eager, heads,
                                                                    fp32_softmax)

    # data-parallel collectives; DP neighbours sit next to each other after the TP ranks on a node
    dp_bus, dp_share = dp_ring_bus(rows.replicas, t, rows.intra_node_gb_per_s, rows.devices_per_node,
                                   rows.inter_node_gbps)
    # latency of one data-parallel collective: NCCL's ring (all-gather, reduce-scatter) or the faster of ring
    # and tree (all-reduce) over the ring's nodes; CPU rows: gloo's / DTensor's per-call cost per log2 step
    dp_nodes = np.ceil(rows.replicas / dp_ring_members(rows.replicas, t, rows.devices_per_node))
    dp_ar_call = nccl_latency_s(rows.replicas, dp_nodes, True)
    dp_ag_call = nccl_latency_s(rows.replicas, dp_nodes, False)
    if rows.host_collectives is not None:
        log_steps = 2.0 * np.log2(np.maximum(rows.replicas, 1.0))
        dp_ar_call = np.where(rows.host_collectives, log_steps * latency, dp_ar_call)
        dp_ag_call = np.where(rows.host_collectives,
                              log_steps * collective_latency_s(rows.host_collectives, True), dp_ag_call)

    # pipeline point-to-point: activations of one micro-batch (split over TP ranks: scatter/gather)
    # ranks in Megatron/DeepSpeed order (TP fastest, then data parallel, then pipeline): stage i of all
    # replicas holds the contiguous ranks [i, i+1) * replicas * tp, so the pipeline stays inside one node
    # only if the whole group does; at a crossing hop the stage's ranks on the node send at once and
    # share its NIC
    stage_ranks = rows.replicas * rows.tp
    pp_bus_same_node = stage_ranks * rows.pp <= rows.devices_per_node
    senders = np.clip(stage_ranks, 1.0, rows.devices_per_node)
    nic_per_dev = rows.inter_node_gbps * (C.NETWORK_EFFICIENCY / 8.0) / senders
    intra = rows.intra_node_gb_per_s * C.LINK_EFFICIENCY
    pp_bw = np.where(pp_bus_same_node & (intra > 0), intra, nic_per_dev)
    p2p = tokens * (h * bv) / t / (pp_bw * 1e9) + latency
    # Megatron all-reduces the tied embedding's gradient between the first and the last stage after
    # every step (not overlapped): one 2-rank all-reduce per TP rank over the pipeline link
    tied = (mn.tie * (rows.pp > 1)).astype(np.float64)
    tied_s = tied * ring_allreduce_s(mn.vocab * h / t * mn.grad_bytes_per_value, 2.0, pp_bw)
    capacity = rows.memory_gb * (1.0 - np.where(compiled(rows), 0.0, C.FRAGMENTATION_FRACTION))
    return {
        "gemm_layer": gemm_layer,
        "elem_layer": elem_layer,
        "tp_layer": tp_layer,
        "ar": ar,
        "head_gemm": head_gemm,
        "head_elem": head_elem,
        "emb_elem": emb_elem,
        "layer_act": layer_act,
        "stored_per_layer": stored_per_layer,
        "attn_transient": attn_transient,
        "rc_full": rc_full,
        "rc_rebuild": np.maximum(rc_full, rerun),
        "bw": bw,
        "dp_bus": dp_bus,
        "dp_share": dp_share,
        "p2p": p2p,
        "tied_s": tied_s,
        "capacity_gb": capacity,
        "tokens": tokens,
        "latency": np.broadcast_to(np.asarray(latency, dtype=np.float64), tokens.shape),
        "dp_ar_call": np.broadcast_to(dp_ar_call, tokens.shape),
        "dp_ag_call": np.broadcast_to(dp_ag_call, tokens.shape),
        "host": (np.zeros(tokens.shape, dtype=np.bool_) if rows.host_collectives is None
                 else np.broadcast_to(rows.host_collectives, tokens.shape)),
    }


def stage_totals(
    mn: ModelNumbers,
    rows: StageRows,
    lc: dict[str, FloatArray],
    layers: FloatArray,
    first: BoolArray,
    last: BoolArray,
    stage_index: FloatArray,
) -> dict[str, FloatArray]:
    """A stage's costs from its layer costs ``lc``: times per micro-batch and per step, memory per device."""
    bv = mn.bytes_per_value
    L = layers
    fi = first.astype(np.float64)
    la = last.astype(np.float64)

    gemm_mb = L * lc["gemm_layer"] + la * lc["head_gemm"]
    elem_mb = L * lc["elem_layer"] + la * lc["head_elem"] + fi * lc["emb_elem"]
    tp_mb = L * lc["tp_layer"] + (fi + la) * lc["ar"]

    # ---- what a device holds (costmodel.memory) ----------------------------------------------------
    held = held_parameters(mn, rows, L, first, last)
    mem = stage_memory(mn, rows, lc, held, L, first, last, stage_index)
    n = rows.replicas
    z = rows.zero_stage
    p_dev, trainable, shard_w, shard_o = held.p_dev, held.trainable, held.shard_w, held.shard_o
    offload_params = rows.offload >= 2

    # ---- per-step work -----------------------------------------------------------------------------
    opt_params = trainable / shard_o
    opt_gpu = opt_params * (C.SGD_BYTES_PER_PARAM if mn.optimizer == "sgd" else C.ADAM_BYTES_PER_PARAM) / lc["bw"]
    if rows.measured_optimizer_s_per_param is not None:
        measured_opt = rows.measured_optimizer_s_per_param
        opt_gpu = np.where(np.isfinite(measured_opt), opt_params * measured_opt, opt_gpu)
    opt_cpu = opt_params * (2.0 * bv / (C.PCIE_HOST_GB_PER_S * 1e9) + 1.0 / C.CPU_ADAM_PARAMS_PER_S)
    optimizer_s = np.where(rows.offload >= 1, opt_cpu, opt_gpu)
    compute_mb = gemm_mb + elem_mb + tp_mb
    # parameters streamed from the host for forward and backward of every micro-batch
    offload_mb = np.where(offload_params, 2.0 * p_dev / shard_w * bv / (C.PCIE_HOST_GB_PER_S * 1e9), 0.0)
    exposed = np.maximum(offload_mb - compute_mb, 0.0)

    grad_bytes = trainable * mn.grad_bytes_per_value
    dp_allreduce = (ring_allreduce_s(grad_bytes, n, lc["dp_bus"], 0.0)
                    + np.ceil(grad_bytes / C.GRADIENT_BUCKET_BYTES) * np.where(n > 1.0, lc["dp_ar_call"], 0.0))
    # CPU ranks: the runtime's ZeRO-2 is FSDP2 too (gathers forward, reduce-scatters per micro-batch: 2 DTensor
    # collectives per block, the all-reduce's volume), priced with ZeRO-3's per-micro-batch collectives
    fsdp2_cpu = lc["host"] & (z == 2)
    z3 = (z >= 3) | fsdp2_cpu
    # ZeRO-3: per layer an all-gather for forward, again for backward, and a reduce-scatter of gradients
    # (1.5x the all-reduce volume; the reduce-scatter in fp32 with grad_reduce_fp32: FSDP's reduce_dtype),
    # overlapped with the micro-batch's compute except the first gather; the overlapped part still takes SMs
    # from compute (3 collectives per layer: each pays its latency, comm.nccl_latency_s, which grows with the ring)
    z3_mb = (ring_allreduce_s(p_dev * (bv + 0.5 * mn.grad_bytes_per_value), n, lc["dp_bus"], 0.0)
             + 3.0 * np.maximum(L, 1.0) * np.where(n > 1.0, lc["dp_ag_call"], 0.0))
    z3_mb = np.where(fsdp2_cpu, z3_mb / 1.5, z3_mb)
    z3_exposed = (np.maximum(z3_mb - compute_mb, 0.0) + z3_mb / (3.0 * np.maximum(L, 1.0))
                  + C.OVERLAP_SM_FRACTION * np.minimum(z3_mb, compute_mb))
    exposed = exposed + np.where(z3, z3_exposed, 0.0)
    stage_mb = compute_mb + exposed
    # gradient reduction (ZeRO 0-2) overlaps the backward of the last micro-batch (bucketed)
    bwd_last = compute_mb * (2.0 / 3.0) if mn.overlap_grad_reduce else 0.0 * compute_mb
    dp_exposed = np.where(z3, 0.0, np.maximum(dp_allreduce - bwd_last, 0.0)
                          + C.OVERLAP_SM_FRACTION * np.minimum(dp_allreduce, bwd_last))
    # CPU ranks: the runtime's ZeRO-1 (ZeroRedundancyOptimizer) broadcasts each updated parameter tensor from
    # its owner after the step (on GPUs priced as DeepSpeed's reduce-scatter + all-gather, the all-reduce's)
    tensors = L * C.PARAM_TENSORS_PER_LAYER + fi + 2.0 * la
    bcast = (n - 1.0) / np.maximum(n, 1.0) * p_dev * bv / (lc["dp_bus"] * 1e9) + tensors * lc["latency"]
    dp_exposed = dp_exposed + np.where(lc["host"] & (z == 1) & (rows.offload == 0) & (n > 1), bcast, 0.0)

    return {
        "gemm_mb": gemm_mb,
        "elem_mb": elem_mb,
        "tp_mb": tp_mb,
        "z3_exposed_mb": exposed,
        "stage_mb": stage_mb,
        "p2p": lc["p2p"],
        "tied_s": la * lc["tied_s"],
        "optimizer_s": optimizer_s,
        "dp_exposed_s": dp_exposed,
        "dp_bus": lc["dp_bus"],
        "dp_share": lc["dp_share"],
        "weights_gb": mem["weights"] / 1e9,
        "grads_gb": mem["grads"] / 1e9,
        "optimizer_gb": mem["optimizer"] / 1e9,
        "activations_gb": mem["activations"] / 1e9,
        "memory_gb": mem["memory_gb"],
        "flat_grad_segment_gb": mem["flat_grad_segment"] / 1e9,
        "capacity_gb": lc["capacity_gb"],
    }


def stage_costs(mn: ModelNumbers, rows: StageRows) -> dict[str, FloatArray]:
    """Per-row costs (layer costs and stage totals of the rows' own layers and positions)."""
    return stage_totals(mn, rows, layer_costs(mn, rows), rows.layers, rows.first, rows.last, rows.stage_index)


def pipeline_step(
    stage_mb: FloatArray,
    sum_stage_mb: FloatArray,
    p2p: FloatArray,
    pp: FloatArray,
    m: FloatArray,
    virtual_stages: float,
    schedule: str,
    overlap_p2p: bool = False,
) -> tuple[FloatArray, FloatArray, FloatArray]:
    """(steady-state time, bubble, p2p time) of one step of a pipeline.

    ``stage_mb`` is the slowest stage's time per micro-batch (forward + backward), ``sum_stage_mb`` the sum
    over all stages. 1F1B/GPipe: m micro-batches at the slowest stage's pace plus the fill/drain through
    the other stages; interleaved divides the fill/drain by v and multiplies the p2p count by v. With
    ``overlap_p2p`` (interleaved only, Megatron-Core's ``overlap_p2p_comm``) a chunk's sends run while the next
    chunk computes: only the fill and drain chains, 2(p-1) sends, are exposed.
    """
    v = virtual_stages if schedule == "interleaved" else 1.0
    steady = m * stage_mb
    bubble = (sum_stage_mb - stage_mb) / v
    hops = np.where(pp > 1, 2.0 * (m + pp - 1.0) * v, 0.0)
    if overlap_p2p and schedule == "interleaved":
        hops = np.where(pp > 1, 2.0 * (pp - 1.0), 0.0)
    return steady, bubble, hops * p2p
