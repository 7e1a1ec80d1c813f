"""Write the BigScience tr3m validation cases: the layout benchmark of tr3m-1B3 (a 1.3B GPT-2, Megatron-DeepSpeed,
fp16) on 2 nodes of 4 V100-32GB and 2 nodes of 4 V100-16GB at IDRIS's Jean Zay (bigscience-workshop/bigscience,
Apache-2.0).

Usage, from this folder: ``python make_cases.py`` (no input: the figures are the repository's tables, typed below;
it writes every ``tr3m-*.yaml`` and the model files under ``models/``).

Source: bigscience-workshop/bigscience at commit 9e64edec2ad1fb9263bf39ba616a84ff64b4d947 (``COMMIT``, the commit
the ``bigscience`` cases were read at; ``experiments/tr3m-1B3.md`` last changed in 1dee360c, 2021-12-01):

- ``experiments/tr3m-1B3.md`` ("Benchmarking setup 1B3"): "benchmarked with this slurm setup
  tr3m-1B3-emb-norm-pile.slurm", "Benchmarking on 2 nodes", "Measuring w/o BS-rampup so with full GBS". Three
  tables of NNODES, TP, PP, DP, MBS, Speed, TFlops, Notes: section "32GB node" (``--constraint=v100-32g``,
  ``--gres=gpu:4``), its first table (the script's ``--checkpoint-activations``: ``TABLE_32GB``) and the one
  "After removing ``--checkpoint-activations``" (``TABLE_32GB_NO_RECOMPUTE``); section "16GB node"
  (``--constraint=v100-16g``, "Same as above but with 16GB gpus", with ``--checkpoint-activations``:
  ``TABLE_16GB``). 27 rows, 4 of them "OOM" (Speed "x"), which become ``measured.out_of_memory: true``.
- ``train/tr3-1B3-baseline/tr3m-1B3-emb-norm-pile.slurm`` as committed with the benchmark (76134ddf, 2021-12-01;
  its model and training flags are unchanged at ``COMMIT``): NLAYERS 24, NHIDDEN 2048, NHEADS 16,
  FFN_HIDDEN_SIZE 8192, SEQ_LEN 2048 (= ``--max-position-embeddings``), GLOBAL_BATCH_SIZE 512, the GPT-2 vocabulary
  (``gpt2-vocab.json``: 50,257 tokens), ``--fp16``, ``--checkpoint-activations``, ``--embed-layernorm``, Adam,
  DeepSpeed ``ZERO_STAGE=1`` with ``--deepspeed-activation-checkpointing``, ``$six_ALL_CCFRWORK/code/
  Megatron-DeepSpeed`` (bigscience's fork; read here at its last commit before the benchmark, 06cfbec7,
  2021-12-01: ``MEGATRON_DS``).

How the figures were read:

- Speed is seconds per iteration (one global batch of 512): the md's own TFLOPs formula divides by it,
  ``$ms*4*2*$seqlen*$gbs / ( $sp * $ng * 1e3)`` with ``$ms=1.3; $gbs=512; $seqlen=2048; $ng=8`` ("factor = 3
  here (not 4)" without recompute), and reproduces every row's TFlops column within 0.1 (``check_tflops``; the
  column is derived from Speed and not used). tokens/s = 512 x 2048 / Speed. Speeds are whole seconds, so each
  row's throughput is +-0.5 s, 1-2 % (23-53 s per iteration); which iteration was timed is not stated (the
  global batch is full from the start: no ramp-up).
- Notes is the memory used per GPU, in whole "GB". Read as the device's used memory (``nvidia-smi``, CUDA context
  and the caching allocator's reserve included: ``peak_memory_scope: device``): the md's "calibration" section
  measures the memory a bare CUDA context takes on each card ("V100 16GB 1113MiB"), which only a device-wide
  reading contains. ``nvidia-smi`` counts MiB; the whole "GB" are read as GiB (MiB / 1024, as the ``bigscience``
  cases read the same author's ``nvidia-smi`` figures) and written in GB (10^9 B). Treat them as +-0.5 GiB
  (rounded) and as a reading taken while the run trained, not a logged maximum. Which of the 8 GPUs was read is
  not stated; the author's practice is to "watch the gpu memory usage by logging into one of the nodes"
  (``train/tflops_optimization.md``), and the source's own twins say it was not the fullest GPU: PP 4 /
  micro-batch 8 read 13 GiB on the 32 GB cards but ran out of memory on the 16 GB cards (15.8 GiB), PP 2 /
  micro-batch 8 read 15 GiB and ran out on them too. Read as the first node's GPUs
  (``peak_memory_devices: first_node``: ranks 0-3, stage 0 at PP 2, stages 0-1 at PP 4, 0-3 at PP 8; the last
  stage, with the logits, is on the second node), as the ``bigscience`` cases read the same author's "memory
  used on the first node" (an assumption, chosen after the estimates were seen: the first node is the one that
  holds rank 0 and its logs; with every GPU compared instead the memory median is 13.8 % and the max 54 %,
  the last stage's fp32 pipe buffers at PP 4 / micro-batch 8, against 7.4 % and 19.7 % so). The 16 GB row TP 1 / PP 1 / DP 8 / MBS 1
  reads "16GB borderline OOM": a V100-SXM2-16GB exposes 16160 MiB (15.8 GiB), so that reading was 15.5-15.8 GiB
  rounded up; it is written as 16 GiB like its 32 GB twin (the same layout, "16GB"), which puts it up to 3 %
  above what the device can hold.
- Rank order: Megatron-DeepSpeed's ``PipeModelDataParallelTopology`` (TP fastest, then DP, then PP), the planner's
  order: with 4 GPUs per node, PP 2 puts one stage per node (DP inside the node, the pipeline hop across), PP 4
  two stages per node, PP 8 one stage per GPU; DP 8 and TP 2 x DP 4 reduce across the two nodes.
- Layer split: the fork's ``GPTModelPipe`` passes ``partition_method='type:transformer'`` (``MEGATRON_DS``,
  ``megatron/model/gpt_model.py``): the 24 transformer layers evenly, 24 / PP per stage (PP 1-8 all divide 24),
  the embedding (``TiedLayerSpec('embed', ...)``) on the first stage and its tied copy for the logits on the last.
- Model: a GPT-2 (learned positions: the fork's default ``--position-embedding-type absolute``; LayerNorm; GELU
  MLP of 8192 = 4h; biases; tied embeddings), Megatron's dropout defaults (``--hidden-dropout`` and
  ``--attention-dropout`` 0.1, written into the model files as GPT-2's ``*_pdrop``). The vocabulary is padded to
  a multiple of 128 x TP (``--make-vocab-size-divisible-by 128``): 50,304 at TP 1, 50,432 at TP 2, one model file
  each. ``--embed-layernorm`` adds a LayerNorm after the word embedding (2 x 2048 weights and one h-wide
  activation on the first stage, below this model's resolution); the GPT-2 config has no key for it.
- Training: ``--fp16`` (fp16 weights and gradients, fp32 master weights and Adam moments in DeepSpeed's ZeRO
  stage 1 optimizer: ``zero_stage: 1``), ``--checkpoint-activations`` with the default ``--checkpoint-num-layers
  1`` (``activation_checkpoint_interval`` 1: every layer, ``recompute: full``, the whole
  layer again: ``recompute_early_stop: false``; the table after "removing
  ``--checkpoint-activations``": interval 0, ``recompute: none``). Every PP, PP 1 included, runs DeepSpeed's
  pipeline engine (``GPTModelPipe``, no ``--no-pipeline-parallel``), whose one schedule, ``TrainSchedule``, is
  1F1B without interleaving (``schedule: 1f1b``, stated: unstated, the estimator would also try interleaved
  chunks); it reduces the gradients after the last micro-batch (``overlap_grad_reduce: false``) and its last stage keeps its outputs in the pipe
  buffers (``pipe_buffers_keep_outputs``), as in the ``bigscience`` tr1-13B case (the same fp16 ZeRO-1 setup of
  2021); what they keep is fp32 (``pipe_buffers_keep_outputs: fp32``): ``GPTModelPipe``'s last pipe layer is
  ``float16_to_fp32`` (``MEGATRON_DS``'s ``megatron/model/gpt_model.py`` 290-292) and its ``CrossEntropy`` runs
  ``vocab_parallel_cross_entropy`` in place on that tensor (``megatron/mpu/cross_entropy.py``: ``sub_``,
  ``torch.exp(out=)``, ``div_``, and the backward's ``mul_``); the engine stores a forward's output only once the
  forward has returned (``_exec_forward_pass``, ``deepspeed/runtime/pipe/engine.py`` of microsoft/DeepSpeed at
  fc2f378e, 2021-11-30). The ZeRO-1 optimizer, not the engine's ``buffered_allreduce_fallback``, reduces the
  gradients (``DeepSpeedEngine.allreduce_gradients`` at ZeRO stage 1 calls ``optimizer.reduce_gradients``), but
  it flattens them the same way (``flat_grad_allreduce: true``): at ZeRO stage 1 the engine turns
  ``contiguous_gradients`` off (``_configure_zero_optimizer``, ``deepspeed/runtime/engine.py`` 1356-1359 at
  fc2f378e, since microsoft/DeepSpeed#1246 of 2021-07-26; which DeepSpeed checkout the benchmark ran is not
  stated), so ``reduce_gradients(pipeline_parallel=True)`` allocates no ``ipg_buffer`` (``zero/stage2.py`` 577)
  and its ``reduce_ipg_grads`` (1179-1194) hands each bucket of up to ``reduce_bucket_size`` (default 5e8 values,
  ``zero/constants.py`` 68; a bucket closes before a parameter would pass it, 794-801) to
  ``buffered_reduce_fallback`` (1378), whose ``allreduce_bucket`` (1306-1312) flattens it into a new fp16 tensor
  after the last backward: 1 GB at 5e8 values, the engine's own fallback's bucket (``FLAT_ALLREDUCE_BUCKET_ELEMENTS``,
  the same 5e8). Eager attention (Megatron's fused
  scale-mask-softmax over materialised scores, ``attention: eager``), with the fork's 2021-10-21 .. 2022-03-06
  kernel check (``softmax_fusion: megatron-bsc-2022``: ``MEGATRON_DS``'s ``megatron/model/fused_softmax.py``
  has ``16 < sq <= 2048`` and calls ``get_batch_per_block(sq, sk, b, np)`` on a method declared
  ``(b, np, sq, sk)``; where it then falls back, TP 2 at micro-batch 1, its ``forward_torch_softmax`` keeps fp32
  probabilities for backward, 171-185, which the cost model counts from that same check).
- Network: 4 V100 SXM2 per node over NVLink 2 (``experiments/bandwidth/README.md``: "V100 SXM2 | NVLink 2.0",
  single-node all-reduce 1329 Gbit/s on a 16 GB node, 1324 on a 32 GB node), Omni-Path between nodes (IDRIS:
  "Intel Omni-Path 100 Gb/s"). As in the ``bigscience`` cases (``../bigscience/make_cases.py``, "Network"), the
  nodes state 50 Gbit/s as achieved (``network.achieved_gbps: true``): the repository's NCCL all-reduce over 16
  V100-32GB nodes in 2021 ("fluctuates between 44 and 57 Gbps", "an issue with nccl that doesn't fully utilize
  Intel OPA"). The repository measured no 16 GB nodes across nodes; they are the same machine's other V100
  partition (``jz/hpc-specs.md``: 351 nodes of V100 16 GB beside 261 of V100 32 GB) on the same fabric with the
  same NCCL, so they state the same rate (an assumption, chosen before any estimate of these cases was seen).

Left out: the md's batch-size schedules (plans, not measurements) and its calibration line (a bare CUDA context,
1113 MiB on either card: what the cost model's reserve covers). The source id is ``tr3m``.
"""

