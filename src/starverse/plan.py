"""The Plan: the one contract between planner, estimator, runtime, checkpoints and billing.

Everything that runs, runs a Plan; everything that predicts, predicts a Plan. The YAML format is v1 of
DESIGN.md ("plan.yaml"); keep field names, add fields freely (with a default, so old files still load).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, model_validator

from starverse.config import (
    MAX_BATCH,
    MAX_COUNT,
    MAX_GB_PER_S,
    MAX_GBPS,
    MAX_MEMORY_GB,
    MAX_SEQ_LEN,
    MAX_STEPS,
    MAX_TOKENS,
    FrozenModel,
    PathText,
    load_file,
)

Precision = Literal["bf16", "fp16", "fp8", "fp32", "tf32"]
"""``tf32``: fp32 weights and activations, matmuls on TF32 tensor cores (NVIDIA Ampere and later; PyTorch's
``allow_tf32`` or NGC containers' ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1``); elsewhere it runs as fp32."""
Mode = Literal["full", "lora", "qlora"]
Recompute = Literal["none", "selective", "matmuls", "dots", "full"]
Offload = Literal["none", "optimizer", "optimizer+params"]
OptimizerKind = Literal["adamw", "sgd"]
Schedule = Literal["gpipe", "1f1b", "interleaved"]
Attention = Literal["auto", "flash", "flash2", "eager"]
SoftmaxFusion = Literal["always", "megatron", "megatron-bsc-2022", "unfused-fp16"]
PositiveInt = Annotated[int, Field(gt=0, le=MAX_COUNT)]
PositiveFloat = Annotated[float, Field(gt=0)]
Gbps = Annotated[float, Field(gt=0, le=MAX_GBPS)]
"""A link's bandwidth, Gbit/s: at most ``config.MAX_GBPS`` (100 Tbit/s, above any link a node has)."""
GBPerS = Annotated[float, Field(gt=0, le=MAX_GB_PER_S)]
"""A bus bandwidth, GB/s: at most ``config.MAX_GB_PER_S`` (12,500 GB/s)."""
MemoryGB = Annotated[float, Field(gt=0, le=MAX_MEMORY_GB)]
"""A device's memory, GB: at most ``config.MAX_MEMORY_GB`` (100 TB)."""


class TrainSpec(FrozenModel):
    """How the model is trained: shapes, precision and memory-saving choices shared by all groups."""

    seq_len: int = Field(gt=0, le=MAX_SEQ_LEN)
    """Tokens per sequence."""
    global_batch: int = Field(gt=0, le=MAX_BATCH)
    """Sequences per optimizer step, over all data-parallel replicas of all groups."""
    precision: Precision = "bf16"
    """Compute precision of matmuls (weights kept in this precision, fp32 master copy for Adam)."""
    mode: Mode = "full"
    """full: every parameter trained; lora/qlora: frozen base (qlora: 4-bit base) plus low-rank adapters."""
    lora_rank: int = Field(default=16, gt=0, le=MAX_COUNT)
    """Rank of the LoRA adapters (mode lora/qlora)."""
    zero_stage: int = Field(default=0, ge=0, le=3)
    """ZeRO stage over the data-parallel group: 1 shards optimizer state, 2 also gradients, 3 also weights."""
    recompute: Recompute = "none"
    """Activation recomputation: none, selective (the attention core, Korthikanti et al.), matmuls (only the matmul
    outputs kept, the rest recomputed: op-level selective checkpointing, what the runtime runs for both selective
    modes), dots (JAX's ``checkpoint_dots_with_no_batch_dims``, MaxText's ``remat_policy: minimal``: of the
    projections' outputs only those the backward reads; estimates only, the runtime refuses it), full (whole
    layer)."""
    recompute_early_stop: bool = True
    """Full recompute stops as soon as the backward's saved tensors are back (PyTorch's non-reentrant
    ``torch.utils.checkpoint`` since 2.1, pytorch/pytorch#96783 and #96866, which Starverse's runtime and
    ``checkpoint_wrapper(NO_REENTRANT)`` run): a dense block without dropout after its MLP does not run its down
    projection, nor the TP reduction after it, again, unless a LoRA adapter on it saves its input after the frozen
    GEMM (``tests/unit/test_parallel_config.py`` counts both). False:
    the layer's whole forward runs again (Megatron-LM's and DeepSpeed's checkpoint functions, fairscale's, the
    reentrant ``torch.utils.checkpoint``, PyTorch before 2.1). XLA devices follow JAX's remat either way."""
    offload: Offload = "none"
    """Keep optimizer state (and optionally parameters) in host memory."""
    optimizer: OptimizerKind = "adamw"
    """adamw: two fp32 moments per trained parameter (every framework's default); sgd: SGD with momentum 0.9,
    one fp32 momentum per parameter (``torch.optim.SGD``; Megatron-LM's ``--optimizer sgd`` with its default
    ``--sgd-momentum 0.9``). Both keep an fp32 master copy beside 16-bit weights."""
    schedule: Schedule = "1f1b"
    """Pipeline schedule."""
    virtual_stages: int = Field(default=1, gt=0, le=MAX_COUNT)
    """Model chunks per device for the interleaved schedule (v in Narayanan et al. 2021)."""
    sequence_parallel: bool = False
    """Megatron-style sequence parallelism inside TP groups."""
    attention: Attention = "auto"
    """Attention kernel: flash (the platform's fused kernel: cuDNN attention, which Transformer Engine selects
    on Hopper, FlashAttention-2 on Ampere), flash2 (FlashAttention-2 itself — flash-attn 2, PyTorch SDPA's
    flash backend — written for Ampere: on an H100 about 60 % of cuDNN's rate, ``FLASH2_ATTENTION_EFFICIENCY``),
    eager (scores materialised in memory: softmax/dropout kernels over s x s per head, as Megatron-LM before
    2022), or auto (flash where the accelerator has a fused kernel, eager on Volta/Turing-class devices)."""
    grad_reduce_fp32: bool = False
    """Gradients are accumulated and all-reduced in fp32 (Megatron's ``--accumulate-allreduce-grads-in-fp32``,
    the default of its bf16 runs; FSDP's ``MixedPrecision(reduce_dtype=torch.float32)``): twice the data-parallel
    traffic of 16-bit reduction (with ZeRO-3: the gradients' reduce-scatter; the parameter gathers stay 16-bit)."""
    sync_micro_steps: bool = False
    """The framework synchronises the device around every micro-batch's forward and backward (DeepSpeed's
    pipeline engine with ``wall_clock_breakdown: true`` times each micro-step with ``torch.cuda.synchronize``):
    the host's kernel-launch time per layer is then not hidden behind the device's work
    (``constants.HOST_OVERHEAD_PER_LAYER_S``)."""
    num_layer_forwards: int = Field(default=1, ge=1, le=4)
    """Times the framework runs each transformer layer's forward per micro-batch (1 in every framework we know
    of but one: AMP's released Megatron-LM 1.1.5, whose ``ParallelTransformerLayerPipe.forward`` calls the
    layer's forward once to print its output's shape and once more for the result). Each extra forward costs
    the layer's forward compute, TP collectives and kernel launches again, and stores nothing for backward."""
    softmax_fusion: SoftmaxFusion = "always"
    """Where eager attention's fused scale-mask-softmax kernel runs on 16-bit scores: ``always`` (every
    framework's default here), ``megatron`` (Megatron-LM's ``FusedScaleMaskSoftmax.is_kernel_available`` as
    bigscience-workshop/Megatron-DeepSpeed synced it from Megatron-LM on 2022-03-06, 1cb76a64: 16 < seq_len <=
    4096, seq_len % 4 == 0, micro-batch x heads per TP rank divisible by 4 and by the kernel's batches per CUDA
    block, 4 at sequences over 128) or ``megatron-bsc-2022`` (that fork from 9f5f5d4c, 2021-10-21, to
    1cb76a64: seq_len <= 2048, and its ``get_batch_per_block`` received its arguments out of order, so the
    batches per block followed the heads per TP rank instead of the sequence). Elsewhere Megatron falls back
    to ``forward_torch_softmax``: fp32 casts, scale, mask and softmax as separate passes
    (``constants.SOFTMAX_PASS_BYTES["torch-fp32"]``). ``unfused-fp16``: the kernel never runs and the torch softmax
    stays in the 16-bit score dtype (Megatron-LM 1.1.5 launched without ``--scaled-upper-triang-masked-softmax-fusion``
    and without ``--attention-softmax-in-fp32`` / ``--apply-query-key-layer-scaling``, as AMP's runs were:
    an in-place ``masked_fill_`` and ``torch.nn.Softmax``, ``SOFTMAX_PASS_BYTES["torch-fp16"]``)."""
    tp_comm_overlap: bool = False
    """TP collectives run in chunks overlapped with the layer's GEMMs (Transformer Engine userbuffers:
    Megatron's ``--tp-comm-overlap``, NeMo's ``ub_tp_comm_overlap``; needs sequence parallelism): only the
    part longer than the GEMMs is exposed (``costmodel.stage``)."""
    overlap_p2p_comm: bool = False
    """Interleaved pipelines send a chunk's activations while the next chunk computes (Megatron-Core's
    ``overlap_p2p_comm``; NeMo 2.0's ``MegatronCommOverlapCallback`` turns it on whenever pp > 1 and vp > 1):
    only the fill and drain sends are exposed (``costmodel.stage.pipeline_step``). Estimates only."""
    overlap_grad_reduce: bool = True
    """The data-parallel gradient all-reduce overlaps the last micro-batch's backward (PyTorch DDP, Megatron,
    FSDP). False: it runs after the last backward, exposed (DeepSpeed's pipeline engine: its schedule issues
    ``ReduceGrads`` after the final step, ``deepspeed/runtime/pipe/schedule.py``)."""
    flat_grad_allreduce: bool = False
    """Each step the framework copies the gradients into one flat buffer (at most
    ``constants.FLAT_ALLREDUCE_BUCKET_ELEMENTS`` values), all-reduces it and copies it back: DeepSpeed's engine
    without ZeRO (``buffered_allreduce_fallback`` with ``MEMORY_OPT_ALLREDUCE_SIZE``; its pipeline engine runs it
    in ``ReduceGrads`` even with one replica), and its ZeRO-1 optimizer, which runs with ``contiguous_gradients``
    off (since microsoft/DeepSpeed#1246, 2021) and so flattens each ``reduce_bucket_size`` bucket (5e8 values) in
    its own ``buffered_reduce_fallback`` (ZeRO-2 and -3: no effect). The copy exists after the last backward, when the activations are
    freed (``costmodel.memory.flat_grad_buffer_bytes``). With ``fp32_grad_copy`` (``BF16_Optimizer``) the gradients
    reduced are already one flat fp32 tensor per parameter group: no flatten copy, but a cast of the whole tensor
    to the 16-bit communication dtype unless ``grad_reduce_fp32`` (``costmodel.memory.bf16_optimizer_cast_bytes``)."""
    fp32_grad_copy: bool = False
    """The optimizer keeps an fp32 copy of every gradient of the stage, whole (not sharded over the replicas),
    beside the 16-bit ``.grad`` autograd writes: DeepSpeed's ``BF16_Optimizer`` (``fp32_groups_gradients_flat``,
    4 bytes per parameter, into which each micro-batch's bf16 gradients are accumulated; the bf16 ``.grad``
    stays until the next backward). Memory only (the fp32 reduction's traffic is ``grad_reduce_fp32``);
    estimates only."""
    pipe_buffers_keep_outputs: bool | Literal["fp32"] = False
    """The last pipeline stage keeps each micro-batch's output (its logits) in a pipe buffer until the buffer is
    reused two micro-batches later: DeepSpeed's ``PipelineEngine._exec_backward_pass`` returns on the last stage
    before it clears ``pipe_buffers['outputs']``, and ``TrainSchedule.num_pipe_buffers`` keeps at least two. The
    last stage then holds the current micro-batch's logits through its backward and the previous one's.
    ``fp32``: the output kept is the fp32 upcast of 16-bit logits, made by the model's last pipe layer
    (Megatron-DeepSpeed's ``GPTModelPipe`` ends in ``float16_to_fp32``), on which the cross-entropy then works in
    place (``vocab_parallel_cross_entropy``): 4 bytes a value kept, not the 16-bit logits, and at the head's
    forward the two buffers still hold theirs beside the new logits (the engine stores an output only once the
    forward has returned)."""
    tokens: float | None = Field(default=None, gt=0, le=MAX_TOKENS)
    """Total tokens to train (for time and cost of the whole job); alternative to ``steps``."""
    steps: int | None = Field(default=None, gt=0, le=MAX_STEPS)
    """Total optimizer steps (alternative to ``tokens``)."""


class Stage(FrozenModel):
    """One pipeline stage: a tensor-parallel group of ``tp`` devices of one accelerator holding ``layers``."""

    accelerator: str
    """Catalog id of the accelerator (``starverse catalog`` lists them)."""
    tp: int = Field(default=1, gt=0, le=MAX_COUNT)
    """Tensor-parallel degree (must divide attention and KV heads; devices within one node)."""
    layers: int = Field(gt=0, le=MAX_COUNT)
    """Transformer layers held by this stage."""
    repeat: int = Field(default=1, gt=0, le=MAX_COUNT)
    """Number of identical stages in a row (shorthand)."""


class Group(FrozenModel):
    """``replicas`` identical pipelines (data-parallel replicas) of the same stages."""

    replicas: int = Field(default=1, gt=0, le=MAX_COUNT)
    """Data-parallel replicas of this pipeline."""
    micro_batch: int | None = Field(default=None, gt=0, le=MAX_BATCH)
    """Sequences per micro-batch; omitted = the estimator picks the fastest that fits."""
    batch_share: float | None = Field(default=None, gt=0, le=1)
    """Share of ``global_batch`` over all replicas of this group; omitted = proportional to speed."""
    stages: list[Stage] = Field(min_length=1)
    """Pipeline stages in order; their ``layers`` (times ``repeat``) sum to the model's layer count."""
    cp: int = Field(default=1, gt=0, le=MAX_COUNT)
    """Context-parallel degree (Megatron CP: every sequence split over ``cp`` ranks, ring attention). For
    estimates of published long-sequence runs only: the runtime refuses ``cp > 1`` and the planner does not
    search it (docs/costmodel.md)."""

    def expanded_stages(self) -> list[Stage]:
        """Stages with ``repeat`` unrolled."""
        return [s.model_copy(update={"repeat": 1}) for s in self.stages for _ in range(s.repeat)]

    @property
    def num_stages(self) -> int:
        """Pipeline depth."""
        return sum(s.repeat for s in self.stages)

    @property
    def devices_per_replica(self) -> int:
        """Devices in one pipeline replica (times its context-parallel degree)."""
        return self.cp * sum(s.tp * s.repeat for s in self.stages)

    @property
    def num_devices(self) -> int:
        """Devices in the whole group."""
        return self.replicas * self.devices_per_replica


class Network(FrozenModel):
    """Optional overrides of the catalog's network defaults."""

    devices_per_node: dict[str, PositiveInt] = Field(default_factory=dict)
    """Devices per node by accelerator id."""
    inter_node_gbps: dict[str, Gbps] = Field(default_factory=dict)
    """NIC bandwidth per node in Gbit/s, by accelerator id (at most 100,000, ``config.MAX_GBPS``)."""
    cross_group_gbps: float | None = Field(default=None, gt=0, le=MAX_GBPS)
    """Bandwidth in Gbit/s per node between nodes of different accelerators, and between the plan's groups whatever
    their accelerators (separate offers, TPU slices over the data-centre network); at most 100,000."""
    links: dict[str, Gbps] = Field(default_factory=dict)
    """Measured Gbit/s between two accelerators' nodes, keyed ``a/b`` (either order; ``a/a`` is between two
    nodes of the same accelerator); overrides ``cross_group_gbps`` and ``inter_node_gbps`` for that pair."""
    achieved_gbps: bool = False
    """Whether ``inter_node_gbps``, ``cross_group_gbps`` and ``links`` are what NCCL itself reached between the
    nodes (a ``torch.distributed`` send/recv or nccl-tests run over them: Sailor's
    ``sailor/profiling/networking/test_sendrecv.py``), not NIC line rates: the cost model then does not take
    ``NETWORK_EFFICIENCY`` (the share of a line rate NCCL reaches) off them a second time."""
    peer_to_peer: dict[str, bool] = Field(default_factory=dict)
    """Whether the nodes of an accelerator allow PCIe peer-to-peer between their GPUs, by accelerator id
    (default: the catalog rule, ``costmodel.constants.NO_PEER_TO_PEER``: GeForce/Titan cards do not). Cloud
    VMs often do not either (AWS G instances: no PCIe P2P); without it NCCL copies through host memory and a
    collective gets half the link."""
    collective_gb_per_s: dict[str, dict[PositiveInt, GBPerS]] = Field(default_factory=dict)
    """Measured all-reduce bus bandwidth (nccl-tests' busbw, GB/s) inside one node of an accelerator, by
    accelerator id and group size (``{rtx-3090: {2: 35.8, 8: 1.35}}``): what NCCL reaches on that node's real
    topology (NVLink bridges, PCIe switches, sockets, host-memory copies); overrides the catalog's link and
    the PCIe fraction for a TP group (and the intra-node part of a DP ring) of that size."""
    usable_memory_gb: dict[str, MemoryGB] = Field(default_factory=dict)
    """Device memory a job can use, GB (10^9 bytes), by accelerator id (ECC and driver reserve taken off);
    overrides the cost model's figure per accelerator."""
    profiles: dict[str, str] = Field(default_factory=dict)
    """Measured profile file (``starverse probe``) by accelerator id, relative to the plan file."""

    @model_validator(mode="after")
    def _link_keys(self) -> Network:
        for key in self.links:
            if key.count("/") != 1 or not all(key.split("/")):
                raise ValueError(f"links: key '{key}' must name two accelerators as 'a/b' (e.g. rtx-4090/a100-80gb-sxm)")
        return self

    def link_gbps(self, a: str, b: str) -> float | None:
        """Measured Gbit/s between nodes of accelerators ``a`` and ``b`` (None when not given)."""
        return self.links.get(f"{a}/{b}", self.links.get(f"{b}/{a}"))

    def node_size(self, acc: Any) -> int:
        """Devices per node of catalog accelerator ``acc`` (its ``id`` and ``devices_per_node``) in this plan:
        ``devices_per_node`` when given, else the catalog's."""
        return int(self.devices_per_node.get(acc.id, acc.devices_per_node))


class Pricing(FrozenModel):
    """What the plan's devices cost (filled by the planner from the pool; else catalog defaults)."""

    currency: str = "USD"
    """ISO currency code of the prices below."""
    price_per_hour: dict[str, PositiveFloat] = Field(default_factory=dict)
    """Price per device-hour by accelerator id."""


class Plan(FrozenModel):
    """A concrete plan: model, training settings and the device groups that run it."""

    model: PathText
    """Registry id, Hugging Face id, or path to a config.json (relative to the plan file)."""
    train: TrainSpec
    """Training settings shared by all groups."""
    groups: list[Group] = Field(min_length=1)
    """Device groups; data parallelism across groups, pipeline/tensor parallelism within."""
    network: Network = Field(default_factory=Network)
    """Network overrides."""
    pricing: Pricing | None = None
    """Prices of the devices used (optional)."""

    @model_validator(mode="after")
    def _shares_sum_to_one(self) -> Plan:
        shares = [g.batch_share for g in self.groups]
        if all(s is not None for s in shares) and abs(sum(shares) - 1.0) > 1e-6:  # type: ignore[arg-type]
            raise ValueError(f"groups[*].batch_share must sum to 1 (got {sum(shares):.4g})")  # type: ignore[arg-type]
        return self

    @property
    def num_devices(self) -> int:
        """Total devices over all groups."""
        return sum(g.num_devices for g in self.groups)

    def accelerators(self) -> list[str]:
        """Accelerator ids used, in order of first appearance."""
        seen: dict[str, None] = {}
        for g in self.groups:
            for s in g.stages:
                seen.setdefault(s.accelerator, None)
        return list(seen)

    def to_yaml(self) -> str:
        """Serialise in the plan-file format (omitting unset optional fields)."""
        return yaml.safe_dump(self.model_dump(mode="json", exclude_none=True), sort_keys=False)


def _resolve_model_path(plan: Plan, base_dir: Path) -> Plan:
    """A relative ``model:`` path (and ``network.profiles`` paths) are relative to the plan file; make them
    absolute."""
    candidate = base_dir / plan.model
    if candidate.is_file():
        plan = plan.model_copy(update={"model": str(candidate.resolve())})
    if plan.network.profiles:
        profiles = {k: str((base_dir / v).resolve()) for k, v in plan.network.profiles.items()}
        plan = plan.model_copy(update={"network": plan.network.model_copy(update={"profiles": profiles})})
    return plan


def load_plan(path: str | Path) -> Plan:
    """Load and validate a plan file (schema only; model/catalog checks happen in the estimator)."""
    plan = load_file(Plan, path)
    return _resolve_model_path(plan, Path(path).parent)


def save_plan(plan: Plan, path: str | Path) -> None:
    """Write a plan file atomically."""
    p = Path(path)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(plan.to_yaml())
    tmp.replace(p)
