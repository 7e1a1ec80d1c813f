"""The cost model's inputs as arrays: :class:`StageRows` (one pipeline stage of one group per row) and
:class:`ModelNumbers` (the model's and training's scalars shared by all rows). ``costmodel.stage`` computes
over them; ``costmodel.step`` and the planner build them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


@dataclass(frozen=True)
class StageRows:
    """R stage rows as arrays of shape (R,)."""

    peak_tflops: FloatArray
    """Dense peak TFLOP/s at the plan's precision."""
    gemm_efficiency: FloatArray
    """Large-matmul achievable fraction of peak."""
    memory_gb: FloatArray
    """Usable device memory, GB = 1e9 bytes (``constants.usable_memory_gb`` or the plan's override)."""
    memory_bw_gb_per_s: FloatArray
    """Device memory bandwidth."""
    intra_node_gb_per_s: FloatArray
    """Per-device intra-node link bandwidth, one direction."""
    devices_per_node: FloatArray
    """Devices per node."""
    inter_node_gbps: FloatArray
    """NIC bandwidth per node, Gbit/s."""
    tp: FloatArray
    """Tensor-parallel degree."""
    layers: FloatArray
    """Transformer layers on this stage."""
    first: BoolArray
    """Holds the embedding."""
    last: BoolArray
    """Holds the final norm, LM head and loss."""
    stage_index: FloatArray
    """0-based position in the pipeline (in-flight micro-batches under 1F1B)."""
    pp: FloatArray
    """Pipeline depth of the group."""
    replicas: FloatArray
    """Data-parallel replicas of the group."""
    micro_batch: FloatArray
    """Sequences per micro-batch."""
    num_micro_batches: FloatArray
    """Micro-batches per replica per step."""
    zero_stage: FloatArray
    """0-3."""
    recompute: FloatArray
    """0 none, 1 selective, 2 full."""
    offload: FloatArray
    """0 none, 1 optimizer, 2 optimizer+params."""
    sequence_parallel: BoolArray
    """Megatron sequence parallelism."""
    pipeline_devices: FloatArray
    """Devices of one pipeline replica (sum of tp over stages), for placement on nodes."""
    flash_attention: BoolArray
    """The accelerator has a fused (Flash) attention kernel (``constants.has_flash_attention``)."""
    measured_layer_s: FloatArray | None = None
    """Measured forward + backward of one layer per micro-batch (``costmodel.profile``); NaN = analytic."""
    measured_layer_forward_s: FloatArray | None = None
    """Measured forward of one layer (recomputed once more under full recompute)."""
    measured_head_s: FloatArray | None = None
    """Measured forward + backward of embedding, LM head and loss per micro-batch; NaN = analytic."""
    measured_optimizer_s_per_param: FloatArray | None = None
    """Measured Adam step time per parameter held (``costmodel.profile``); NaN = analytic."""
    attention_tflops: FloatArray | None = None
    """Sustained TFLOP/s of the attention core's matmuls (``attention_rates.attention_tflops``: bf16 under fp8
    training); None = ``peak_tflops x gemm_efficiency`` (attention at the GEMMs' precision)."""
    compiled_memory: BoolArray | None = None
    """The device's memory is laid out by a compiler (``constants.compiled_memory``: XLA), without the runtime
    reserve and allocator fragmentation of CUDA; None = none is."""
    matrix_unit: FloatArray | None = None
    """Edge of the device's systolic matrix unit (``Accelerator.matrix_unit``: TPUs), 0 where it has none (GPUs);
    None = no row has one. Its matmuls are a padded roofline (``matmul.gemm_time_s``)."""
    host_collectives: BoolArray | None = None
    """Ranks are host processes talking over gloo (``constants.host_collectives``: the ``cpu`` stack), whose
    collectives cost ``comm.collective_latency_s`` per call; None = none are."""