from __future__ import annotations

import json
from pathlib import Path

COMMIT = "9e64edec2ad1fb9263bf39ba616a84ff64b4d947"
MEGATRON_DS = "bigscience-workshop/Megatron-DeepSpeed@06cfbec7"
MD = f"bigscience-workshop/bigscience@{COMMIT[:8]} experiments/tr3m-1B3.md"
SLURM = "train/tr3-1B3-baseline/tr3m-1B3-emb-norm-pile.slurm"
HERE = Path(__file__).resolve().parent
GIB = 2**30 / 1e9
SEQ = 2048
GBS = 512
VOCAB = 50257
LAYERS = 24
HIDDEN = 2048
HEADS = 16
FFN = 8192
NODES = 2
PER_NODE = 4

# (TP, PP, DP, MBS, Speed s/it or None = OOM, TFlops or None, Notes GB or None = OOM), as the tables print them
TABLE_32GB = [
    (1, 1, 8, 1, 29, 47.0, 16),
    (1, 1, 8, 2, 29, 47.0, 17),
    (1, 1, 8, 4, 28, 48.7, 20),
    (1, 1, 8, 8, 28, 48.7, 25),
    (1, 2, 4, 1, 30, 45.4, 10),
    (1, 2, 4, 2, 29, 47.0, 11),
    (1, 2, 4, 8, 29, 47.0, 15),
    (1, 2, 4, 16, None, None, None),
    (1, 4, 2, 1, 32, 42.6, 9),
    (1, 4, 2, 8, 32, 42.6, 13),
    (2, 1, 4, 1, 53, 25.7, 11),
]
TABLE_32GB_NO_RECOMPUTE = [
    (1, 1, 8, 1, 23, 44.4, 27),
    (1, 2, 4, 1, 23, 44.4, 21),
    (1, 4, 2, 1, 25, 40.8, 19),
    (1, 4, 2, 2, 24, 42.5, 30),
    (2, 1, 4, 1, 39, 26.2, 21),
]
TABLE_16GB = [
    (1, 1, 8, 1, 29, 47.0, 16),  # "16GB borderline OOM"
    (1, 2, 4, 1, 30, 45.4, 11),
    (1, 2, 4, 2, 29, 47.0, 12),
    (1, 2, 4, 4, 28, 48.7, 13),
    (1, 2, 4, 8, None, None, None),
    (1, 4, 2, 1, 32, 42.6, 9),
    (1, 4, 2, 4, 30, 45.4, 11),
    (1, 4, 2, 8, None, None, None),
    (1, 8, 1, 1, 37, 36.8, 9),
    (1, 8, 1, 4, 35, 38.9, 11),
    (1, 8, 1, 8, None, None, None),
]
# (table, accelerator, recompute, where in the md, name tag)
TABLES = [
    (TABLE_32GB, "v100-32gb-sxm", "full", "section '32GB node', first table (--checkpoint-activations)", "32gb"),
    (TABLE_32GB_NO_RECOMPUTE, "v100-32gb-sxm", "none",
     "section '32GB node', table 'After removing --checkpoint-activations'", "32gb-norecompute"),
    (TABLE_16GB, "v100-16gb-sxm", "full", "section '16GB node' (--checkpoint-activations)", "16gb"),
]


