"""Shapes shared by the cost model and the planner: the model, the training settings, the accelerator
table, candidate groups and their estimates (frozen dataclasses of plain numbers or numpy arrays).

One module, imported by :mod:`costmodel.batch`, :mod:`costmodel.group` and the planner, so neither
depends on the other for its types (no ``batch`` <-> ``group`` import circle).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from starverse.costmodel.attention_rates import attention_tflops, flash2_attention_tflops
from starverse.costmodel.constants import (
    LINK_EFFICIENCY,
    compiled_memory,
    gemm_efficiency,
    has_flash_attention,
    host_collectives,
    intra_node_gb_per_s,
    peak_tflops,
)
from starverse.costmodel.constants import usable_memory_gb as usable_memory
from starverse.costmodel.pricing import cheapest_price_per_hour

if TYPE_CHECKING:  # pragma: no cover
    from starverse.plan import TrainSpec

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

RECOMPUTE_CODES: dict[str, int] = {"none": 0, "selective": 1, "full": 2, "matmuls": 3, "dots": 4}
"""``Candidates.recompute`` codes."""
OFFLOAD_CODES: dict[str, int] = {"none": 0, "optimizer": 1, "optimizer+params": 2}
"""``Candidates.offload`` codes."""
BOTTLENECKS: tuple[str, ...] = ("compute", "memory", "tp_comm", "dp_comm", "pp_comm", "pipeline_bubble")
"""``BatchEstimate.bottleneck`` codes index this tuple (the largest part of the step time)."""


def uses_dropout(spec: Any) -> bool:
    """Whether a model config trains with dropout: any ``*drop*`` field > 0 (one level of nesting), or
    none given in a GPT-2 config (transformers' GPT2Config defaults to 0.1)."""
    cfg = dict(getattr(spec, "hf_config", {}) or {})
    values: list[float] = []
    for key, value in cfg.items():
        items = value.items() if isinstance(value, dict) else [(key, value)]
        for k, v in items:
            if "drop" in str(k) and isinstance(v, int | float) and not isinstance(v, bool):
                values.append(float(v))
    if values:
        return any(v > 0 for v in values)
    return getattr(spec, "family", "") == "gpt2"


def uses_attention_dropout(spec: Any) -> bool:
    """Whether a model config drops attention probabilities (a 1-byte mask per s x s score is then stored):
    its attention dropout field (``attn_pdrop``, ``attention_dropout``, ``attention_probs_dropout_prob``...)
    > 0; without one, GPT-2's default (0.1) for a GPT-2 config, else :func:`uses_dropout`."""
    cfg = dict(getattr(spec, "hf_config", {}) or {})
    values = [float(v) for k, v in cfg.items()
              if "drop" in str(k) and "att" in str(k) and isinstance(v, int | float) and not isinstance(v, bool)]
    if values:
        return any(v > 0 for v in values)
    return uses_dropout(spec)


RELU_NAMES = frozenset({"relu", "relu2", "reglu"})
"""MLP activations whose backward needs only their output (``threshold_backward(grad, result)`` in PyTorch's
``derivatives.yaml``): the output is also the down projection's saved input, so one ffn-wide tensor is stored
per token instead of GELU/SiLU's two (input and output)."""


LM_HEAD_ARCHITECTURE_MARKS = ("LMHead", "ForCausalLM", "ForConditionalGeneration", "ForMaskedLM")
"""Parts of a transformers class name whose model ends in a vocabulary projection (``GPT2LMHeadModel``,
``GPTNeoForCausalLM``); the bare models (``GPT2Model``, ``GPTNeoModel``) return the final hidden states."""


def uses_lm_head(spec: Any) -> bool:
    """Whether the model projects its final hidden states onto the vocabulary: yes unless the config's
    ``architectures`` names only bare models (``GPT2Model``, ``GPTNeoModel``: no LM head, the loss then sees
    the hidden states, as Sailor's Megatron-DeepSpeed ``GPTNeoModelPipe``, whose last layers are the final
    LayerNorm and the loss)."""
    cfg = dict(getattr(spec, "hf_config", {}) or {})
    archs = [str(a) for a in cfg.get("architectures") or ()]
    return not archs or any(mark in a for a in archs for mark in LM_HEAD_ARCHITECTURE_MARKS)


def uses_relu(spec: Any) -> bool:
    """Whether the (non-gated) MLP activation is ReLU (``activation_function``, ``hidden_act`` or
    ``hidden_activation`` of the config, or MaxText's one ``mlp_activations``)."""
    cfg = dict(getattr(spec, "hf_config", {}) or {})
    for key in ("activation_function", "hidden_act", "hidden_activation"):
        value = cfg.get(key)
        if isinstance(value, str):
            return value.lower() in RELU_NAMES
    acts = cfg.get("mlp_activations")
    return isinstance(acts, list) and len(acts) == 1 and str(acts[0]).lower() in RELU_NAMES


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a ``models.ModelSpec`` the cost model needs (plain ints, built once per search)."""

    num_layers: int
    """Transformer layers."""
    hidden_size: int
    """Model width h."""
    num_heads: int
    """Attention (query) heads."""
    num_kv_heads: int
    """Key/value heads (GQA; equals num_heads for MHA)."""
    head_dim: int
    """Width of one head."""
    ffn_hidden_size: int
    """MLP inner width (per expert for MoE)."""
    vocab_size: int
    """Vocabulary (LM-head width)."""
    gated_mlp: bool
    """SwiGLU-style MLP with three matrices (else two)."""
    num_experts: int
    """Experts per MoE layer (0 = dense)."""
    experts_per_token: int
    """Top-k experts per token (0 = dense)."""
    tie_embeddings: bool
    """LM head shares the input embedding matrix."""
    params_per_layer: int
    """Parameters of one transformer layer (all experts)."""
    active_params_per_layer: int
    """Parameters of one layer that one token touches (top-k experts)."""
    embedding_params: int
    """Input embedding (+ learned positions) parameters."""
    lm_head_params: int
    """LM-head parameters (0 when tied)."""
    rope: bool = False
    """Rotary position embeddings (adds elementwise work on q and k)."""
    dropout: bool = True
    """Trains with dropout (1-byte masks stored per hidden activation)."""
    attention_dropout: bool = True
    """Drops attention probabilities (eager attention then stores a 1-byte mask and the dropped copy per score)."""
    relu: bool = False
    """The MLP activation is ReLU (one ffn-wide tensor stored per token, not two)."""
    parallel_block: bool = False
    """Attention and MLP read the same normed input and add to the residual together (``ModelSpec.parallel_attn_mlp``:
    GPT-J / NeoX / Falcon, MaxText's default block): no mid-layer residual to rebuild under ``recompute: dots``."""
    lm_head: bool = True
    """The model ends in a vocabulary projection (:func:`uses_lm_head`); without one the last stage holds no
    head weights, runs no head matmul and its loss covers the hidden states (time and memory alike)."""

    @classmethod
    def from_spec(cls, spec: Any) -> ModelShape:
        """Build from a ``starverse.models.ModelSpec``."""
        return cls(
            num_layers=int(spec.num_layers),
            hidden_size=int(spec.hidden_size),
            num_heads=int(spec.num_heads),
            num_kv_heads=int(spec.num_kv_heads),
            head_dim=int(spec.head_dim),
            ffn_hidden_size=int(spec.ffn_hidden_size),
            vocab_size=int(spec.vocab_size),
            gated_mlp=bool(spec.gated_mlp),
            num_experts=int(spec.num_experts),
            experts_per_token=int(spec.experts_per_token),
            tie_embeddings=bool(spec.tie_embeddings),
            params_per_layer=int(spec.params_per_layer),
            active_params_per_layer=int(spec.active_params_per_layer),
            embedding_params=int(spec.embedding_params),
            lm_head_params=int(spec.lm_head_params) if uses_lm_head(spec) else 0,
            rope=getattr(spec, "position", "") == "rope",
            dropout=uses_dropout(spec),
            attention_dropout=uses_attention_dropout(spec),
            relu=uses_relu(spec) and not spec.gated_mlp,
            parallel_block=bool(getattr(spec, "parallel_attn_mlp", False)),
            lm_head=uses_lm_head(spec),
        )

    @property
    def num_params(self) -> int:
        """All parameters."""
        return self.num_layers * self.params_per_layer + self.embedding_params + self.lm_head_params


@dataclass(frozen=True)
class TrainShape:
    """Training settings shared by every candidate of one search."""

    seq_len: int
    """Tokens per sequence."""
    precision: str = "bf16"
    """bf16 | fp16 | fp8 | fp32 | tf32 (selects the accelerator peak and bytes per value)."""
    mode: str = "full"
    """full | lora | qlora."""
    lora_rank: int = 16
    """LoRA rank (lora/qlora)."""
    schedule: str = "1f1b"
    """gpipe | 1f1b | interleaved."""
    virtual_stages: int = 1
    """Model chunks per device (interleaved schedule)."""
    attention: str = "auto"
    """flash (fused, causal blocks skipped, no s x s activations) | eager (materialised scores) | auto
    (per accelerator: ``DeviceTable.flash_attention``)."""
    grad_reduce_fp32: bool = False
    """Gradients accumulated and all-reduced in fp32 (``TrainSpec.grad_reduce_fp32``)."""
    sync_micro_steps: bool = False
    """The framework synchronises the device per micro-step (``TrainSpec.sync_micro_steps``)."""
    recompute_early_stop: bool = True
    """Full recompute stops once the backward's saved tensors are back (``TrainSpec.recompute_early_stop``)."""
    overlap_grad_reduce: bool = True
    """The gradient all-reduce overlaps the last backward (``TrainSpec.overlap_grad_reduce``)."""
    flat_grad_allreduce: bool = False
    """Gradients copied into one flat buffer for the all-reduce (``TrainSpec.flat_grad_allreduce``)."""
    fp32_grad_copy: bool = False
    """The optimizer keeps a whole fp32 gradient copy beside the 16-bit one (``TrainSpec.fp32_grad_copy``)."""
    pipe_buffers_keep_outputs: bool | str = False
    """The last stage's pipe buffers keep the logits, ``"fp32"``: their fp32 upcast
    (``TrainSpec.pipe_buffers_keep_outputs``)."""
    num_layer_forwards: int = 1
    """Forwards of each layer per micro-batch (``TrainSpec.num_layer_forwards``)."""
    softmax_fusion: str = "always"
    """Where eager attention's fused softmax kernel runs (``TrainSpec.softmax_fusion``)."""
    tp_comm_overlap: bool = False
    """TP collectives overlapped with the GEMMs (``TrainSpec.tp_comm_overlap``)."""
    overlap_p2p_comm: bool = False
    """Interleaved pipeline sends overlapped with compute (``TrainSpec.overlap_p2p_comm``)."""
    optimizer: str = "adamw"
    """adamw | sgd (``TrainSpec.optimizer``): the optimizer's state and step traffic per parameter."""

    @classmethod
    def from_train(cls, train: TrainSpec) -> TrainShape:
        """Build from a plan's ``TrainSpec``."""
        return cls(
            seq_len=train.seq_len,
            precision=train.precision,
            mode=train.mode,
            lora_rank=train.lora_rank,
            schedule=train.schedule,
            virtual_stages=train.virtual_stages,
            attention=train.attention,
            grad_reduce_fp32=train.grad_reduce_fp32,
            sync_micro_steps=train.sync_micro_steps,
            recompute_early_stop=train.recompute_early_stop,
            num_layer_forwards=train.num_layer_forwards,
            softmax_fusion=train.softmax_fusion,
            overlap_grad_reduce=train.overlap_grad_reduce,
            flat_grad_allreduce=train.flat_grad_allreduce,
            fp32_grad_copy=train.fp32_grad_copy,
            pipe_buffers_keep_outputs=train.pipe_buffers_keep_outputs,
            tp_comm_overlap=train.tp_comm_overlap,
            overlap_p2p_comm=train.overlap_p2p_comm,
            optimizer=train.optimizer,
        )


@dataclass(frozen=True)
class DeviceTable:
    """Struct of arrays over K accelerators (index ``k`` is what ``Candidates.accelerator`` holds).

    Build it with :meth:`from_accelerators` (the planner: one row per pool offer, with the offer's node
    size, NIC and price) or :meth:`from_catalog`.
    """

    ids: tuple[str, ...]
    """Catalog ids, one per row."""
    peak_tflops: FloatArray
    """Dense peak TFLOP/s at the search's precision."""
    gemm_efficiency: FloatArray
    """Achievable fraction of peak for large GEMMs (``costmodel.constants``)."""
    memory_gb: FloatArray
    """Usable device memory, GB = 1e9 bytes (``constants.usable_memory_gb``, or the offer's override)."""
    memory_bw_gb_per_s: FloatArray
    """Device memory bandwidth (GB/s)."""
    intra_node_gb_per_s: FloatArray
    """Per-device, one-direction intra-node bandwidth usable by collectives (GB/s): the catalog's link,
    halved for cards without peer-to-peer (``constants.intra_node_gb_per_s``)."""
    devices_per_node: IntArray
    """Devices per node."""
    inter_node_gbps: FloatArray
    """NIC bandwidth per node (Gbit/s)."""
    tdp_w: FloatArray
    """Board power (W)."""
    price_per_hour: FloatArray
    """Price per device-hour (NaN = unknown)."""
    attention_tflops: FloatArray | None = None
    """Sustained TFLOP/s of the attention core (``attention_rates.attention_tflops``); None = peak x efficiency."""
    flash2_attention_tflops: FloatArray | None = None
    """The same under ``TrainShape.attention == "flash2"`` (``attention_rates.flash2_attention_tflops``); None =
    ``attention_tflops``."""
    flash_attention: BoolArray | None = None
    """Has a fused attention kernel (used by ``TrainShape.attention == "auto"``); None = all do."""
    host_collectives: BoolArray | None = None
    """Ranks are host processes over gloo (``constants.host_collectives``: the ``cpu`` stack); None = none are."""
    compiled_memory: BoolArray | None = None
    """Memory laid out by a compiler (``constants.compiled_memory``: XLA); None = none is."""
    matrix_unit: FloatArray | None = None
    """Edge of the systolic matrix unit (``Accelerator.matrix_unit``), 0 = none (GPUs); None = no row has one."""
    profiles: tuple[Any, ...] | None = None
    """Per row, a measured ``costmodel.profile.ModelProfile`` of the search's model on that device kind, or
    None (analytic); a pool offer's ``profile``. Where one has an entry at a candidate's micro-batch,
    sequence length, TP and precision, its measured layer and head times replace the analytic ones, as in
    the scalar ``estimate``."""
    collective_gb_per_s: FloatArray | None = None
    """Shape (K, G): column ``n`` is a row's measured all-reduce bus bandwidth of a group of ``n`` devices
    (a pool offer's or a plan's ``collective_gb_per_s``) over ``LINK_EFFICIENCY``, NaN where not measured (or
    where the row's profile measured its intra-node link, which wins as in the scalar estimate); None = none
    measured. Read it through :meth:`intra_node_at`."""

    def intra_node_at(self, rows: Any, tp: Any) -> FloatArray:
        """Per-device intra-node bandwidth (GB/s) of ``rows`` for TP groups of ``tp`` (broadcast): the measured
        figure of that group size where there is one, else ``intra_node_gb_per_s`` (as the scalar
        ``costmodel.measured.intra_node_gb_per_s``)."""
        base = self.intra_node_gb_per_s[rows]
        table = self.collective_gb_per_s
        if table is None:
            return base
        t = np.asarray(tp, dtype=np.int64)
        measured = table[rows, np.clip(t, 0, table.shape[1] - 1)]
        return np.where((t < table.shape[1]) & ~np.isnan(measured), measured, base)

    @classmethod
    def from_accelerators(
        cls,
        accelerators: Sequence[Any],
        precision: str = "bf16",
        *,
        devices_per_node: Sequence[int] | None = None,
        inter_node_gbps: Sequence[float] | None = None,
        price_per_hour: Sequence[float | None] | None = None,
        usable_memory_gb: Sequence[float | None] | None = None,
        profiles: Sequence[Any] | None = None,
        peer_to_peer: Sequence[bool | None] | None = None,
        collective_gb_per_s: Sequence[Mapping[int, float] | None] | None = None,
    ) -> DeviceTable:
        """One row per ``catalog.Accelerator``; optional per-row overrides (pool offers; a None entry keeps
        the accelerator's own figure). A row's measured profile also replaces its intra-node bandwidth by the
        measured one (``links_gb_per_s["intra_node"]``, as the scalar estimate does); else a row's measured
        ``collective_gb_per_s`` ({group size: bus GB/s}) sets it for groups of those sizes."""
        k = len(accelerators)
        profs = None if profiles is None or all(p is None for p in profiles) else tuple(profiles)
        p2p = [None] * k if peer_to_peer is None else list(peer_to_peer)
        intra = [intra_node_gb_per_s(a, p) for a, p in zip(accelerators, p2p, strict=True)]
        coll = [dict(c or {}) for c in collective_gb_per_s or [None] * k]
        for i, prof in enumerate(profs or ()):
            if prof is not None and "intra_node" in prof.links_gb_per_s:
                intra[i] = prof.links_gb_per_s["intra_node"] / LINK_EFFICIENCY
                coll[i] = {}
        table = None
        if any(coll):
            table = np.full((k, max(n for c in coll for n in c) + 1), np.nan)
            for i, c in enumerate(coll):
                for n, gbps in c.items():
                    table[i, n] = gbps / LINK_EFFICIENCY
        dpn = [a.devices_per_node for a in accelerators] if devices_per_node is None else list(devices_per_node)
        nic = [a.inter_node_gbps for a in accelerators] if inter_node_gbps is None else list(inter_node_gbps)
        price = [None] * k if price_per_hour is None else list(price_per_hour)
        usable = [None] * k if usable_memory_gb is None else list(usable_memory_gb)
        return cls(
            ids=tuple(a.id for a in accelerators),
            peak_tflops=np.array([peak_tflops(a, precision) for a in accelerators], dtype=np.float64),
            gemm_efficiency=np.array([gemm_efficiency(a, precision) for a in accelerators], dtype=np.float64),
            memory_gb=np.array([usable_memory(a) if u is None else u for a, u in zip(accelerators, usable, strict=True)],
                               dtype=np.float64),
            memory_bw_gb_per_s=np.array([a.memory_bw_gb_per_s for a in accelerators], dtype=np.float64),
            intra_node_gb_per_s=np.array(intra, dtype=np.float64),
            devices_per_node=np.array(dpn, dtype=np.int64),
            inter_node_gbps=np.array(nic, dtype=np.float64),
            tdp_w=np.array([a.tdp_w for a in accelerators], dtype=np.float64),
            price_per_hour=np.array([np.nan if p is None else p for p in price], dtype=np.float64),
            attention_tflops=np.array([attention_tflops(a, precision) for a in accelerators], dtype=np.float64),
            flash2_attention_tflops=np.array([flash2_attention_tflops(a, precision) for a in accelerators],
                                             dtype=np.float64),
            flash_attention=np.array([has_flash_attention(a) for a in accelerators], dtype=np.bool_),
            host_collectives=np.array([host_collectives(a) for a in accelerators], dtype=np.bool_),
            compiled_memory=np.array([compiled_memory(a) for a in accelerators], dtype=np.bool_),
            matrix_unit=np.array([float(a.matrix_unit or 0) for a in accelerators], dtype=np.float64),
            profiles=profs,
            collective_gb_per_s=table,
        )

    @classmethod
    def from_catalog(
        cls,
        catalog: Any,
        ids: Sequence[str],
        precision: str = "bf16",
        *,
        devices_per_node: Mapping[str, int] | None = None,
        inter_node_gbps: Mapping[str, float] | None = None,
        price_per_hour: Mapping[str, float] | None = None,
        usable_memory_gb: Mapping[str, float] | None = None,
        peer_to_peer: Mapping[str, bool] | None = None,
        collective_gb_per_s: Mapping[str, Mapping[int, float]] | None = None,
    ) -> DeviceTable:
        """Rows for catalog ids; per-id overrides as in a plan's ``network``/``pricing``.

        Without a price override the catalog's cheapest on-demand offer is used (NaN if none).
        """
        accs = [catalog.accelerator(i) for i in ids]
        dpn = devices_per_node or {}
        nic = inter_node_gbps or {}
        prices = price_per_hour or {}
        usable = usable_memory_gb or {}
        return cls.from_accelerators(
            accs,
            precision,
            devices_per_node=[dpn.get(a.id, a.devices_per_node) for a in accs],
            inter_node_gbps=[nic.get(a.id, a.inter_node_gbps) for a in accs],
            price_per_hour=[prices[a.id] if a.id in prices else cheapest_price_per_hour(catalog, a.id) for a in accs],
            usable_memory_gb=[usable.get(a.id) for a in accs],
            peer_to_peer=[(peer_to_peer or {}).get(a.id) for a in accs],
            collective_gb_per_s=[(collective_gb_per_s or {}).get(a.id) for a in accs],
        )

    def index(self, acc_id: str) -> int:
        """Row of an accelerator id."""
        return self.ids.index(acc_id)


@dataclass(frozen=True)
class Candidates:
    """Struct of arrays: N candidate groups. Build with :meth:`make` (broadcasts scalars)."""

    accelerator: IntArray
    """Row in the :class:`DeviceTable`."""
    tp: IntArray
    """Tensor-parallel degree (must divide heads and KV heads; the caller filters)."""
    pp: IntArray
    """Pipeline stages (layers split evenly, see module docstring)."""
    replicas: IntArray
    """Data-parallel replicas in the group."""
    micro_batch: IntArray
    """Sequences per micro-batch."""
    num_micro_batches: IntArray
    """Micro-batches per replica per optimizer step (gradient accumulation / pipeline depth m)."""
    zero_stage: IntArray
    """0-3, sharding over the group's ``replicas`` (ZeRO/FSDP)."""
    recompute: IntArray
    """:data:`RECOMPUTE_CODES` (0 none, 1 selective, 2 full, 3 matmuls, 4 dots)."""
    offload: IntArray
    """:data:`OFFLOAD_CODES` (0 none, 1 optimizer, 2 optimizer+params)."""
    sequence_parallel: BoolArray
    """Megatron sequence parallelism inside TP groups."""

    @classmethod
    def make(
        cls,
        *,
        accelerator: Any,
        tp: Any,
        pp: Any,
        replicas: Any,
        micro_batch: Any,
        num_micro_batches: Any,
        zero_stage: Any = 0,
        recompute: Any = 0,
        offload: Any = 0,
        sequence_parallel: Any = False,
    ) -> Candidates:
        """Broadcast scalars/arrays to a common shape ``(N,)``."""
        ints = np.broadcast_arrays(
            *(np.asarray(x, dtype=np.int64) for x in
              (accelerator, tp, pp, replicas, micro_batch, num_micro_batches, zero_stage, recompute, offload)),
            np.asarray(sequence_parallel, dtype=np.bool_),
        )
        arrs = [np.atleast_1d(np.ascontiguousarray(a)) for a in ints]
        return cls(
            accelerator=arrs[0], tp=arrs[1], pp=arrs[2], replicas=arrs[3], micro_batch=arrs[4],
            num_micro_batches=arrs[5], zero_stage=arrs[6], recompute=arrs[7], offload=arrs[8],
            sequence_parallel=arrs[9],
        )

    def __len__(self) -> int:
        return int(self.tp.shape[0])

    @property
    def num_devices(self) -> IntArray:
        """Devices per candidate group (tp * pp * replicas)."""
        return self.tp * self.pp * self.replicas

    @property
    def sequences_per_step(self) -> IntArray:
        """Sequences the group processes per optimizer step."""
        return self.replicas * self.micro_batch * self.num_micro_batches


@dataclass(frozen=True)
class BatchEstimate:
    """Per-candidate results, all ``(N,)`` arrays. Times are seconds per optimizer step of the group."""

    step_time_s: FloatArray
    """Wall time of one optimizer step for the group's own batch (sum of the parts below)."""
    compute_s: FloatArray
    """Matmul time (incl. recompute) on the critical path, pipeline steady state."""
    memory_s: FloatArray
    """Memory-bandwidth-bound time: norms, activations, softmax, optimizer step, offload traffic."""
    tp_comm_s: FloatArray
    """Exposed tensor-parallel all-reduce / reduce-scatter+all-gather time."""
    pp_comm_s: FloatArray
    """Exposed pipeline point-to-point time."""
    dp_comm_s: FloatArray
    """Exposed data-parallel (ZeRO) gradient/parameter collective time."""
    bubble_s: FloatArray
    """Pipeline fill/drain time."""
    weights_gb: FloatArray
    """Per device, worst stage: weights."""
    grads_gb: FloatArray
    """Per device, worst stage: gradients."""
    optimizer_gb: FloatArray
    """Per device, worst stage: optimizer state (fp32 master + Adam moments), 0 when offloaded."""
    activations_gb: FloatArray
    """Per device, worst stage: activations of the micro-batches in flight (+ logits, workspace)."""
    memory_gb: FloatArray
    """Per device, worst stage: total (the four above plus the fixed runtime reserve)."""
    capacity_gb: FloatArray
    """Usable device memory (capacity minus the allocator/fragmentation reserve)."""
    fits: BoolArray
    """``memory_gb <= capacity_gb`` on every stage."""
    tokens_per_s: FloatArray
    """Group throughput: sequences_per_step * seq_len / step_time_s."""
    model_tflops_per_device: FloatArray
    """Model FLOPs (no recompute) per second per device, in TFLOP/s."""
    mfu: FloatArray
    """model_tflops_per_device / dense peak."""
    power_kw: FloatArray
    """Group power draw (TDP x devices x host overhead), kW."""
    cost_per_hour: FloatArray
    """Group price per hour (NaN where a price is unknown)."""
    bottleneck: IntArray
    """Index into :data:`BOTTLENECKS`."""
    num_devices: IntArray
    """Devices in the group."""
    extra: dict[str, FloatArray] = field(default_factory=dict)
    """Further named parts (for explanations); not part of the stable contract."""
