"""Write the NeMo FP8 DGX-H100 validation cases (NVIDIA's published NeMo training performance).

Usage, from this folder: ``python make_cases.py`` (no input: the figures are the sources' tables, below).

Two tables, two source ids (the case file name up to its first ``-``):

``nemolong``: NeMo "Long Sequence Performance", LLAMA2-7B FP8 on DGX-H100, container NeMo 24.03.01
(NVIDIA/NeMo ``docs/source/performance/performance_long_sequence.md``; the same table on
https://docs.nvidia.com/nemo-framework/user-guide/24.12/nemotoolkit/performance/performance_long_sequence.html).
The with-CP column, whose layout (TP, PP, DP, CP) is stated: at 4K, 8K and 16K those runs use CP = 1 with
the same TFLOPS/GPU as the without-CP column (speedup 1.00), plain TP x PP x DP runs; the 32K-1M rows run
context parallelism (CP 2-32, ``groups[0].cp``; sequence 32K-1M tokens on 32-1024 GPUs). The without-CP column
of the 32K-1M rows is left out (its layout is not given). Models: ``llama-2-7b-16k.json`` up to 16K,
``llama-2-7b-1m.json`` (the same shape, ``max_position_embeddings`` 1M) beyond. The table gives
model TFLOP/s per GPU; tokens/s = TFLOP/s x GPUs / FLOPs per token with NeMo's own ``llama2`` formula
(``nemo/utils/flops_formulas.py``: L h^2 (12 + 12 g/a + 18 f/h + 12 s/h + 6 V/(L h)) per token, the
version without the causal halving) — the formula that reproduces the 24.12 performance table's own pair
for LLAMA2-7B at 4K (16,934 tokens/s/GPU <-> 780 TFLOP/s: 4.61e10 FLOPs per token). Global batch and
micro-batch are not stated: global batch 128 is assumed (the LLAMA2-7B pre-training recipe's, 24.12
table); a PP = 1 run's per-GPU throughput barely depends on it, the 8K PP = 2 run's pipeline bubble does.

``nemo2412``: NeMo 24.12 "Performance Benchmarks", pre-training at FP8 on DGX-H100
(https://docs.nvidia.com/nemo-framework/user-guide/24.12/nemotoolkit/performance/performance_summary.html,
pre-training table): GPUs, GBS, MBS, sequence, TP, PP, CP, VP and tokens/s/GPU all stated. Rows with CP > 1
(LLAMA3-8B, LLAMA3-70B) are left out, and the GPT3-5B/20B rows (model configs not stated on the page).
The page states no recompute or sequence parallelism: the GPT3-175B cases take them from NeMo's own 175B
recipe (``RECIPE_175B``: ``activations_checkpoint_granularity: selective``, ``sequence_parallel: True``;
and ``ub_tp_comm_overlap: True``, TP communication overlapped with the GEMMs: ``train.tp_comm_overlap``); the
Llama-2 70B case takes ``sequence_parallel: true`` from NeMo's Llama-2 70B recipe (``RECIPE_70B``, which has
``ub_tp_comm_overlap: false`` and no recompute); the 7B and 13B cases run TP 1. The 24.12 benchmarks ran
NeMo 2.0, whose ``MegatronCommOverlapCallback`` sets ``overlap_p2p_comm`` for every interleaved pipeline
(pp > 1, vp > 1): ``train.overlap_p2p_comm: true`` on those cases.

FP8: Transformer Engine runs the linear layers' GEMMs in FP8 (weights and activations kept in bf16 and
cast per GEMM, as ``BYTES_PER_VALUE['fp8']`` says) and attention in bf16 (cuDNN fused attention; TE's FP8
attention ``fp8_dpa`` is off by default). DGX-H100: 8 GPUs per node, 8 x 400 Gbit/s ConnectX-7 per node.
"""

from __future__ import annotations

from pathlib import Path

ACC = "h100-80gb-sxm"
NET = f"network:\n  devices_per_node: {{{ACC}: 8}}\n  inter_node_gbps: {{{ACC}: 3200}}\n"
LLAMA2_7B = {"L": 32, "h": 4096, "f": 11008, "a": 32, "g": 32, "V": 32000}
RECIPE_175B = "NVIDIA/NeMo-Framework-Launcher launcher_scripts/conf/training/gpt3/175b.yaml"
RECIPE_70B = ("NVIDIA/NeMo-Framework-Launcher launcher_scripts/conf/training/llama/llama2_70b.yaml "
              "(commit d24f8efb326a34de1d3563930d036684053c67fd)")
LONG_URL = ("NVIDIA/NeMo docs/source/performance/performance_long_sequence.md (NeMo 24.03.01, DGX-H100, "
            "LLAMA2-7B FP8; same table in the 24.12 user guide, performance_long_sequence.html)")
OVERLAP_CB = ("NVIDIA/NeMo nemo/lightning/pytorch/callbacks/megatron_comm_overlap.py (MegatronCommOverlapCallback: "
              "overlap_p2p_comm when pp > 1 and vp > 1)")
SUMMARY_URL = ("NeMo 24.12 user guide, performance_summary.html, pre-training table (FP8, DGX-H100): "
               "https://docs.nvidia.com/nemo-framework/user-guide/24.12/nemotoolkit/performance/performance_summary.html")


