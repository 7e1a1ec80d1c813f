"""Write the DT-FM validation cases: Megatron-LM baselines of "Decentralized Training of Foundation Models in
Heterogeneous Environments" (Yuan et al., NeurIPS 2022, arXiv:2206.01288) on 64 V100-16GB at AWS, read from the
authors' results files (not copied here: DS3Lab/Decentralized_FM_alpha has no licence file). Usage, from this
folder:

    git clone https://github.com/DS3Lab/Decentralized_FM_alpha /tmp/dtfm
    git -C /tmp/dtfm checkout cb03043b4d56c236476a375756a5ff2c4cfca685
    python make_cases.py /tmp/dtfm

Figures (each case's ``source:`` names its file, table, row and column):

- ``results/NeurIPS2022_submission.md`` (last changed in e0173a1e, 2022-08-08), "Case 1 Data Center on Demand"
  (8 x p3.16xlarge: 8 V100 per instance, "Inter-instance bandwidth 25 Gbps"), table "One iteration runtime (in
  seconds)": columns Megatron-P8 (PP 8, TP 1, DP 8), Megatron-T8 (TP 8, DP 8), Megatron-P2T4, Megatron-P4T2 (three
  repeats, "Seed 2022 2023 2024": the case takes their mean; Megatron has no seed-dependent placement here:
  ``scripts/aws_run_megatron_training.sh`` maps rank i to host i), rows L24/L32/L40 x B1024/B2048/B4096 (``-``:
  not run). Micro-batch 1 ("Shared settings (GPT-XL)").
- ``results/gpt3_xl_fp16.md`` (last changed in 9be8558f, 2022-05-03), "Result of Megatron (2022/04/26)", "8
  P3.16xlarge for GPT-XL" and "Extend GPT3-XL to 32/40 layer" (24/32/40 layers, global batch 1024): the micro-batch
  2 and 4 rows of the four D-8 layouts and the micro-batch 1 row of P-8 T-8 D-1 (the micro-batch 1 rows of the
  D-8 layouts are the NeurIPS table's runs above, which supersede them: the two agree except the P-8 column,
  16.91 / 26.40 / 28.02 s there against 24.34 / 26.80 / 28.62 s in the later table; the later ones are used);
  "8 P3.16xlarge for GPT-39B" (48 layers, h 8192, sequence 1024, global batch 1024, P-8 T-8 and P-16 T-4, DP 1).
- the same file, "Megatron in Slow network (2022/04/27)", row "64 p3.2xlarge" (one V100 per instance) of the
  GPT-XL standard (24 layers), GPT-XXL (32 layers) and 40-layer tables: four layouts each at micro-batch 1, global
  batch 1024. The rows with ``tc`` delays (10 ms / 50 ms at 1 Gbit/s) are left out: the plan format has no link
  latency, so those cases could not state the network they ran on.

What ran (``scripts/local_scripts/megatron_gpt3_xl_mp8_dp8.sh`` at d5e34b92 (micro-batch as argument, the
04/26 tables), 9d9fed80 and HEAD (micro-batch 1); ``megatron_gpt3_39b_mp8_dp8.sh``; ``dist_megatron_train_qqp.py``):
NVIDIA Megatron-LM (a sibling clone, ``sys.path.append('../Megatron-LM')``; its commit is not recorded) with
``--num-layers L --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --fp16 --checkpoint-activations
--DDP-impl local --no-bias-dropout-fusion --optimizer sgd``, tokenizer ``BertWordPieceLowerCase`` over
``bert-large-cased-vocab.txt`` (28,996 tokens, padded by Megatron to a multiple of 128 x TP: 29,056 at TP 1; the
model files take 29,056 for every TP, 0.1 % of the parameters). The model is Megatron's ``Classification`` (QQP):
the same transformer layers (GELU MLP of 4h, biases, LayerNorm, learned positions, dropout 0.1, padding mask),
an embedding and no vocabulary projection: its head is a pooler (h x h) and a 2-way classifier on the first
token (4.2M parameters, 0.3 %, left out of the model files). Hence the model files name the bare ``GPT2Model``
(no LM head, ``costmodel.shapes.uses_lm_head``) and there is no tied-embedding all-reduce.

How the runs were read:

- Time: ``train_qqp`` runs one untimed warm-up iteration, then times each benchmark iteration with Megatron's
  timers, which print on the last rank; the tables give one iteration's seconds. tokens/s = GBS x seq / seconds.
- Training: ``--checkpoint-activations`` = ``recompute: full`` (Megatron's ``CheckpointFunction``: the whole layer
  again, ``recompute_early_stop: false``); fp16 with fp32 master weights; ``--DDP-impl
  local`` all-reduces the contiguous fp16 gradient buffer once after the last micro-batch's backward
  (``megatron_train_step`` calls ``allreduce_gradients()`` after ``forward_backward_func``:
  ``overlap_grad_reduce: false``; no ``--accumulate-allreduce-grads-in-fp32``: 16-bit reduction); Megatron's fused
  scale-mask-softmax over materialised scores (``attention: eager``, ``softmax_fusion: megatron``: its kernel
  conditions for a padding mask are the causal ones here, as the batches per block are 4 at these lengths);
  1F1B (Megatron's non-interleaved schedule); ``--optimizer sgd`` with Megatron's default ``--sgd-momentum 0.9``
  (``optimizer: sgd``: one fp32 momentum per parameter beside the fp32 master copy).
- Layout and ranks: Megatron's order (TP fastest, then DP, then PP), the planner's: on p3.16xlarge a node holds
  8 consecutive ranks (P8 D8: 8 replicas of one stage; T8: one TP group; P4T2 and P2T4: TP 2 x DP 4 / TP 4 x DP
  2 of one stage). L / PP layers per stage (every L here divides by every PP).
- Network: p3.16xlarge: NVLink inside the instance (the catalog's V100 SXM2), 25 Gbit/s between instances (the
  NeurIPS file's "Inter-instance bandwidth 25 Gbps", AWS's line rate). p3.2xlarge: what NCCL reached between two
  such instances in ``results/network_benchmarks.md`` (row "default (about 0.1ms; up to 10Gbps)", column
  NCCL-128 MB: 112 ms for 128 MiB, i.e. 9.59 Gbit/s; ``network.achieved_gbps``); TP groups there span instances.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from statistics import mean

COMMIT = "cb03043b4d56c236476a375756a5ff2c4cfca685"
REPO = "DS3Lab/Decentralized_FM_alpha"
NEURIPS = "results/NeurIPS2022_submission.md"
FP16 = "results/gpt3_xl_fp16.md"
HERE = Path(__file__).parent
VOCAB = 29056  # bert-large-cased-vocab.txt's 28,996 tokens padded to a multiple of 128
P3_16X = ("  devices_per_node: {v100-16gb-sxm: 8}\n  inter_node_gbps: {v100-16gb-sxm: 25}\n", "8 x p3.16xlarge")
P3_2X = ("  devices_per_node: {v100-16gb-sxm: 1}\n  inter_node_gbps: {v100-16gb-sxm: 9.59}\n  achieved_gbps: true\n",
         "64 x p3.2xlarge")
MODELS = {  # name: (layers, hidden, heads, positions)
    "megatron-cls-l24": (24, 2048, 16, 2048),
    "megatron-cls-l32": (32, 2048, 16, 2048),
    "megatron-cls-l40": (40, 2048, 16, 2048),
    "megatron-cls-39b": (48, 8192, 64, 1024),
}


def table_after(text: str, *markers: str) -> list[list[str]]:
    """Cells of the first markdown table after the markers (found in order), header row first."""
    pos = 0
    for marker in markers:
        pos = text.index(marker, pos) + len(marker)
    rows: list[list[str]] = []
    for line in text[pos:].splitlines():
        line = line.strip()
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if not all(re.fullmatch(r"-+", c) for c in cells):
            rows.append(cells)
    return rows


def seconds(cell: str) -> float | None:
    """The seconds of a table cell (``12.52 s`` or ``12.52``); None for ``-``."""
    m = re.fullmatch(r"([0-9.]+)\s*s?", cell)
    return float(m.group(1)) if m else None


def write_models() -> None:
    (HERE / "models").mkdir(exist_ok=True)
    for name, (layers, hidden, heads, positions) in MODELS.items():
        cfg = {"model_type": "gpt2", "architectures": ["GPT2Model"], "n_layer": layers, "n_embd": hidden,
               "n_head": heads, "n_inner": 4 * hidden, "vocab_size": VOCAB, "n_positions": positions,
               "activation_function": "gelu",
               "_comment": f"Megatron-LM Classification (QQP) of DT-FM's baselines: {layers} layers, h {hidden}, "
                           f"{heads} heads, no LM head; see ../make_cases.py"}
        (HERE / "models" / f"{name}.json").write_text(json.dumps(cfg, indent=2) + "\n")


def case(name: str, model: str, seq: int, gbs: int, pp: int, tp: int, dp: int, mbs: int, secs: float,
         network: tuple[str, str], where: str) -> None:
    layers = MODELS[model][0]
    where = where.replace("'", "''")  # inside the single-quoted YAML scalar
    assert layers % pp == 0, (name, layers, pp)
    stage = f"{{accelerator: v100-16gb-sxm, tp: {tp}, layers: {layers // pp}" + (f", repeat: {pp}}}" if pp > 1 else "}")
    text = (f"model: models/{model}.json\n"
            f"train: {{seq_len: {seq}, global_batch: {gbs}, precision: fp16, mode: full, zero_stage: 0, "
            f"recompute: full, recompute_early_stop: false, schedule: 1f1b, attention: eager, softmax_fusion: megatron, overlap_grad_reduce: false, "
            f"optimizer: sgd}}\n"
            f"groups:\n- replicas: {dp}\n  micro_batch: {mbs}\n  stages:\n  - {stage}\n"
            f"network:\n{network[0]}"
            f"measured: {{tokens_per_s: {gbs * seq / secs:.2f}, step_time_s: {secs:g}}}\n"
            f"source: 'DT-FM Megatron-LM baseline (Yuan et al., NeurIPS 2022, arXiv:2206.01288), {network[1]} "
            f"(V100-SXM2-16GB): {REPO}@{COMMIT[:8]} {where}; PP {pp}, TP {tp}, DP {dp}, micro-batch {mbs}, "
            f"global batch {gbs}, seq {seq}; tokens/s = {gbs} x {seq} / {secs:g} s'\n")
    (HERE / f"{name}.yaml").write_text(text)


def neurips_case1(text: str) -> None:
    rows = table_after(text, "## Case 1 Data Center on Demand", "One iteration runtime")
    header = rows[0]
    cols = [(8, 1, 8, [1]), (1, 8, 8, [2]), (2, 4, 8, [3]), (4, 2, 8, [4, 5, 6])]  # P8, T8, P2T4, P4T2
    assert header[1] == "Megatron-P8" and header[2] == "Megatron-T8" and header[3] == "Megatron-P2T4" \
        and header[4] == "Megatron-P4T2", header
    for row in rows[2:]:
        m = re.fullmatch(r"L(\d+) B(\d+)", row[0])
        assert m, row
        layers, gbs = int(m.group(1)), int(m.group(2))
        for pp, tp, dp, idx in cols:
            values = [seconds(row[i]) for i in idx]
            if any(v is None for v in values):
                continue
            secs = round(mean(v for v in values if v is not None), 3)
            cells = " / ".join(row[i] for i in idx)
            case(f"dtfm-l{layers}-b{gbs}-p{pp}-t{tp}-d{dp}-mb1", f"megatron-cls-l{layers}", 2048, gbs, pp, tp, dp,
                 1, secs, P3_16X, f"{NEURIPS} Case 1 one-iteration runtime, row L{layers} B{gbs}, column "
                                  f"{header[idx[0]]}: {cells} s" + (" (mean of the three repeats)" if len(idx) > 1 else ""))


def fp16_xl_tables(text: str) -> None:
    tables = {24: table_after(text, "##### 8 P3.16xlarge for GPT-XL"),
              32: table_after(text, "##### Extend GPT3-XL to 32/40 layer", "- 32 layer:"),
              40: table_after(text, "##### Extend GPT3-XL to 32/40 layer", "- 40 layer:")}
    layouts = [(8, 1, 8), (1, 8, 8), (4, 2, 8), (2, 4, 8), (8, 8, 1)]  # the five columns, in order
    for layers, rows in tables.items():
        header = rows[0]
        assert len(header) == 7 and header[5] == "P-8 T-8 D-1", header
        for row in rows[1:]:
            mbs = int(row[0].removeprefix("Micro-batch "))
            for i, (pp, tp, dp) in enumerate(layouts, start=1):
                secs = seconds(row[i])
                if secs is None or (mbs == 1 and dp == 8):  # mb 1, D-8: the NeurIPS table's later runs
                    continue
                case(f"dtfm-l{layers}-b1024-p{pp}-t{tp}-d{dp}-mb{mbs}", f"megatron-cls-l{layers}", 2048, 1024, pp, tp,
                     dp, mbs, secs, P3_16X, f"{FP16} 'Result of Megatron (2022/04/26)', {layers}-layer table, row "
                                            f"{row[0]}, column {header[i]}: {row[i]}")


def fp16_39b_table(text: str) -> None:
    rows = table_after(text, "##### 8 P3.16xlarge for GPT-39B")
    header = rows[0]
    layouts = {1: (8, 8, 1), 2: (16, 4, 1)}
    assert header[1] == "P-8 T-8" and header[2] == "P-16 T-4", header
    for row in rows[1:]:
        mbs = int(row[0].removeprefix("Micro-batch "))
        for i, (pp, tp, dp) in layouts.items():
            secs = seconds(row[i])
            assert secs is not None, row
            case(f"dtfm-39b-b1024-p{pp}-t{tp}-d{dp}-mb{mbs}", "megatron-cls-39b", 1024, 1024, pp, tp, dp, mbs, secs,
                 P3_16X, f"{FP16} '8 P3.16xlarge for GPT-39B', row {row[0]}, column {header[i]}: {row[i]}")


def slow_network_tables(text: str) -> None:
    start = "### Megatron in Slow network"
    tables = {24: table_after(text, start, "- GPT-XL standard:"),
              32: table_after(text, start, "- GPT-XXL (32 layers):"),
              40: table_after(text, start, "- GPT-XXL (40 layers):")}
    layouts = [(8, 1, 8), (1, 8, 8), (4, 2, 8), (2, 4, 8)]
    for layers, rows in tables.items():
        header = rows[0]
        assert header[1:5] == ["P-8 T-1 D-8", "P-1 T-8 D-8", "P-4 T-2 D-8", "P-2 T-4 D-8"], header
        row = next(r for r in rows if r[0] == "64 p3.2xlarge")
        for i, (pp, tp, dp) in enumerate(layouts, start=1):
            secs = seconds(row[i])
            assert secs is not None, row
            case(f"dtfmslow-l{layers}-b1024-p{pp}-t{tp}-d{dp}-mb1", f"megatron-cls-l{layers}", 2048, 1024, pp, tp, dp, 1,
                 secs, P3_2X, f"{FP16} 'Megatron in Slow network (2022/04/27)', {layers}-layer table, row 64 "
                              f"p3.2xlarge, column {header[i]}: {row[i]}")


def main(clone: str) -> None:
    root = Path(clone)
    write_models()
    neurips_case1((root / NEURIPS).read_text())
    fp16 = (root / FP16).read_text()
    fp16_xl_tables(fp16)
    fp16_39b_table(fp16)
    slow_network_tables(fp16)


if __name__ == "__main__":
    main(sys.argv[1])
