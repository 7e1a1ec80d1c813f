"""Every constant of the cost model, with where its value comes from (see docs/costmodel.md).

There is no global MFU constant. Achievable compute follows from the accelerator's dense peak, the
fraction of it that large matmuls reach on that architecture (measured MAMF, below), how much of that
survives in a real multi-device run (:data:`SUSTAINED_FRACTION`; TPUs: :data:`TPU_MATMUL_FRACTION`; the fitted
values are listed in ``costmodel.fit.FITTED``), and the shape of
each matmul (:data:`GEMM_HALF_DIM_PER_FLOP_PER_BYTE`); memory-bound work runs at a fraction of the memory
bandwidth; collectives at a fraction of the link bandwidth. Nothing is fitted per case or per source.
"""

from __future__ import annotations

from typing import Any

from starverse.costmodel.fp32_matmul import fp32_gemm_efficiency

# --- compute -------------------------------------------------------------------------------------------

GEMM_EFFICIENCY: dict[str, float] = {
    # Maximum Achievable Matmul FLOPS (MAMF) / dense peak, BF16, best shape, from S. Bekman,
    # "Machine Learning Engineering", compute/accelerator/README.md, MAMF comparison table (2024-2025).
    "a100-80gb-sxm": 0.869,  # 271.2 / 312
    "a100-40gb-sxm": 0.869,  # same silicon and clocks as the 80 GB SXM part
    "a100-80gb-pcie": 0.811,  # 252.9 / 312 (lower power limit)
    "h100-80gb-sxm": 0.803,  # 794.5 / 989
    "h200-141gb-sxm": 0.803,  # "H200 is the same" (same table)
    "h100-80gb-pcie": 0.75,  # no MAMF published; 350 W part clocks lower than SXM (0.803) -> between SXM and
    # the PCIe/SXM gap seen on A100 (0.811/0.869 = 0.93): 0.803 * 0.93
    "b200": 0.776,  # 1745 / 2250
    "mi250x": 0.767,  # 147.0 / 191.5 per GCD
    "mi300x": 0.601,  # 781.9 / 1300 (ROCm 6.2; the same table lists 668/1300 with TunableOp on 6.3)
}
"""Achievable fraction of dense peak for large, well-shaped matmuls, by accelerator id."""

SUSTAINED_FRACTION = 0.7303
"""Fraction of the single-GPU MAMF that matmuls sustain inside real multi-device training: power- and
thermally-limited clocks across a whole node (Bekman, same chapter, "Not all accelerators are created
equal": 5 %+ spread within one 8-GPU node, the slowest device sets the pace), shapes that are not the
best shape, kernel-launch gaps and framework work between kernels.

FITTED (``costmodel.fit.FITTED``): 0.7303 makes the mean over sources of each source's mean tokens/s error
zero on the runs of data/validation whose matmul efficiency is a measured MAMF (A100/H100: Korthikanti
2022, Megatron-LM 2021, Megatron-Core H100, MosaicML llm-foundry 8-512 GPUs and at 8K-64K tokens, NeMo FP8 on
H100, fms-fsdp, OPT-175B's FSDP on 992 A100s, BigScience's BLOOM-shaped runs on 384 A100s
(0.7447 once those runs stated where their fused softmax fell back, ``train.softmax_fusion``, 0.7436
again once they reduced their gradients in bf16, and 0.7426 once fms-fsdp's cases were the four batch-2 rows
of one README table, ``data/validation/fms-fsdp/make_cases.py``, and 0.7387 once eager attention's 16-bit softmax
counted the passes of Megatron's kernels, ``SOFTMAX_PASS_BYTES``: BigScience's A100 rows, and 0.7292 once
full recompute under PyTorch 2.1's non-reentrant checkpoint skipped the down projection,
``train.recompute_early_stop``: the llm-foundry and fms-fsdp rows, and 0.7303 once llm-foundry's rows
reduce-scattered their gradients in fp32 as Composer's FSDP mixed precision DEFAULT does, ``grad_reduce_fp32``);
0.7383 before
the last two, 0.7491 before llm-foundry's long-sequence rows ``mptlong`` and the FlashAttention-2 rate of the
llm-foundry / fms-fsdp H100 runs, 0.7492 before the FP8 shape term per operand byte and the H100's measured
fused-attention rate, 0.7596
before the Megatron-Core cases stated the TP overlap their README gives, 0.7705 before llm-foundry's
128-512-GPU FSDP rows, ``mptscale``); until issue 9
Sailor's fp32 runs were in this fit too (0.74), and it was 0.769 before the NeMo and fms-fsdp sources.
Leave-one-source-out refits 0.723-0.744 (highest without ``mptlong``, which the model predicts too fast,
pulling it down; lowest without fms-fsdp, whose A100 runs it predicts too slow: docs/costmodel.md), i.e.
it is not specific to one software stack (``scripts/loso.py``; held-out figures in docs/costmodel.md). For
comparison, Bekman quotes ~150-180 TFLOP/s (0.55-0.66 of the A100 MAMF) as what well-tuned whole-model A100
training reached; 0.8 x MAMF is the matmul-only part of that."""

