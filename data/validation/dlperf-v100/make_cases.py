"""Write the DLPerf validation cases: OneFlow's reproduction of NVIDIA Megatron-LM GPT pre-training on 1-4
nodes of 8 V100-SXM2-16GB with one 100 Gbit/s EDR InfiniBand port per node (Oneflow-Inc/DLPerf, Apache-2.0).

Usage, from this folder: ``python make_cases.py`` (no input: the figures are the repository's tables, copied
below with the commit and file they come from; it writes every ``dlperf-*.yaml`` and the model files under
``models/``).

Source: Oneflow-Inc/DLPerf, ``Megatron-LM/README.md``:

- the test cases table ("测试用例"): per case the nodes, GPUs per node, data-, tensor- and pipeline-parallel
  sizes, micro-batch, accumulation steps, global batch, hidden size, attention heads and layers (``CASES``
  below: DLPerf's own names, ``<group>_<DP>x<TP>x<PP>_<global batch>_<hidden>x<layers>``), at HEAD
  (``COMMIT``, 10f79798, 2021-05-18);
- the results table ("测试结果"), column ``lantency``: milliseconds per iteration (one global batch: the report
  ``reports/GPT/dlperf_gpt_test_report_210512.md`` gives sequences/s = global batch / latency, e.g. 16 / 480.96
  ms = 33.27 for DP_8x1x1), the same at HEAD and at ``MEMORY_COMMIT``;
- the same table's ``memory`` column in MiB, which DLPerf dropped in the next commit (f3227514, 2021-05-18); it is
  read at ``MEMORY_COMMIT`` (7c0c950f, 2021-05-17, "add FLOP"), whose latencies equal HEAD's. What it is: the
  report says "We didn't report GPU Memory Usage in this report because PyTorch uses a caching memory allocator
  and the unused memory managed by the allocator will still show as if used in nvidia-smi", i.e. it is
  ``nvidia-smi``'s used memory (the device's: CUDA context and the allocator's cached blocks included;
  ``peak_memory_scope: device``), as DLPerf's OneFlow GPT runs print it (``OneFlow/LanguageModeling/GPT/
  README.md``: ``utilization.gpu [%], memory.used [MiB]`` per GPU). Which GPU and which moment the single figure
  is are not stated; PyTorch's allocator does not return memory, so after the first iterations the reading is
  the peak of what the process reserved.

What ran (``Megatron-LM/scripts/mutil_perf_pretrain_gpt_dp_mp_pp.sh`` at HEAD): NVIDIA/Megatron-LM at
8aa4619f (2021-03-22) in NGC's PyTorch 20.12 container, ``pretrain_gpt.py`` with ``--seq-length 2048
--max-position-embeddings 2048 --fp16 --checkpoint-activations`` and the GPT-2 BPE vocabulary (``gpt2-vocab.json``:
50,257 tokens), on OpenWebText. Read at that Megatron-LM commit:

- ``--fp16``: fp16 weights with fp32 master copies (``FP16OptimizerWithFP16Params``), Adam (apex ``FusedAdam``,
  Megatron's default optimizer): the plan's default ``optimizer``.
- ``--checkpoint-activations`` with the default ``--checkpoint-num-layers 1``: every layer recomputed
  (``recompute: full``; Megatron's ``CheckpointFunction`` runs the whole layer again: ``recompute_early_stop: false``).
- ``--DDP-impl local`` (the default): after the last micro-batch's backward, ``train_step`` calls
  ``model.allreduce_params``, which flattens every fp16 gradient into one coalesced tensor
  (``_flatten_dense_tensors``), all-reduces it in fp16 (no ``--fp32-allreduce``) and copies it back: not
  overlapped with the backward (``overlap_grad_reduce: false``), a flat copy of the gradients
  (``flat_grad_allreduce: true``; the largest here, 498 M fp16 values on one GPU, is below the bucket bound).
- ``FusedScaleMaskSoftmax`` runs the fused causal kernel whenever the input is fp16, the scores are square and
  ``s <= 2048``: every run here (``softmax_fusion`` ``always``, the default); the attention scores are
  materialised (``attention: eager``).
- Tied embeddings: the GPT model's output layer is the word embedding (its gradient all-reduced between the first
  and last stage when PP > 1); Megatron pads the vocabulary to a multiple of 128 x TP
  (``--make-vocab-size-divisible-by 128``): 50,304 at TP 1, 50,432 / 50,688 / 51,200 / 51,200 / 53,248 at TP 2 / 4 /
  8 / 16 / 32, so each model file is written with the padded size of its case's TP.
- Dropout 0.1 on hidden states and attention probabilities (Megatron's defaults; the GPT-2 config defaults).
- Layers split evenly over the pipeline stages (every layer count here divides by its PP), the embedding on the
  first stage and the output layer on the last; Megatron's rank order (TP fastest, then DP, then PP), which the
  planner uses: TP 16 and TP 32 span 2 and 4 nodes.
- Network: 8 V100-SXM2-16GB per node in the DGX-1 NVLink hybrid cube-mesh (the README's ``nvidia-smi topo -m``:
  NV1/NV2 links, the catalog's ``v100-16gb-sxm``), one Mellanox EDR port per node, "InfiniBand 100 Gb/sec (4X
  EDR)": ``inter_node_gbps: 100``, a line rate (no measured collective rate is given).

Memory kept but not compared (``EXCLUDED_MEMORY``, written as ``measured.peak_memory_excluded`` with the evidence):
``MP_1x32x1_16_3072x32``, whose 9.26 GB is below what each of its ranks holds in Megatron-LM 8aa4619f's code.

Left out: the 2D group's ``2D_8x1x1_16_1536x16`` and ``2D_1x8x1_16_1536x16``, the same configurations as
``DP_8x1x1_16_1536x16`` and ``MP_1x8x1_16_1536x16`` (480.22 / 480.96 ms and 664.64 / 692.44 ms, the same memory):
each case takes the mean of its two runs and names both; DLPerf's OneFlow-GPT runs (another framework) and its
DeepSpeed tables (``DeepSpeed/Megatron-LM/README.md``: 2020 Megatron-GPT2 runs whose model size and launch are
not all stated).
"""