@dataclass(frozen=True)
class ModelNumbers:
    """Scalars of the model and training shared by all rows (floats, for numpy)."""

    h: float
    q_dim: float
    kv_dim: float
    head_dim: float
    ffn: float
    vocab: float
    gated: bool
    num_experts: float
    top_k: float
    tie: bool
    rope: bool
    dropout: bool
    attention: str
    num_layers: float
    params_per_layer: float
    active_params_per_layer: float
    embedding_params: float
    lm_head_params: float
    adapter_params_per_layer: float
    adapter_whole_per_layer: float
    """The part of the adapters tensor parallelism does not split (see ``group.adapter_params_per_layer``)."""
    seq_len: float
    bytes_per_value: float
    grad_bytes_per_value: float
    mode: str
    schedule: str
    virtual_stages: float
    sync_micro_steps: bool = False
    recompute_early_stop: bool = True
    """Full recompute stops once the backward's saved tensors are back (``TrainSpec.recompute_early_stop``)."""
    extra_forwards: float = 0.0
    """Forwards of each layer per micro-batch beyond the one backward uses (``TrainSpec.num_layer_forwards``
    - 1): compute, TP collectives and launches as a recomputed forward, no stored activations."""
    softmax_fusion: str = "always"
    """Where eager attention's fused softmax kernel runs on 16-bit scores (``TrainSpec.softmax_fusion``)."""
    overlap_grad_reduce: bool = True
    flat_grad_allreduce: bool = False
    """Gradients copied into one flat buffer for the all-reduce (``TrainSpec.flat_grad_allreduce``)."""
    fp32_grad_copy: bool = False
    """The optimizer keeps a whole fp32 gradient copy beside the 16-bit one (``TrainSpec.fp32_grad_copy``)."""
    pipe_buffers_keep_outputs: bool | str = False
    """The last stage's pipe buffers keep the logits, ``"fp32"``: their fp32 upcast
    (``TrainSpec.pipe_buffers_keep_outputs``)."""
    tp_comm_overlap: bool = False
    overlap_p2p_comm: bool = False
    optimizer: str = "adamw"
    """adamw | sgd (``TrainSpec.optimizer``): optimizer state and step traffic per parameter."""
    attention_dropout: bool = True
    """Attention probabilities are dropped (``ModelShape.attention_dropout``)."""
    relu: bool = False
    """ReLU MLP (``ModelShape.relu``): one ffn-wide tensor stored per token."""
    parallel_block: bool = False
    """Attention and MLP in parallel from one norm (``ModelShape.parallel_block``)."""
    head: bool = True
    """The model has an LM head (``ModelShape.lm_head``); without one the loss covers the hidden states."""
    cp: float = 1.0
    """Context-parallel degree: each rank holds ``seq_len / cp`` tokens of every sequence (``Group.cp``)."""
    gemm_operand_bytes: float = 0.0
    """Bytes per input element of the linear layers' GEMMs where they differ from ``bytes_per_value`` (FP8
    training: 1, ``constants.GEMM_OPERAND_BYTES``); 0 = ``bytes_per_value``."""

    def layer_matmul_flops_per_token(self) -> float:
        """Forward matmul FLOPs per token of one layer, exact (causal attention over the sequence)."""
        h, q, kv, f = self.h, self.q_dim, self.kv_dim, self.ffn
        proj = 2.0 * h * (q + 2.0 * kv) + 2.0 * q * h
        mlp = (3.0 if self.gated else 2.0) * 2.0 * h * f
        if self.num_experts > 0:
            mlp = mlp * self.top_k + 2.0 * h * self.num_experts
        attn = 4.0 * q * (self.seq_len + 1.0) / 2.0
        return proj + mlp + attn

    def model_flops_per_token(self) -> float:
        """Model FLOPs per trained token (forward + backward = 3x forward, no recompute), incl. LM head."""
        head = 2.0 * self.h * self.vocab if self.head else 0.0
        per_token = self.num_layers * self.layer_matmul_flops_per_token() + head
        if self.mode == "full":
            return 3.0 * per_token
        # frozen base: backward computes input gradients only (adapters are negligible)
        return 2.0 * per_token


def compiled(rows: StageRows) -> BoolArray | bool:
    """Per row, whether the device's memory is laid out by a compiler (``StageRows.compiled_memory``): no
    runtime reserve and no allocator fragmentation in its need and capacity (``costmodel.memory``)."""
    return False if rows.compiled_memory is None else rows.compiled_memory