GEMM_EFFICIENCY_FP8: dict[str, float] = {
    # FP8 (e4m3) MAMF / dense FP8 peak, same table (Bekman)
    "h100-80gb-sxm": 0.709,  # 1402.6 / 1979
    "h200-141gb-sxm": 0.734,  # 1453.4 / 1979
    "b200": 0.763,  # 3432.5 / 4500
}
"""Achievable fraction of the dense FP8 peak for large matmuls, where measured."""

FP8_VS_BF16_EFFICIENCY = 0.88
"""FP8 matmuls reach a smaller fraction of their (2x) peak than BF16 ones: H100 0.709 vs 0.803 in the same
MAMF table (ratio 0.88); used for accelerators with an FP8 peak but no FP8 measurement."""

PRE_AMPERE: frozenset[str] = frozenset({"v100-16gb-sxm", "v100-32gb-sxm", "t4", "rtx-2080", "titan-rtx"})
"""Volta (sm70: V100) and Turing (sm75: T4, RTX 2080, Titan RTX) cards: first- and second-generation
tensor cores, no bf16, no FlashAttention-2 (NVIDIA CUDA compute-capability table)."""

TENSOR_CORE_PRECISIONS: frozenset[str] = frozenset({"fp16", "bf16", "fp8"})
"""Precisions whose matmuls run on tensor cores (fp32 training runs on the CUDA cores, no TF32 by default)."""

MEASURED_GEMM_EFFICIENCY: dict[str, float] = {
    # 16-bit torch.mm of n x n matrices, n = 1024-10240, 30 timed calls after 6 warm-up calls, best n
    # (zzc0721/torch-performance-test-data: test.py, database.md and issue #140), over the catalog's dense 16-bit
    # tensor-core peak with fp32 accumulation (as torch runs it)
    "v100-16gb-sxm": 0.779,  # Tesla V100-SXM2-16GB, torch 2.7.0+cu128 (issue #140): 97.36 TFLOP/s at 8192, 95.73
    # at 4096, of 125. Older stacks on the same part reached less: 87 at 8192 (Y. Bulatov 2017, TensorFlow on AWS
    # p3, CUDA 9: 0.70), 83 with cuBLAS (Markidis et al. 2018, "NVIDIA Tensor Core Programmability, Performance &
    # Precision", CUDA 9: 0.66)
    "v100-32gb-sxm": 0.779,  # the same SXM2 silicon, clocks and 125 TFLOP/s peak as the 16 GB part
    "rtx-2080": 0.968,  # 39.03 of 40.3 (database.md, torch 2.8.0+cu128): GeForce boost clocks run above the
    # datasheet's 1710 MHz under load
    # Ampere / Ada cards (database.md fp16 column; its bf16 column is within 3 % on each): GeForce boost clocks run
    # above the datasheet's, so the two GeForce cards reach their rated dense peak or more
    "rtx-3090": 1.065,  # 75.64 of 71 (median of three 24 GB cards, 75.48-75.88; torch 2.6 / 2.8)
    "rtx-4090": 1.008,  # 166.4 of 165.2 (median of four 24 GB cards, 162.35-171.06; torch 2.4 / 2.8)
    "rtx-a6000": 0.778,  # 120.49 of 154.8 (one card, docker)
    "l40s": 0.729,  # 264.02 of 362.05 (one card, docker): a 350 W part below its boost clock on tensor work
}
"""Measured large-matmul fraction of the 16-bit tensor-core peak of cards the MAMF table (:data:`GEMM_EFFICIENCY`)
does not cover (in its place; ``SUSTAINED_FRACTION`` applies on top as to MAMF): fp16 on :data:`PRE_AMPERE` cards
(their bf16 has no tensor cores), fp16 and bf16 on the Ampere / Ada ones, which issue 9 names (RTX 3090 / 4090,
RTX A6000, L40S) and which fell back to ``GEMM_EFFICIENCY_BY_STACK`` before (0.80; none of them runs in a 16-bit
validation case, so these figures are the measurement alone). Not the T4: the same source
measured 41.91 and 42.71 of its 65 TFLOP/s (Colab torch 2.8, Kaggle torch 2.6: 0.645 and 0.657); it keeps
:data:`PRE_AMPERE_EFFICIENCY`, fitted on AMP's T4 runs, so that the fit stays identified and can be set against the
measurement. The V100 is where one blanket fraction was wrong: 0.66 (fitted mostly on T4s) is 15 % below its
0.779 (a 300 W part at its 1530 MHz boost, where the T4 is a 70 W part that does not hold its boost); with it
DLPerf's single-V100 Megatron-LM runs, which have no communication, were predicted 22-28 % too slow
(docs/costmodel.md, ``dlperf``)."""