from __future__ import annotations

import json
from pathlib import Path

COMMIT = "10f797983758738c95f10a4a3b1ecc00af1bd7ef"
MEMORY_COMMIT = "7c0c950fd76a1552e6925a4b79d1593dd7ef3814"
REPO = "Oneflow-Inc/DLPerf"
README = "Megatron-LM/README.md"
HERE = Path(__file__).parent
GPU = "v100-16gb-sxm"
SEQ = 2048
VOCAB = 50257

# DLPerf case: (nodes, dp, tp, pp, micro-batch, global batch, hidden, heads, layers), from the test cases table
CASES = {
    "DP_1x1x1_2_1536x16": (1, 1, 1, 1, 2, 2, 1536, 16, 16),
    "DP_8x1x1_16_1536x16": (1, 8, 1, 1, 2, 16, 1536, 16, 16),
    "DP_16x1x1_32_1536x16": (2, 16, 1, 1, 2, 32, 1536, 16, 16),
    "DP_32x1x1_64_1536x16": (4, 32, 1, 1, 2, 64, 1536, 16, 16),
    "MP_1x1x1_8_768x12": (1, 1, 1, 1, 8, 8, 768, 12, 12),
    "MP_1x8x1_16_1536x16": (1, 1, 8, 1, 16, 16, 1536, 16, 16),
    "MP_1x16x1_16_3072x16": (2, 1, 16, 1, 16, 16, 3072, 32, 16),
    "MP_1x32x1_16_3072x32": (4, 1, 32, 1, 16, 16, 3072, 32, 32),
    "2D_2x4x1_16_1536x16": (1, 2, 4, 1, 8, 16, 1536, 16, 16),
    "2D_4x2x1_16_1536x16": (1, 4, 2, 1, 4, 16, 1536, 16, 16),
    "2D_2x8x1_16_2304x24": (2, 2, 8, 1, 8, 16, 2304, 24, 24),
    "2D_4x8x1_32_2304x24": (4, 4, 8, 1, 8, 32, 2304, 24, 24),
    "DP_PP_8x1x4_512_1536x16": (4, 8, 1, 4, 2, 512, 1536, 16, 16),
    "MP_PP_1x8x4_512_2304x24": (4, 1, 8, 4, 16, 512, 2304, 24, 24),
    "2D_PP_2x4x4_512_2304x24": (4, 2, 4, 4, 8, 512, 2304, 24, 24),
    "2D_PP_2x8x2_512_2304x24": (4, 2, 8, 2, 8, 512, 2304, 24, 24),
}
# DLPerf case: ([latency ms of each run], memory MiB), from the results table (twins: the 2D group's rows)
RESULTS = {
    "DP_1x1x1_2_1536x16": ([464.12], 14362),
    "DP_8x1x1_16_1536x16": ([480.96, 480.22], 14938),  # and 2D_8x1x1_16_1536x16
    "DP_16x1x1_32_1536x16": ([664.46], 14508),
    "DP_32x1x1_64_1536x16": ([683.51], 14508),
    "MP_1x1x1_8_768x12": ([611.2], 9810),
    "MP_1x8x1_16_1536x16": ([692.44, 664.64], 12684),  # and 2D_1x8x1_16_1536x16
    "MP_1x16x1_16_3072x16": ([5610.23], 12150),
    "MP_1x32x1_16_3072x32": ([13037.85], 8834),
    "2D_2x4x1_16_1536x16": ([576.48], 9104),
    "2D_4x2x1_16_1536x16": ([593.68], 9642),
    "2D_2x8x1_16_2304x24": ([1313.52], 14928),
    "2D_4x8x1_32_2304x24": ([1508.48], 15004),
    "DP_PP_8x1x4_512_1536x16": ([4893.55], 7130),
    "MP_PP_1x8x4_512_2304x24": ([22166.85], 14204),
    "2D_PP_2x4x4_512_2304x24": ([15331.23], 10018),
    "2D_PP_2x8x2_512_2304x24": ([16281.51], 10554),
}
TWINS = {"DP_8x1x1_16_1536x16": "2D_8x1x1_16_1536x16", "MP_1x8x1_16_1536x16": "2D_1x8x1_16_1536x16"}
# DLPerf case: why its memory figure is kept but not compared (``measured.peak_memory_excluded``): the evidence
# that the logged figure is below what every rank of the plan holds in Megatron-LM 8aa4619f's own code
EXCLUDED_MEMORY = {
    "MP_1x32x1_16_3072x32": (
        "9.26 GB logged is below what every rank of this plan holds in Megatron-LM 8aa4619f at the start of its "
        "backward: mpu/random.py CheckpointFunction saves each layer's whole input (no "
        "--distribute-checkpointed-activations in DLPerf's script, so not split over TP): 32 x 2048 x 16 x 3072 "
        "x 2 B = 6.44 GB; 118.5 M parameters per rank x 18 B (fp16 weights, fp32 master, Adam m and v, and the "
        "fp32 main gradients that FP16OptimizerWithFP16Params._copy_model_grads_to_main_grads allocates at the "
        "first step and zero_grad never frees: fixed upstream in 4fd6432d, 2021-07-09) = 2.13 GB; the recomputed "
        "last layer's replicated tensors (two LayerNorm outputs, the LayerNorm input, two dropout masks: 8 B per "
        "token and hidden value) 0.81 GB and the gradient flowing into it, 0.20 GB: 9.6 GB of tensors before the "
        "CUDA context and NCCL. Its TP 16 twin (MP_1x16x1: same width, micro-batch and parameters per rank, half the "
        "layers) logs 12.74 GB with 3.2 GB less of checkpointed inputs. Which GPU and moment the figure is are "
        "not stated (README)."),
}


