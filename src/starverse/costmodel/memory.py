"""The memory half of the cost model: what one device of a stage holds (weights, gradients, optimizer state,
stored and transient activations, the flat gradient copies of DeepSpeed-style all-reduces) and so whether a
stage fits. ``costmodel.stage`` calls these for every stage row, beside its times.

Notation as in ``costmodel.stage``: b micro-batch, s sequence, T = b*s tokens, h hidden, t TP degree, p
pipeline stages, m micro-batches per replica per step, n data-parallel replicas, L layers on the stage.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from starverse.costmodel import constants as C
from starverse.costmodel.rows import BoolArray, FloatArray, ModelNumbers, StageRows, compiled


def loss_width(mn: ModelNumbers, t: FloatArray) -> FloatArray:
    """Values per token and device the loss reads: the vocabulary's TP shard of the logits, or without an LM
    head (``ModelNumbers.head``) the final hidden states, which every TP rank holds whole."""
    return mn.vocab / t if mn.head else np.full_like(t, mn.h, dtype=np.float64)


def layer_activations(mn: ModelNumbers, rows: StageRows, tokens: FloatArray, tp_rep: FloatArray,
                      eager: BoolArray, heads: FloatArray,
                      fp32_softmax: BoolArray | None = None) -> tuple[FloatArray, FloatArray, FloatArray]:
    """Bytes per device of one layer and micro-batch: (its full activations, the attention backward's
    transient, what the layer stores for its backward under the row's recompute). ``tp_rep`` is the TP
    degree that splits the replicated tensors (sequence parallelism) or 1. ``fp32_softmax``: rows whose eager
    softmax runs as Megatron's torch fallback in fp32 (``FusedScaleMaskSoftmax.forward_torch_softmax`` with
    ``softmax_in_fp32``, which Megatron's default query-key layer scaling forces; ``stage.fused_softmax_runs``
    false): ``torch.nn.Softmax`` keeps its fp32 output for backward, and the 16-bit copy the context matmul reads
    (or dropout's output) is kept beside it."""
    bv = mn.bytes_per_value
    t = rows.tp
    s = mn.seq_len
    h = mn.h
    # ---- activations (Korthikanti et al. 2022, generalised to GQA / gated MLP / MoE; flash attention
    # stores no s x s scores, so selective recompute keeps the same bytes as none) -----------------
    # 2 norm inputs, QKV and MLP inputs (16 bit), 2 dropout masks (1 byte each, only with dropout)
    rep_act = 4.0 * h * bv + (2.0 * h if mn.dropout else 0.0)
    # the MLP stores its activation's input and output (ReLU: the output only, also the down projection's input)
    mlp_tensors = 3.0 if mn.gated else (1.0 if mn.relu else 2.0)
    split_act = ((mn.q_dim + 2.0 * mn.kv_dim) + mn.q_dim) * bv + mlp_tensors * mn.ffn * bv * max(mn.top_k, 1.0)
    layer_act = tokens * (rep_act / tp_rep + split_act / t)
    torch32 = np.zeros(rows.tp.shape, dtype=np.bool_) if fp32_softmax is None else (fp32_softmax & eager)
    if eager.any():
        # Korthikanti's 5as^2b: softmax output (2 B), dropout mask (1 B) and output (2 B) per score at
        # 16 bit (bv each for the two values in fp32); selective recompute drops exactly these. The torch
        # fallback in fp32 keeps the softmax's fp32 output (4 B) and, without dropout, the 16-bit copy the
        # context matmul saves (bv)
        per_score = np.where(torch32, 4.0 + (1.0 + bv if mn.attention_dropout else bv),
                             bv + (1.0 + bv if mn.attention_dropout else 0.0))
        layer_act = layer_act + np.where(eager & (rows.recompute < 1),
                                         rows.micro_batch * heads * s * s / mn.cp * per_score, 0.0)
    # backward of an eager attention materialises two more s x s tensors of one layer and micro-batch (the
    # gradient of the probabilities from the context matmul and the softmax's input gradient) while the
    # stored probabilities are still held (PyTorch: bmm and _softmax_backward_data allocate their outputs);
    # the torch fallback in fp32 takes them in fp32 (the 16-bit cast's backward hands the softmax an fp32
    # gradient, _softmax_backward_data returns fp32)
    per_grad = np.where(torch32, 4.0, bv)
    attn_transient = np.where(eager, 2.0 * rows.micro_batch * heads * s * s / mn.cp * per_grad, 0.0)
    layer_input = tokens * (h * bv) / tp_rep
    # matmuls (op-level selective checkpointing of the matmul outputs, runtime/parallel/recompute.py): the block's
    # input and every matmul's output — Q, K, V and the MLP's up (and gate) projections split over TP, the two
    # row-parallel outputs (attention and MLP down projection) whole on each TP rank, as the matmul leaves them
    # before their all-reduce or reduce-scatter (MoE: each token's top-k experts, and the router's logits)
    k = max(mn.top_k, 1.0)
    up = (2.0 if mn.gated else 1.0) * mn.ffn * k
    matmul_outputs = tokens * bv * ((mn.q_dim + 2.0 * mn.kv_dim + up) / t + (1.0 + k) * h + mn.num_experts)
    # dots (JAX's ``checkpoint_dots_with_no_batch_dims``, MaxText's ``minimal``): of the projections' outputs only
    # the residuals the backward reads are kept, each as XLA shards it — Q, K, V and the MLP's up (and gate)
    # projections split over TP, and in a sequential block the attention's output projection, from which the
    # mid-layer residual (the MLP norm's input) is rebuilt, split like the residual stream; neither output
    # projection of a parallel block, nor the MLP's down projection, feeds anything but the residual sum
    dots_outputs = tokens * bv * ((mn.q_dim + 2.0 * mn.kv_dim + up) / t + mn.num_experts
                                  + (0.0 if mn.parallel_block else h / tp_rep))
    stored_per_layer = np.select(
        [rows.recompute == 2, rows.recompute == 3, rows.recompute == 4],
        [layer_input, layer_input + matmul_outputs, layer_input + dots_outputs], layer_act)
    return layer_act, attn_transient, stored_per_layer


@dataclass(frozen=True)
class HeldParameters:
    """Parameters one device of a stage holds, and the ZeRO sharding of their states."""

    p_dev: FloatArray
    """Parameters of the stage's layers (and embedding / head) on one TP rank."""
    trainable: FloatArray
    """Of those, the trained ones (all in full training; the adapters with LoRA / QLoRA)."""
    shard_w: FloatArray
    """Ways the 16-bit weights are sharded over the replicas (ZeRO-3)."""
    shard_g: FloatArray
    """Ways the gradients are sharded (ZeRO-2 and up)."""
    shard_o: FloatArray
    """Ways the optimizer state is sharded (ZeRO-1 and up)."""


def held_parameters(mn: ModelNumbers, rows: StageRows, layers: FloatArray, first: BoolArray,
                    last: BoolArray) -> HeldParameters:
    """The parameters a device of each row holds (``layers`` transformer layers, the embedding on ``first``
    rows, the head on ``last`` rows) and how ZeRO shards them."""
    t = rows.tp
    L = layers
    fi = first.astype(np.float64)
    la = last.astype(np.float64)
    n = rows.replicas
    tie_copy = float(mn.tie) * (rows.pp > 1)  # Megatron keeps the tied embedding on the last stage too
    p_dev = (L * mn.params_per_layer + fi * mn.embedding_params
             + la * (mn.lm_head_params + mn.embedding_params * tie_copy)) / t
    adapters = mn.adapter_whole_per_layer + (mn.adapter_params_per_layer - mn.adapter_whole_per_layer) / t
    trainable = p_dev if mn.mode == "full" else L * adapters
    z = rows.zero_stage
    return HeldParameters(p_dev, trainable, np.where(z >= 3, n, 1.0), np.where(z >= 2, n, 1.0),
                          np.where(z >= 1, n, 1.0))


def flat_grad_buffer_bytes(grad_bytes: FloatArray | float, value_bytes: float) -> FloatArray:
    """Bytes of the flat copy of a stage's gradients (``grad_bytes``, values of ``value_bytes``) that DeepSpeed's
    all-reduce without ZeRO allocates: one bucket of at most ``FLAT_ALLREDUCE_BUCKET_ELEMENTS`` values
    (``TrainSpec.flat_grad_allreduce``)."""
    return np.minimum(np.asarray(grad_bytes, dtype=np.float64), C.FLAT_ALLREDUCE_BUCKET_ELEMENTS * value_bytes)


def bf16_optimizer_cast_bytes(trainable: FloatArray, comm_bytes: float) -> FloatArray:
    """Bytes of the copy DeepSpeed's flat all-reduce makes of ``BF16_Optimizer``'s fp32 gradients
    (``TrainSpec.fp32_grad_copy`` with ``flat_grad_allreduce``): they are already one flat tensor per parameter
    group, so ``allreduce_bucket``'s flatten returns that tensor itself, and it is cast to the communication dtype
    (``tensor.to(communication_data_type)``) when that is not fp32: a ``comm_bytes`` copy of the whole buffer
    (``trainable`` values, not bucketed: ``allreduce_no_retain`` closes a bucket only after a tensor passes
    ``MEMORY_OPT_ALLREDUCE_SIZE``). Reduced in fp32: no copy."""
    return np.asarray(trainable, dtype=np.float64) * (comm_bytes if comm_bytes < 4.0 else 0.0)


def optimizer_state_bytes(optimizer: str, bytes_per_value: float) -> float:
    """Bytes per trained parameter the optimizer holds: its state (``constants.OPTIMIZER_STATE_BYTES``: Adam's
    m and v, SGD's momentum) plus the fp32 master copy where the weights are 16-bit."""
    return C.OPTIMIZER_STATE_BYTES[optimizer] + (0.0 if bytes_per_value >= 4.0 else 4.0)


def stage_memory(
    mn: ModelNumbers,
    rows: StageRows,
    lc: dict[str, FloatArray],
    held: HeldParameters,
    layers: FloatArray,
    first: BoolArray,
    last: BoolArray,
    stage_index: FloatArray,
) -> dict[str, FloatArray]:
    """Bytes one device of each row holds at its peak (``weights``, ``grads``, ``optimizer``, ``activations``),
    the need in GB with the runtime reserve (``memory_gb``), and the flat gradient copy's own allocator segment
    (``flat_grad_segment``, bytes). ``lc`` are the rows' layer costs (``stage.layer_costs``)."""
    bv = mn.bytes_per_value
    t = rows.tp
    L = layers
    h = mn.h
    tokens = lc["tokens"]
    fi = first.astype(np.float64)
    la = last.astype(np.float64)
    p_dev, trainable = held.p_dev, held.trainable
    z = rows.zero_stage
    base_bytes = C.QLORA_BYTES_PER_PARAM if mn.mode == "qlora" else bv
    weights = p_dev * base_bytes / held.shard_w
    if mn.mode != "full":
        weights = weights + trainable * bv / held.shard_w
    # ZeRO-3 gathers about two layers at a time (current + prefetch)
    layer_bytes = 2.0 * mn.params_per_layer * bv / t
    weights = weights + np.where(z >= 3, layer_bytes, 0.0)
    weights = np.where(rows.offload >= 2, layer_bytes, weights)
    grads16 = trainable * bv / held.shard_g
    # DeepSpeed's BF16_Optimizer: a whole fp32 gradient buffer beside the bf16 .grad (TrainSpec.fp32_grad_copy)
    grads = grads16 + trainable * (4.0 if mn.fp32_grad_copy else 0.0)
    opt_bytes_per_param = optimizer_state_bytes(mn.optimizer, bv)
    optimizer = np.where(rows.offload >= 1, 0.0, trainable * opt_bytes_per_param / held.shard_o)

    # ---- activations of the micro-batches in flight ------------------------------------------------
    p = rows.pp
    m = rows.num_micro_batches
    if mn.schedule == "gpipe":
        in_flight = m
    else:
        in_flight = np.minimum(p - stage_index, m)
        if mn.schedule == "interleaved":
            in_flight = in_flight * (1.0 + (p - 1.0) / (p * mn.virtual_stages))
    activations = L * lc["stored_per_layer"] * in_flight
    # recomputing a layer (full, or the non-matmul ops under matmuls) materialises its full activations for one
    # micro-batch
    activations = activations + lc["rc_rebuild"] * lc["layer_act"]
    activations = activations + fi * tokens * (h * bv) * in_flight
    # the peak: the last stage at the end of its forward holds the logits and the loss's fp32 softmax; once
    # the head's backward has run they are freed, before the attention backward's transients of a layer
    logits = la * tokens * (loss_width(mn, t) * (bv + 4.0))
    if mn.pipe_buffers_keep_outputs:
        # DeepSpeed's last stage keeps each micro-batch's output in its pipe buffer (TrainSpec
        # .pipe_buffers_keep_outputs): the current logits stay through the backward, the previous ones are held
        prev = np.where(rows.num_micro_batches >= 2, 1.0, 0.0)
        if mn.pipe_buffers_keep_outputs == "fp32" and bv < 4.0:
            # the kept output is the fp32 upcast the model's last pipe layer makes (GPTModelPipe's
            # float16_to_fp32), which the cross-entropy turns into its softmax and gradient in place: at the
            # head's forward the new logits (16-bit and fp32) sit beside both buffers' (the engine stores the new
            # output once the forward returns), and no layer is being recomputed; through the backward the
            # current and the previous one, beside a recomputed layer and its attention backward
            out = la * tokens * (loss_width(mn, t) * 4.0)
            kept_at_forward = np.minimum(np.maximum(rows.num_micro_batches - 1.0, 0.0), 2.0)
            rc = lc["rc_rebuild"] * lc["layer_act"]
            activations = activations - rc + np.maximum(logits + kept_at_forward * out,
                                                        rc + lc["attn_transient"] + out + prev * out)
        else:
            out = la * tokens * (loss_width(mn, t) * bv)
            activations = activations + np.maximum(logits, lc["attn_transient"] + out) + prev * out
    else:
        activations = activations + np.maximum(logits, lc["attn_transient"])


    # DeepSpeed without ZeRO, and its ZeRO-1 optimizer (which runs with contiguous_gradients off, so its
    # reduce_ipg_grads takes the same buffered_reduce_fallback: TrainSpec.flat_grad_allreduce), flattens the
    # gradients bucket by bucket for the all-reduce after the last backward, when the activations are freed: the
    # peak holds the larger of the two. ZeRO-2 and -3 reduce-scatter into their own buffers instead
    if not mn.flat_grad_allreduce:
        flat = 0.0 * grads
    elif mn.fp32_grad_copy:
        flat = bf16_optimizer_cast_bytes(trainable, mn.grad_bytes_per_value)
    else:
        flat = np.where(z <= 1, flat_grad_buffer_bytes(grads16, bv), 0.0)
    reserve = np.where(compiled(rows), 0.0, C.RESERVED_GB)
    total = (weights + grads + optimizer + np.maximum(activations, flat)) / 1e9 + reserve
    # PyTorch's caching allocator serves a request from a free block at least as large, else from a new segment
    # of the request's size, and never merges segments: once the activations are freed the largest free block is
    # the largest activation tensor (one layer's scores of a micro-batch, the fp32 logits, an MLP tensor), so a
    # larger flat copy takes a segment of its own, which stays reserved (a device-wide reading holds it) beside
    # the activations' segments: the reading holds both, the need above only the larger, so the reading adds the
    # smaller
    if mn.flat_grad_allreduce:  # only DeepSpeed-style plans: not computed on the planner's candidates
        largest = np.maximum(np.maximum(lc["attn_transient"] / 2.0, la * tokens * loss_width(mn, t) * 4.0),
                             tokens * mn.ffn / t * bv)
        flat_segment = np.where(flat > largest, np.minimum(flat, activations), 0.0)
    else:
        flat_segment = flat
    return {"weights": weights, "grads": grads, "optimizer": optimizer, "activations": activations,
            "memory_gb": total, "flat_grad_segment": flat_segment}