TPU_MATMUL_FRACTION = 0.7386
"""Fraction of the 16-bit peak that a TPU's (the ``xla`` stack's) matmuls sustain inside training, in the place of
``GEMM_EFFICIENCY_BY_STACK["xla"] x SUSTAINED_FRACTION`` (a GPU figure: MAMF, then what GPU nodes sustain of it). A
TPU matmul is a roofline at this fraction with axes under the MXU's edge padded up (``matmul.systolic_efficiency``,
``Accelerator.matrix_unit``), not the GPU's tile-and-wave shape term. FITTED (``costmodel.fit.FITTED``) on the TPU
runs, MaxText's v5e and v5p tables (``data/validation/maxtext-tpu``): zero mean over the two sources of the mean
signed error of tokens/s. Leave-one-source-out refits it on the other TPU generation: 0.730 on v5p alone, 0.747 on
v5e alone (docs/costmodel.md). It was 0.7328 (0.724 / 0.742) while the slices' gradient sync ran over ICI (the
data-centre network between them was not read and their shards were not all-reduced as XLA does:
``costmodel.batch.sharded_sync_s``), 0.790 (0.756 / 0.829) while full recompute on a TPU ran the whole forward again
(JAX's remat runs only what the backward reads: ``costmodel.stage``), 0.8661 while the cases read MaxText's
per-device batch as the TP group's micro-batch (TP x fewer sequences per FSDP shard: v5p 0.840 / v5e 0.897 held
out), and 0.9301 while TPU matmuls paid the GPU shape term (D = 0.84 x machine balance: 139-202 on v5p / v5e).
What the runs imply directly: were the whole forward run again under full recompute the hardware would run 4/3 of
the FLOPs MaxText counts, and its one-slice v5e runs would have kept the MXUs at 0.75-0.89 of peak over whole steps,
everything that is not a matmul included; before this constant a TPU's matmuls ran at 0.80 x 0.7387 = 0.59 (the 0.80
read off PaLM's whole-model 57.8 % HFU on TPU v4), and every MaxText run was 22-51 % too slow."""

PRE_AMPERE_EFFICIENCY = 0.599
"""Achieved fraction of the tensor-core datasheet peak (in the place of MAMF) of :data:`PRE_AMPERE` cards in fp16
without a measurement in :data:`MEASURED_GEMM_EFFICIENCY` (T4, Titan RTX), and of any of them in bf16 (their fp32
CUDA-core matmuls keep the 0.80 of ``GEMM_EFFICIENCY_BY_STACK``). FITTED (``costmodel.fit.FITTED``) jointly with
:data:`PCIE_COLLECTIVE_FRACTION` and :data:`HOST_OVERHEAD_PER_LAYER_S` on all runs; identified by the runs that use
a T4 in fp16 (AMP's 16 x T4 and V100 + T4 clusters): 0.599, 8 % below the public T4 measurement (0.645-0.657 with
torch 2.6-2.8, :data:`MEASURED_GEMM_EFFICIENCY`'s source), where AMP ran torch 1.7.1+cu110; leave-one-source-out
refits 0.59-0.61 (docs/costmodel.md). It was 0.592 before ``SUSTAINED_FRACTION`` refitted for PyTorch's early stop and FSDP's fp32 reduction
(the fits are joint), 0.6172 while the V100s used it too (BigScience's tr1-13B on 512
V100s identified it with AMP's), 0.6607 before eager attention's 16-bit softmax counted what its kernels move
(``SOFTMAX_PASS_BYTES``; AMP's runs take the fp16 torch softmax, ``softmax_fusion: unfused-fp16``): that value
absorbed score traffic counted twice; 0.21 before issue 9's host-overhead term (it absorbed the per-micro-batch
launch time and made large matmuls too slow: AMP's LM head reaches ~35 % of the T4 peak); and 0.44 before AMP's
cases said that its Megatron-LM runs every layer's forward twice (``train.num_layer_forwards``). Physically: the
T4's 65 TFLOP/s fp16 peak is a 70 W part's boost figure it does not sustain, Turing GeForce/Titan peaks are
boost-clock figures. A measured profile (``starverse probe``) replaces it for the cards a user has."""

GEMM_EFFICIENCY_BY_STACK: dict[str, float] = {
    # No MAMF measurement in the table above (pre-Ampere cards: PRE_AMPERE_EFFICIENCY, fitted): the median
    # of the measured NVIDIA parts (0.80) for other CUDA cards (Ampere/Ada consumer and workstation cards
    # run at their boost clock and reach their dense fp32-accumulate peak similarly), the MI250X figure for
    # ROCm, and for NPU/MLU/CPU the same 0.80 (Ascend/MLU unpublished); XLA's 16-bit matmuls (TPUs) run at
    # TPU_MATMUL_FRACTION, fitted on MaxText's TPU runs; this 0.80 is their fp32 fallback.
    "cuda": 0.80,
    "rocm": 0.767,
    "xla": 0.80,
    "npu": 0.80,
    "mlu": 0.80,
    "cpu": 0.80,  # the probe measures the CPU's achieved matmul TFLOP/s, so its 'peak' is already achieved
}
"""Fallback by software stack for accelerators without a measured MAMF."""