def check_tflops(speed: float, tflops: float, recompute: str) -> None:
    """The md's formula (factor 4 with recompute, 3 without) gives the row's TFlops from its Speed in seconds."""
    factor = 4 if recompute == "full" else 3
    derived = 1.3 * factor * 2 * SEQ * GBS / (speed * NODES * PER_NODE * 1e3)
    assert abs(derived - tflops) <= 0.1, (speed, tflops, derived)


def padded_vocab(tp: int) -> int:
    """Megatron's ``_vocab_size_with_padding``: the vocabulary rounded up to a multiple of 128 x TP."""
    multiple = 128 * tp
    return -(-VOCAB // multiple) * multiple


def write_model(tp: int) -> str:
    """The model file of tr3m-1B3 with the vocabulary padded for ``tp``; returns its path from this folder."""
    vocab = padded_vocab(tp)
    name = f"gpt-1b3-tr3m-v{vocab}.json"
    cfg = {"model_type": "gpt2", "n_layer": LAYERS, "n_embd": HIDDEN, "n_head": HEADS, "n_inner": FFN,
           "vocab_size": vocab, "n_positions": SEQ, "tie_word_embeddings": True, "activation_function": "gelu_new",
           "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
           "_comment": f"tr3m-1B3 ({SLURM}): {LAYERS} layers, h {HIDDEN}, {HEADS} heads, FFN {FFN}, GPT-2's 50,257 "
                       f"tokens padded to {vocab} (TP {tp}), Megatron's 0.1 dropout; see ../make_cases.py"}
    (HERE / "models").mkdir(exist_ok=True)
    (HERE / "models" / name).write_text(json.dumps(cfg, indent=2) + "\n")
    return f"models/{name}"


def row_text(tp: int, pp: int, dp: int, mbs: int, speed: int | None, tflops: float | None, mem: int | None,
             tag: str) -> str:
    """The row as the md prints it."""
    if speed is None:
        return f"NNODES {NODES}, TP {tp}, PP {pp}, DP {dp}, MBS {mbs}, Speed x, Notes OOM"
    note = f"{mem}GB borderline OOM" if tag == "16gb" and (tp, pp, dp, mbs) == (1, 1, 8, 1) else f"{mem}GB"
    return f"NNODES {NODES}, TP {tp}, PP {pp}, DP {dp}, MBS {mbs}, Speed {speed}, TFlops {tflops}, Notes {note}"


def write_case(row: tuple[int, int, int, int, int | None, float | None, int | None], acc: str, recompute: str,
               where: str, tag: str) -> None:
    """One case file from one table row."""
    tp, pp, dp, mbs, speed, tflops, mem = row
    assert tp * pp * dp == NODES * PER_NODE and LAYERS % pp == 0 and GBS % (mbs * dp) == 0, row
    if speed is None:
        measured = "out_of_memory: true"
        read = "; ran out of memory"
    else:
        assert tflops is not None and mem is not None, row
        check_tflops(speed, tflops, recompute)
        measured = (f"tokens_per_s: {GBS * SEQ / speed:.1f}, step_time_s: {speed}, "
                    f"peak_memory_gb: {mem * GIB:.2f}, peak_memory_scope: device, peak_memory_devices: first_node")
        read = f" (Speed read as s/it: tokens/s = {GBS} x {SEQ} / {speed}; Notes read as GiB, nvidia-smi)"
    source = (f"{MD}, {where}, row {row_text(*row, tag)}{read}; model and training flags: {SLURM} (GBS {GBS}, "
              f"seq {SEQ}, fp16, ZeRO 1); network: NCCL's all-reduce over 16 V100-32GB nodes, "
              "experiments/bandwidth/README.md (44-57 Gbit/s sustained)")
    quoted = source.replace("'", "''")  # inside the single-quoted YAML scalar
    stage = f"{{accelerator: {acc}, tp: {tp}, layers: {LAYERS // pp}" + (f", repeat: {pp}}}" if pp > 1 else "}")
    train = (f"seq_len: {SEQ}, global_batch: {GBS}, precision: fp16, mode: full, zero_stage: 1, "
             f"recompute: {recompute}, recompute_early_stop: false, schedule: 1f1b, attention: eager, softmax_fusion: megatron-bsc-2022, "
             "overlap_grad_reduce: false, flat_grad_allreduce: true, pipe_buffers_keep_outputs: fp32")
    text = (f"model: {write_model(tp)}\ntrain: {{{train}}}\ngroups:\n- replicas: {dp}\n  micro_batch: {mbs}\n"
            f"  stages:\n  - {stage}\nnetwork:\n  devices_per_node: {{{acc}: {PER_NODE}}}\n"
            f"  inter_node_gbps: {{{acc}: 50}}\n  achieved_gbps: true\n"
            f"measured: {{{measured}}}\nsource: '{quoted}'\n")
    (HERE / f"tr3m-{tag}-tp{tp}-pp{pp}-dp{dp}-mbs{mbs}.yaml").write_text(text)


def main() -> None:
    """Write every case and model file into this folder."""
    for old in HERE.glob("tr3m-*.yaml"):
        old.unlink()
    for table, acc, recompute, where, tag in TABLES:
        for row in table:
            write_case(row, acc, recompute, where, tag)


if __name__ == "__main__":
    main()