def padded_vocab(tp: int) -> int:
    """Megatron's ``_vocab_size_with_padding``: the vocabulary rounded up to a multiple of 128 x TP."""
    multiple = 128 * tp
    return -(-VOCAB // multiple) * multiple


def write_model(hidden: int, heads: int, layers: int, vocab: int) -> str:
    name = f"gpt-h{hidden}-l{layers}-v{vocab}"
    cfg = {"model_type": "gpt2", "n_layer": layers, "n_embd": hidden, "n_head": heads, "n_inner": 4 * hidden,
           "vocab_size": vocab, "n_positions": SEQ, "tie_word_embeddings": True, "activation_function": "gelu_new",
           "_comment": f"Megatron-LM GPT of DLPerf's runs (8aa4619f): {layers} layers, h {hidden}, {heads} heads, "
                       f"GPT-2's 50,257 tokens padded to {vocab}; see ../make_cases.py"}
    (HERE / "models").mkdir(exist_ok=True)
    (HERE / "models" / f"{name}.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return name


def case_name(dlperf: str) -> str:
    _, dp, tp, pp, mbs, gbs, hidden, _, layers = CASES[dlperf]
    return f"dlperf-h{hidden}-l{layers}-dp{dp}-tp{tp}-pp{pp}-mbs{mbs}-gbs{gbs}"


def write_case(dlperf: str) -> None:
    nodes, dp, tp, pp, mbs, gbs, hidden, heads, layers = CASES[dlperf]
    runs, mib = RESULTS[dlperf]
    assert dp * tp * pp == 8 * nodes or (nodes == 1 and dp * tp * pp == 1), dlperf
    assert layers % pp == 0 and gbs % (mbs * dp) == 0, dlperf
    ms = round(sum(runs) / len(runs), 3)
    model = write_model(hidden, heads, layers, padded_vocab(tp))
    stage = f"{{accelerator: {GPU}, tp: {tp}, layers: {layers // pp}" + (f", repeat: {pp}}}" if pp > 1 else "}")
    gpus = dp * tp * pp
    per_node = min(8, gpus)
    twin = TWINS.get(dlperf)
    runs_text = (f"{runs[0]:g} ms, and {runs[1]:g} ms for its twin {twin} (the mean)" if twin else f"{runs[0]:g} ms")
    source = (f"DLPerf's Megatron-LM GPT benchmark (OneFlow; NVIDIA/Megatron-LM 8aa4619f, fp16, "
              f"--checkpoint-activations), {nodes} node(s) of {per_node} V100-SXM2-16GB, 100 Gbit/s EDR InfiniBand: "
              f"{REPO}@{COMMIT[:8]} {README} test cases and results tables, case {dlperf}: DP {dp}, TP {tp}, "
              f"PP {pp}, micro-batch {mbs}, global batch {gbs}, hidden {hidden}, {heads} heads, {layers} layers, "
              f"seq {SEQ}; latency {runs_text}; tokens/s = {gbs} x {SEQ} / {ms:g} ms; memory {mib} MiB "
              f"(nvidia-smi, the results table at {MEMORY_COMMIT[:8]})")
    source = source.replace("'", "''")  # inside the single-quoted YAML scalar
    reason = EXCLUDED_MEMORY.get(dlperf)
    excluded = ", peak_memory_excluded: '" + reason.replace("'", "''") + "'" if reason else ""
    text = (f"model: models/{model}.json\n"
            f"train: {{seq_len: {SEQ}, global_batch: {gbs}, precision: fp16, mode: full, zero_stage: 0, "
            f"recompute: full, recompute_early_stop: false, schedule: 1f1b, attention: eager, overlap_grad_reduce: false, "
            f"flat_grad_allreduce: true}}\n"
            f"groups:\n- replicas: {dp}\n  micro_batch: {mbs}\n  stages:\n  - {stage}\n"
            f"network:\n  devices_per_node: {{{GPU}: {per_node}}}\n  inter_node_gbps: {{{GPU}: 100}}\n"
            f"measured: {{tokens_per_s: {gbs * SEQ / (ms / 1000):.2f}, step_time_s: {ms / 1000:g}, "
            f"peak_memory_gb: {mib * 2**20 / 1e9:.3f}, peak_memory_scope: device{excluded}}}\n"
            f"source: '{source}'\n")
    (HERE / f"{case_name(dlperf)}.yaml").write_text(text)


def main() -> None:
    assert set(CASES) == set(RESULTS)
    for dlperf in CASES:
        write_case(dlperf)


if __name__ == "__main__":
    main()