GEMM_HALF_DIM_PER_FLOP_PER_BYTE = 0.84
"""Matmul dimension at which per-dimension overheads cost as much as the useful work, per FLOP/byte of
machine balance (peak FLOP/s / memory bytes/s): D = 0.84 * balance (A100: 153 FLOP/B -> D = 128).

A matmul of M x N x K runs at ``gemm_efficiency / (1 + D/M + D/N + D/K)`` of peak. D is the tile edge
of tensor-core GEMM kernels (CUTLASS/cuBLAS 128x128 and 128x256 CTA tiles): a dimension of D means about
one tile's prologue/epilogue and partial wave per tile of work (wave quantization, pipeline fill of the
K loop). Gives ~0.75 x MAMF at 768 x 768 x 16k and >0.95 x MAMF above 8k per side, consistent with
NVIDIA's "Matrix Multiplication Background User's Guide" (efficiency vs dimension figures).
"""

ATTENTION_HEAD_DIM_HALF = 48.0
"""Fused (Flash) attention runs at ``gemm_efficiency * d / (d + 48)`` for head dim d: a fraction of what
large matmuls reach on the same device.

FlashAttention-2 (Dao 2023, Fig. 4-6, A100, causal, forward+backward counted as 3.5x forward): ~0.50 of
peak at d=64 and ~0.63 at d=128, i.e. 0.58 and 0.72 of the A100 MAMF (0.869); d/(d+48) gives 0.57 and
0.73. The softmax's non-matmul work per score is fixed while the matmul work grows with d.
"""

EAGER_SCORE_BYTES = 8.0
"""fp32 training's eager attention (4-byte scores, ``bv / 2`` times these 16-bit figures), forward bytes per s x s
score element: the QK^T matmul writes the score (2 B), the softmax reads it and writes the probability (4 B), the
PV matmul reads it (2 B); backward ``BACKWARD_ELEMENTWISE_FACTOR`` times as much, with
:data:`EAGER_UNFUSED_SOFTMAX_BYTES` more forward. Kept for fp32 only: 16-bit scores count the passes of the
kernels that move them (:data:`SOFTMAX_PASS_BYTES`). Counted this way the fp32 path charges the score GEMMs'
own write and read again (they are in ``matmul.gemm_time_s``'s roofline) and a 2x backward where the torch ops'
is ~1.1x; re-derived from those ops (scale, ``masked_fill_``, softmax, dropout: 33 B forward, 37 B backward
instead of 41 and 82) Sailor's fp32/TF32 runs on GH200 go from +7 % to +24 % mean error (too fast): what
that accounting compensates there is open (docs/costmodel.md, ``dlperf``)."""

EAGER_UNFUSED_SOFTMAX_BYTES = 16.0
"""Extra forward bytes per score where Megatron's fused scale-mask-softmax kernel cannot run: it needs fp16/bf16
scores (``FusedScaleMaskSoftmax.is_kernel_available``, megatron/model/fused_softmax.py), so fp32/TF32 training
takes ``forward_torch_softmax``: the scores are scaled by the query-key layer scaling factor into a new tensor
(``apply_query_key_layer_scaling`` defaults to True) and masked in place before the softmax, two more passes
of read 4 B + write 4 B than the one fused kernel (Sailor's Megatron-DeepSpeed runs, fp32)."""

SOFTMAX_PASS_BYTES: dict[str, tuple[float, float]] = {
    # Megatron's fused causal kernel (megatron/fused_kernels/scaled_upper_triang_masked_softmax.h, NVIDIA/Megatron-LM
    # 8aa4619f; the same file in DeepSpeed's Megatron-LM 1.1.5 and bigscience's fork): row i of the s x s scores
    # reads its first i + 1 values (``local_seq = blockIdx.x + 1``), 1 B per score on average, and writes the whole
    # row (zeros above the diagonal), 2 B; backward reads the gradient and the probabilities of the same lower
    # triangle (1 + 1 B) and writes the whole row (2 B)
    "fused": (3.0, 4.0),
    # Megatron's forward_torch_softmax with the softmax in fp32 (forced by the default
    # apply_query_key_layer_scaling): input.float() (read 2, write 4), * scale (4 + 4), masked_fill_ (4 + 4),
    # torch.nn.Softmax (4 + 4), .half()/.bfloat16() (4 + 2) = 36 B; autograd backward through the five ops
    # 6 + 12 + 8 + 8 + 6 = 40 B (megatron/model/fused_softmax.py, megatron/model/utils.py attention_mask_func of
    # bigscience-workshop/Megatron-DeepSpeed at 00f5f889, 2022-02-28): where train.softmax_fusion's check fails
    "torch-fp32": (36.0, 40.0),
    # Megatron-LM 1.1.5 without --scaled-upper-triang-masked-softmax-fusion and without
    # --attention-softmax-in-fp32 / --apply-query-key-layer-scaling (AMP's examples/ds_pretrain_gpt2_pipe.sh):
    # FusedScaleMaskSoftmax.forward takes the torch path in the score dtype, gpt2_attention_mask_func's in-place
    # masked_fill_ (read 2, write 2) and torch.nn.Softmax (2 + 2) = 8 B; backward the softmax's (read gradient
    # and output, write: 6) and masked_fill_'s (2 + 2) = 10 B (train.softmax_fusion: unfused-fp16)
    "torch-fp16": (8.0, 10.0),
}
"""Bytes per s x s score element that the softmax of 16-bit eager attention moves, (forward, backward), by the path
it takes (``train.softmax_fusion``, ``costmodel.stage.fused_softmax_runs``). The score GEMMs' own write (QK^T) and
read (PV) are in their roofline (``matmul.gemm_time_s``: max of compute and HBM time), not here. Each forward run
(the recomputed one and AMP's second) moves the forward bytes again."""