def nemo_llama2_flops_per_token(m: dict[str, int], s: int) -> float:
    """NeMo's ``llama2`` model FLOPs per token (flops_formulas.py, without causal halving)."""
    h, L = m["h"], m["L"]
    return L * h * h * (12 + 12 * m["g"] / m["a"] + 18 * m["f"] / h + 12 * s / h + 6 * m["V"] / (L * h))


# (seq K, GPUs, TFLOPS/GPU, TP, PP, DP, CP) — the with-CP column of the long-sequence table
LONG = [(4, 4, 768, 1, 1, 4, 1), (8, 8, 730, 1, 2, 4, 1), (16, 16, 660, 2, 1, 8, 1),
        (32, 32, 610, 2, 1, 8, 2), (64, 64, 574, 4, 1, 8, 2), (128, 128, 555, 4, 1, 8, 4),
        (256, 256, 549, 4, 1, 8, 8), (512, 512, 549, 8, 1, 4, 16), (1024, 1024, 536, 8, 1, 4, 32)]
# (name, model file, GPUs, GBS, MBS, seq, TP, PP, VP, layers, tokens/s/GPU)
SUMMARY = [
    ("gpt3-175b-g128", "models/gpt-175b-v51200.json", 128, 256, 1, 2048, 4, 8, 6, 96, 716),
    ("gpt3-175b-g512", "models/gpt-175b-v51200.json", 512, 2048, 2, 2048, 4, 8, 6, 96, 825),
    ("llama2-7b-g8", "models/llama-2-7b-16k.json", 8, 128, 1, 4096, 1, 1, 1, 32, 16934),
    ("llama2-13b-g16", "models/llama-2-13b.json", 16, 128, 1, 4096, 1, 4, 10, 40, 8715),
    ("llama2-70b-g64", "models/llama-2-70b.json", 64, 128, 1, 4096, 4, 4, 20, 80, 1728),
]


def stages(tp: int, pp: int, layers: int) -> str:
    """One stage line repeated ``pp`` times."""
    rep = f", repeat: {pp}" if pp > 1 else ""
    return f"  - {{accelerator: {ACC}, tp: {tp}, layers: {layers // pp}{rep}}}\n"


def main() -> None:
    """Write every case file into this folder."""
    here = Path(__file__).resolve().parent
    for k, gpus, tflops, tp, pp, dp, cp in LONG:
        s = 1024 * k
        tok = tflops * 1e12 * gpus / nemo_llama2_flops_per_token(LLAMA2_7B, s)
        model = "llama-2-7b-16k" if k <= 16 else "llama-2-7b-1m"
        how = ("without CP = with CP (TP {tp}, PP {pp}, DP {dp}, CP 1, speedup 1.00)" if cp == 1
               else "with CP (TP {tp}, PP {pp}, DP {dp}, CP {cp})").format(tp=tp, pp=pp, dp=dp, cp=cp)
        text = (f"model: models/{model}.json\n"
                f"train: {{seq_len: {s}, global_batch: 128, precision: fp8, mode: full, zero_stage: 1}}\n"
                f"groups:\n- replicas: {dp}\n" + (f"  cp: {cp}\n" if cp > 1 else "") + f"  stages:\n"
                f"{stages(tp, pp, 32)}{NET}"
                f"measured: {{tokens_per_s: {tok:.1f}}}\n"
                f"source: '{LONG_URL}: SeqLen {k}K, {gpus} GPUs, {tflops} TFLOPS/GPU {how}; tokens/s from NeMo "
                f"llama2 FLOPs per token (flops_formulas.py); global batch not stated (128 assumed, see "
                f"make_cases.py)'\n")
        (here / f"nemolong-llama2-7b-s{k}k-g{gpus}.yaml").write_text(text)
    for name, model, gpus, gbs, mbs, s, tp, pp, vp, layers, tps in SUMMARY:
        # NeMo 2.0's MegatronCommOverlapCallback (OVERLAP_CB) overlaps the interleaved schedule's sends
        sched = f", schedule: interleaved, virtual_stages: {vp}, overlap_p2p_comm: true" if vp > 1 else ""
        if name.startswith("gpt3"):  # NeMo's GPT-3 175B recipe (RECIPE_175B): selective recompute, SP, TP overlap
            sched += ", recompute: selective, sequence_parallel: true, tp_comm_overlap: true"
        if name.startswith("llama2-70b"):  # NeMo's Llama-2 70B recipe (RECIPE_70B): SP, no TP overlap
            sched += ", sequence_parallel: true"
        text = (f"model: {model}\n"
                f"train: {{seq_len: {s}, global_batch: {gbs}, precision: fp8, mode: full, zero_stage: 1{sched}}}\n"
                f"groups:\n- replicas: {gpus // (tp * pp)}\n  micro_batch: {mbs}\n  stages:\n"
                f"{stages(tp, pp, layers)}{NET}"
                f"measured: {{tokens_per_s: {tps * gpus}}}\n"
                f"source: '{SUMMARY_URL}: {gpus} GPUs, GBS {gbs}, MBS {mbs}, seq {s}, TP {tp}, PP {pp}, CP 1, "
                f"VP {vp}, {tps} tokens/s/GPU" + (f"; P2P overlap from {OVERLAP_CB}" if vp > 1 else "") + (f"; recompute, SP and TP overlap from {RECIPE_175B}" if name.startswith("gpt3") else
                   f"; SP from {RECIPE_70B}" if name.startswith("llama2-70b") else "")
                + "'\n")
        (here / f"nemo2412-{name}.yaml").write_text(text)


if __name__ == "__main__":
    main()