EAGER_DROPOUT_SCORE_BYTES = 5.0
"""Attention dropout on the probabilities, per score: forward reads 2 B, writes 2 B and a 1-byte mask (PyTorch's
fused dropout); backward the same 5 B (``_masked_scale``: read gradient 2 B and mask 1 B, write 2 B)."""

HOST_OVERHEAD_PER_LAYER_S = 3.771e-3
"""Host-side time per transformer layer and micro-batch (forward + backward) that the device does not
hide: the CPU launches every kernel of an eager-mode layer (PyTorch dispatch ~10-30 us per operator on a
server CPU, a few hundred operators per unfused layer forward + backward), and a framework that
synchronises the device between pipeline instructions (DeepSpeed's pipeline engine; AMP's runs also time
every instruction, ``wall_clock_breakdown``) exposes that launch time instead of overlapping it. Independent
of the device, so it weighs on small layers and small micro-batches: it is why micro-batch 1 is slower
per sequence than micro-batch 8 on the same plan. Added where ``train.sync_micro_steps`` says so; elsewhere
the launches overlap the device's work and the host's time is a floor: a layer's forward + backward per
micro-batch takes at least this long (launch-bound small layers: Sailor's micro-batch-1 runs of OPT-350M on
4 GH200s take ~3 ms per layer where the device needs ~1.3 ms). FITTED (``costmodel.fit.FITTED``) jointly on
all runs; identified by AMP's (micro-batch 1-32 at fixed layouts) and Sailor's GH200 micro-batch-1 runs;
leave-one-source-out range in docs/costmodel.md."""

# --- memory-bound work ---------------------------------------------------------------------------------

MEMORY_BW_EFFICIENCY = 0.80
"""Achieved fraction of peak HBM bandwidth for elementwise/normalisation kernels (STREAM-like copies reach
~0.9 of peak on A100/H100 (e.g. BabelStream results); framework elementwise kernels with strided
accesses and small launches run lower, PyTorch's own benchmarks show 0.75-0.85)."""

BACKWARD_ELEMENTWISE_FACTOR = 2.0
"""Backward of an elementwise/norm op moves about twice the forward bytes (reads saved input and
upstream gradient, writes the input gradient; norm backward also reads statistics)."""

ADAM_BYTES_PER_PARAM = 36.0
"""Optimizer step traffic per parameter held: read fp32 master, m, v (12) and 16-bit grad (2) or fp32 main
grad (4), write master, m, v (12), write the 16-bit weight copy (2), zero the grad (2-4): ~36 bytes."""

SGD_BYTES_PER_PARAM = 28.0
"""SGD with momentum (``TrainSpec.optimizer: sgd``): Adam's traffic less one fp32 moment read and written
(``ADAM_BYTES_PER_PARAM`` − 8)."""

OPTIMIZER_STATE_BYTES = {"adamw": 8.0, "sgd": 4.0}
"""Optimizer state per trained parameter beside the fp32 master copy: Adam's m and v, SGD's momentum (fp32)."""

CROSS_ENTROPY_BYTES_PER_LOGIT = 12.0
"""Loss over the vocabulary: logits read in 16 bit, softmax in fp32 written/read, gradient written in 16 bit
(2 + 4 + 4 + 2 bytes per logit, Megatron's vocab-parallel cross entropy)."""

# --- communication --------------------------------------------------------------------------------------

LINK_EFFICIENCY = 0.78
"""NCCL bus bandwidth / link bandwidth: all-reduce busbw ~230-240 GB/s on NVLink-3 (300 GB/s per
direction, DGX A100 nccl-tests), ~360 GB/s of 450 on H100 NVLink-4."""

NETWORK_EFFICIENCY = 0.90
"""Achieved fraction of NIC line rate for large collectives over InfiniBand/RoCE (nccl-tests multi-node
all_reduce busbw ~185 GB/s on 8x200 Gb/s HDR per DGX A100 node). Not taken off a figure that a plan states as
what NCCL itself reached between its nodes (``network.achieved_gbps``, ``costmodel.step.line_rate_gbps``)."""

COLLECTIVE_LATENCY_S = 10e-6
"""Latency per log2(n) step of one collective: NCCL switches to tree/LL protocols for latency, so an
n-rank collective costs about 2*log2(n) of these (nccl-tests: an 8-byte all-reduce takes ~20-30 us on 8
GPUs of one node and ~100 us over a few hundred nodes). Also the fixed cost of one pipeline send."""

NCCL_BASE_LATENCY_S = 8.4e-6
"""Fixed latency of one NCCL collective, Simple protocol (ring and tree): ``baseLat`` of NCCL's tuning model
(NVIDIA/nccl ``src/graph/tuning.cc``, NCCL 2.19-2.2x; :func:`costmodel.comm.nccl_latency_s`)."""

NCCL_INTRA_RING_STEP_S = 3.4e-6
"""Latency of one ring step between two GPUs of a node, Simple protocol: NCCL's ``hwLat[NVLINK][Ring][Simple]``
(same source; its PCIe figure, 5.7 us, is not distinguished here)."""

NCCL_NET_RING_STEP_S = 14.0e-6
"""Latency of one ring step across the network, Simple protocol: NCCL's ``hwLat[NET][Ring][Simple]`` (same source;
9.6 us in NCCL 2.10's table)."""

NCCL_INTRA_TREE_STEP_S = 4.0e-6
"""Latency of one tree step inside a node, Simple protocol: NCCL's ``hwLat[NVLINK][Tree][Simple]`` (same source)."""

NCCL_NET_TREE_STEP_S = 14.0e-6
"""Latency of one tree step across the network, Simple protocol: NCCL's ``hwLat[NET][Tree][Simple]`` (same source)."""

CPU_COLLECTIVE_LATENCY_S = 1.3e-4
"""Per-call latency of a gloo collective between CPU ranks (processes of one host): MEASURED, median 8-byte
all-reduce between 2 one-thread ranks, ``scripts/measure_cpu_collectives.py`` on the project's 2-core VM
(0.13 ms, 13x NCCL's :data:`COLLECTIVE_LATENCY_S`). Used instead of it for ranks of the ``cpu`` stack."""

CPU_DTENSOR_COLLECTIVE_S = 3.1e-3
"""What one DTensor collective costs on CPU ranks as the runtime runs it (redistribution and dispatch + a gloo
collective, each rank one thread): a tensor-parallel all-reduce of the split linears, an FSDP2 (ZeRO-3)
all-gather or reduce-scatter. MEASURED by ``scripts/measure_cpu_collectives.py`` (TP 2 fwd+bwd of
bench_parallel's model minus half the unsharded time, per all-reduce counted; 3.1 ms at load ~5 on the 2-core
VM, 5.3 ms at load ~15: it grows with the machine's load). On CPU ranks these many small collectives per layer cost this per call, not bandwidth: it replaces the
latency term of the TP and ZeRO-3 collectives of ``cpu`` rows."""

PARAM_TENSORS_PER_LAYER = 9
"""Parameter tensors of one decoder layer (4 attention projections, 3 gated-MLP linears, 2 norms): the
runtime's ZeRO-1 (``ZeroRedundancyOptimizer``) broadcasts each updated tensor from its owner after the step,
one collective per tensor; priced for ``cpu`` rows, where each costs :data:`CPU_COLLECTIVE_LATENCY_S`."""


def compiled_memory(acc: Any) -> bool:
    """True for accelerators whose device memory a compiler lays out (the ``xla`` stack: TPUs): XLA assigns every
    buffer of the step at compile time, so there is no CUDA context, NCCL buffer or library workspace
    (:data:`RESERVED_GB`) and no caching allocator to fragment (:data:`FRAGMENTATION_FRACTION`); the program's
    peak is its tensors."""
    return getattr(acc, "stack", "cuda") == "xla"


def host_collectives(acc: Any) -> bool:
    """True for accelerators whose ranks are host processes talking over gloo (the ``cpu`` stack)."""
    return getattr(acc, "stack", "cuda") == "cpu"


GRADIENT_BUCKET_BYTES = 25e6
"""Gradients are reduced in buckets (PyTorch DDP bucket_cap_mb=25; Megatron ~40M elements): one collective
latency per bucket."""

FLAT_ALLREDUCE_BUCKET_ELEMENTS = 5e8
"""Values per flat buffer of DeepSpeed's gradient all-reduce without ZeRO (``MEMORY_OPT_ALLREDUCE_SIZE`` in
``deepspeed/runtime/engine.py``; ``allreduce_no_retain`` fills a bucket up to it, ``allreduce_bucket`` flattens it
into a new tensor with ``_flatten_dense_tensors``, all-reduces it and copies it back): the largest transient copy
of a stage's gradients (``TrainSpec.flat_grad_allreduce``)."""

OVERLAP_SM_FRACTION = 0.20
"""Communication overlapped with compute still runs NCCL kernels on the SMs: NCCL uses 16-32 channels,
one CTA each, i.e. ~15-30 % of an A100's 108 or an H100's 132 SMs while a collective is in flight.
Overlapped communication therefore slows compute by this fraction of its own duration (the
compute/communication interference measured e.g. by Rashidi et al. 2021 and Pati et al. 2024, 10-25 %)."""

NO_PEER_TO_PEER: frozenset[str] = frozenset({"rtx-2080", "rtx-3090", "rtx-4090", "titan-rtx"})
"""GeForce/Titan cards whose drivers disable PCIe peer-to-peer: NCCL falls back to its shared-memory
transport, so every byte crosses PCIe twice through host memory (device -> host -> device) and the
usable device-to-device bandwidth is half the link's (NCCL docs, "P2P transport" / NCCL_P2P_DISABLE;
the tinygrad P2P driver patch for the RTX 4090 exists because of this)."""


PCIE_COLLECTIVE_FRACTION = 0.7717
"""Achieved fraction of the per-device PCIe link that NCCL collectives between GPUs of one PCIe-only node
reach, relative to the :data:`LINK_EFFICIENCY` of a GPU-to-GPU fabric (NVLink). On PCIe the ring's traffic
of all GPUs goes through the CPU's root complex (or a shared switch uplink), the messages of tensor
parallelism are a few MB (below NCCL's bandwidth plateau on PCIe, nccl-tests all_reduce_perf reaches a
third to a half of its large-message busbw at 1-4 MB on PCIe systems), and small-message protocols (LL/LL128)
trade bandwidth for latency. FITTED (``costmodel.fit.FITTED``) jointly on all runs; identified by the runs
that use TP or data parallelism inside PCIe nodes without a measured figure (AMP's T4 nodes, without PCIe
peer-to-peer). A node whose all-reduce bus bandwidth was measured per group size (``network.
collective_gb_per_s``: Sailor's consumer nodes, docs/costmodel.md) uses that figure instead: their RTX 3090
node reaches 35.8 GB/s for an NVLink-bridged pair and 1.65 for 8 GPUs, which no single fraction expresses."""


def intra_node_gb_per_s(acc: Any, peer_to_peer: bool | None = None) -> float:
    """Device-to-device bandwidth a collective can use inside a node: PCIe-only nodes reach
    :data:`PCIE_COLLECTIVE_FRACTION` of the link, and half of that again without peer-to-peer
    (``peer_to_peer``: the node's own figure, ``network.peer_to_peer``; None: :data:`NO_PEER_TO_PEER`)."""
    bw = float(acc.intra_node_gb_per_s)
    if getattr(acc, "intra_node_link", "") == "pcie":
        bw *= PCIE_COLLECTIVE_FRACTION
    p2p = acc.id not in NO_PEER_TO_PEER if peer_to_peer is None else peer_to_peer
    return bw if p2p else bw / 2.0


PCIE_HOST_GB_PER_S = 25.0
"""Host<->device copy bandwidth for CPU offload (PCIe 4.0 x16: 32 GB/s line rate, ~25 GB/s achieved)."""

CPU_ADAM_PARAMS_PER_S = 1.0e9
"""CPU Adam throughput per device's shard (DeepSpeed CPU-Adam, AVX-512: ~1e9 params/s per socket-share;
Ren et al. 2021 ZeRO-Offload Table 3)."""

# --- memory reserve -------------------------------------------------------------------------------------

BYTES_PER_DATASHEET_GB = 2**30
"""Datasheet "GB" of device memory are binary: an "80 GB" A100/H100 has 81920/81559 MiB (nvidia-smi), a
"24 GB" RTX 4090 24564 MiB; HBM/GDDR capacities are powers of two."""

USABLE_MEMORY_MIB: dict[str, int] = {
    # nvidia-smi "memory.total" with ECC on (the default of these data-centre parts): ECC takes 1/16 of
    # GDDR6 on T4 and part of HBM2 on V100; figures as printed in public nvidia-smi logs (Google Colab T4
    # "15360MiB", AWS p3 V100-SXM2-16GB "16160MiB", V100-SXM2-32GB "32510MiB", L40S "46068MiB").
    "t4": 15360,
    "v100-16gb-sxm": 16160,
    "v100-32gb-sxm": 32510,
    "l40s": 46068,
}
"""Device memory the driver exposes where it is less than the datasheet capacity (MiB); a plan or pool
overrides it with ``network.usable_memory_gb``."""


def usable_memory_gb(acc: Any) -> float:
    """Device memory a job can allocate from, in GB (1e9 bytes), before the runtime reserve and
    fragmentation: the driver's figure (:data:`USABLE_MEMORY_MIB`) or the binary datasheet capacity."""
    if acc.id in USABLE_MEMORY_MIB:
        return USABLE_MEMORY_MIB[acc.id] * 2**20 / 1e9
    return float(acc.memory_gb) * BYTES_PER_DATASHEET_GB / 1e9


RESERVED_GB = 2.0
"""Fixed device memory not available to tensors: CUDA context (~0.5-1 GB), NCCL buffers, cuBLAS/cuDNN
workspaces."""

NCCL_NVLINK_COMMUNICATOR_GB = {2: 0.544, 3: 0.688}
"""Device memory one NCCL communicator takes on a GPU whose peers in it sit on the same NVLink node, by the
number of ranks in it (2, or 3 and more): measured through PyTorch on 4 x A100 with NVLink after a 4 MB
all-reduce in every possible group (NVIDIA/nccl#964: 544 MB for two ranks, 688 MB for more). NCCL's buffers grow
with its channels (NCCL_BUFFSIZE 4 MiB Simple + LL128 + LL per channel and peer; NVIDIA/nccl#986: "linearly tied
to the number of channels", many more over NVLink than over PCIe), so PCIe and network communicators stay
within :data:`RESERVED_GB`. Hopper runs as many channels or more, so this is a lower bound there. Counted only
where a reading covers the whole device (``validate.device_extra_gb``)."""

FRAGMENTATION_FRACTION = 0.06
"""Caching-allocator fragmentation and transient buffers, as a fraction of device memory (PyTorch reports
reserved - allocated of 5-10 % in long LLM runs); a device-wide reading (nvidia-smi, NVML) of a run is compared
with the tensors times 1 + this fraction plus :data:`RESERVED_GB` (``validate.peak_reading_gb``)."""

# --- precision ------------------------------------------------------------------------------------------

BYTES_PER_VALUE: dict[str, float] = {"bf16": 2.0, "fp16": 2.0, "fp8": 2.0, "fp32": 4.0, "tf32": 4.0}
"""Bytes of a stored activation/weight/gradient value by compute precision (fp8 training keeps bf16
weights and activations and casts per matmul, as Transformer Engine does)."""

GEMM_OPERAND_BYTES: dict[str, float] = {"fp8": 1.0}
"""Bytes per input element of the linear layers' GEMMs, by training precision, where they differ from
:data:`BYTES_PER_VALUE`: Transformer Engine casts both operands of an FP8 GEMM to E4M3 (forward) or E5M2
(gradients), 1 byte each, and writes the output in bf16 (``te.Linear`` under ``fp8_autocast``: the FP8 GEMM
``general_gemm`` / cuBLASLt with FP8 A and B, bf16 D). The matmul shape term (``matmul.gemm_half_dim``) and
the GEMM's HBM traffic use it."""

QLORA_BYTES_PER_PARAM = 0.5 + 0.127 / 8
"""NF4 base weights: 4 bits plus double-quantised constants (0.127 bits/param, Dettmers et al. 2023 §2)."""


NO_FUSED_ATTENTION: frozenset[str] = frozenset(
    {"v100-16gb-sxm", "v100-32gb-sxm", "t4", "rtx-2080", "titan-rtx", "mlu370-x8", "cpu"}
)
"""Accelerators without a fused (Flash) attention kernel in their training stacks: FlashAttention-2 needs
NVIDIA sm80+ (Ampere, Ada, Hopper, Blackwell; Dao 2023, flash-attn README), so Volta (V100) and Turing
(T4, RTX 2080, Titan RTX) run unfused attention; no published fused kernel for Cambricon MLU370; CPU
training runs PyTorch's math attention. AMD CDNA2/3 (CK), TPUs (XLA/Pallas) and Ascend (CANN
FlashAttentionScore) have fused kernels."""


def has_flash_attention(acc: Any) -> bool:
    """Whether ``train.attention: auto`` runs fused attention on this accelerator."""
    return acc.id not in NO_FUSED_ATTENTION


def has_tf32(acc: Any) -> bool:
    """Whether an accelerator has TF32 tensor cores: NVIDIA Ampere and later (not :data:`PRE_AMPERE`)."""
    return getattr(acc, "vendor", "") == "nvidia" and acc.id not in PRE_AMPERE


def peak_tflops(acc: Any, precision: str) -> float:
    """Dense peak TFLOP/s of a ``catalog.Accelerator`` at ``precision``. ``tf32``: half the dense fp16/bf16
    tensor-core peak where :func:`has_tf32` (NVIDIA datasheets: A100 156 of 312, H100 SXM 494.7 of 989.4,
    L40S 181 of 362, RTX 3090 35.6 of 71), else the fp32 peak; other precisions: the catalog's."""
    if precision == "tf32":
        return float(acc.bf16_tflops) / 2.0 if has_tf32(acc) else float(acc.fp32_tflops)
    return float(acc.peak_tflops(precision))


def gemm_efficiency(acc: Any, precision: str = "bf16") -> float:
    """Large-matmul fraction of peak a ``catalog.Accelerator`` sustains in training (MAMF x sustained)."""
    if getattr(acc, "stack", "cuda") == "xla" and acc.id not in GEMM_EFFICIENCY and \
            precision in TENSOR_CORE_PRECISIONS:
        return TPU_MATMUL_FRACTION  # a fraction sustained in training already (no SUSTAINED_FRACTION on top)
    if acc.id in GEMM_EFFICIENCY:
        mamf = GEMM_EFFICIENCY[acc.id]
    elif acc.id in PRE_AMPERE and precision in TENSOR_CORE_PRECISIONS:
        mamf = MEASURED_GEMM_EFFICIENCY.get(acc.id, PRE_AMPERE_EFFICIENCY) if precision == "fp16" \
            else PRE_AMPERE_EFFICIENCY
    elif acc.id in MEASURED_GEMM_EFFICIENCY and precision in TENSOR_CORE_PRECISIONS:
        mamf = MEASURED_GEMM_EFFICIENCY[acc.id]
    else:
        mamf = GEMM_EFFICIENCY_BY_STACK.get(getattr(acc, "stack", "cuda"), 0.80)
    if precision == "tf32" and not has_tf32(acc):
        mamf = GEMM_EFFICIENCY_BY_STACK.get(getattr(acc, "stack", "cuda"), 0.80)
    runs_as = "fp32" if precision == "tf32" and not has_tf32(acc) else precision
    measured = fp32_gemm_efficiency(acc.id, runs_as) if acc.id not in GEMM_EFFICIENCY else None
    mamf = mamf if measured is None else measured
    if precision == "fp8" and getattr(acc, "fp8_tflops", None) is not None:
        mamf = GEMM_EFFICIENCY_FP8.get(acc.id, mamf * FP8_VS_BF16_EFFICIENCY)
    return mamf * SUSTAINED_FRACTION
