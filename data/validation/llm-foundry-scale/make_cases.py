"""Write the llm-foundry at-scale validation cases: MosaicML's MPT throughput runs with PyTorch FSDP
(FULL_SHARD = ZeRO-3, SHARD_GRAD_OP = ZeRO-2) over 64-512 GPUs (mosaicml/llm-foundry, Apache-2.0).

Usage, from this folder: ``python make_cases.py`` (no input: the figures are the README's table rows, below).

Source: mosaicml/llm-foundry ``scripts/train/benchmarking/README.md`` at commit
8c8dd48f72168c5d51e2f7b151595892a8fba43d (the file last changed in 495218376830947dce625efabc4d86be7c47cc45),
tables "H100 80GB BF16 (Large Scale, >= 128 GPUs)" (every row), "H100 80GB BF16" (the 64-GPU 13b row: the
other 64-GPU rows are already the ``mpt-*-g64`` cases one folder up) and "A100 40GB with 1600 Gbps
node-node interconnect (RoCE)" (both rows, 64 and 128 GPUs). Per row the README gives the model, sequence
length, GPUs, micro-batch, gradient accumulation, global batch, precision, sharding strategy, activation
checkpointing and measured "Throughput (T/s)" for the whole job; that figure is ``measured.tokens_per_s``.

How the rows were read: FULL_SHARD over all GPUs = ``zero_stage: 3``, SHARD_GRAD_OP = ``zero_stage: 2``
(one data-parallel group, TP 1, PP 1); "Activation Checkpointing True" = ``recompute: full``; global batch
= micro-batch x accumulation x GPUs as printed; amp_bf16 and "bf16 PURE" both = ``precision: bf16``;
nodes of 8 GPUs. What full recompute runs again: the amp_bf16 rows are of the sweeps from #543 (b2a43a14,
2023-10-19: ``sweep.sh`` runs image ``mosaicml/pytorch:2.1.0_cu121``) and #838 (5e85bd62, 2024-01-06, the Large
Scale table, llm-foundry then requiring ``torch>=2.1,<2.1.1``), with the pretrain yamls'
``activation_checkpointing_reentrant: false``: PyTorch's non-reentrant checkpoint with early stop (torch 2.1),
the default ``recompute_early_stop``; the A100 40GB "bf16 PURE" rows are older (the README's "TODO: Update
tables with torch 2.0" above them), torch before 2.1, whose checkpoint runs the whole block again
(``recompute_early_stop: false``). Mixed precision as it ran: the table's "MP Mode" column, DEFAULT for the
amp_bf16 rows (``submit_benchmarks.py``'s ``--fsdp_config_mixed_precision`` default), which Composer 0.16-0.17
(llm-foundry then requiring ``mosaicml>=0.16.4,<0.17`` and ``>=0.17.2,<0.18``) maps to FSDP's
``MixedPrecision(param_dtype=bf16, reduce_dtype=float32, buffer_dtype=bf16)``
(``composer/trainer/mosaic_fsdp_utils.py`` ``get_mixed_precision``): bf16 gathers, gradients reduce-scattered
in fp32, ``grad_reduce_fp32: true``; "bf16 PURE" reduces in bf16. The A100 network is the table's title (1600 Gbit/s per node, RoCE). The H100 tables state
no network: 3200 Gbit/s per node (8 x 400 Gbit/s, the DGX-H100 / cloud H100 standard) is assumed, as the
existing ``mpt-*-h100-*`` cases assume. Models: the ``mpt-*.json`` configs one folder up (the yamls that
llm-foundry's ``sweep.sh`` runs). The source id is ``mptscale`` (held out apart from the 8-64-GPU ``mpt``
rows, so that LOSO judges the at-scale rows on their own).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fsdp_case import fsdp_case_yaml

WHERE = ("mosaicml/llm-foundry@8c8dd48f scripts/train/benchmarking/README.md, table "
         "'{table}', row {model} seq {seq} {gpus} GPUs")
LARGE = "H100 80GB BF16 (Large Scale, >= 128 GPUs)"
H100 = "H100 80GB BF16"
A100_40 = "A100 40GB with 1600 Gbps node-node interconnect (RoCE)"
LAYERS = {"1b": 24, "3b": 32, "7b": 32, "13b": 40, "30b": 48, "70b": 80}
# (table, model, GPUs, micro-batch, grad accum, sharding, activation checkpointing, Throughput (T/s))
ROWS = [
    (LARGE, "70b", 512, 8, 1, "FULL_SHARD", True, 515636),
    (LARGE, "70b", 256, 8, 1, "FULL_SHARD", True, 265149),
    (LARGE, "70b", 128, 8, 1, "FULL_SHARD", True, 135490),
    (LARGE, "30b", 512, 8, 1, "FULL_SHARD", True, 1083366),
    (LARGE, "30b", 256, 8, 1, "FULL_SHARD", True, 550022),
    (LARGE, "30b", 128, 8, 1, "FULL_SHARD", True, 281491),
    (LARGE, "13b", 512, 16, 1, "FULL_SHARD", True, 2535811),
    (LARGE, "13b", 256, 16, 1, "FULL_SHARD", True, 1277214),
    (LARGE, "13b", 128, 16, 1, "FULL_SHARD", True, 650264),
    (LARGE, "7b", 512, 6, 1, "FULL_SHARD", False, 4951479),
    (LARGE, "7b", 256, 6, 1, "FULL_SHARD", False, 2590548),
    (LARGE, "7b", 128, 6, 1, "FULL_SHARD", False, 1340830),
    (LARGE, "3b", 512, 8, 1, "SHARD_GRAD_OP", False, 11092218),
    (LARGE, "3b", 256, 8, 1, "SHARD_GRAD_OP", False, 5829686),
    (LARGE, "3b", 128, 8, 1, "SHARD_GRAD_OP", False, 2998098),
    (LARGE, "1b", 512, 12, 1, "SHARD_GRAD_OP", False, 20396905),
    (LARGE, "1b", 256, 12, 1, "SHARD_GRAD_OP", False, 10894207),
    (LARGE, "1b", 128, 12, 1, "SHARD_GRAD_OP", False, 5647854),
    (H100, "13b", 64, 2, 1, "FULL_SHARD", False, 307209),
    (A100_40, "70b", 128, 4, 1, "FULL_SHARD", True, 48194),
    (A100_40, "70b", 64, 2, 1, "FULL_SHARD", True, 17672),
]


def main() -> None:
    """Write every case file into this folder."""
    here = Path(__file__).resolve().parent
    for table, model, gpus, mbs, accum, shard, ac, tps in ROWS:
        acc, gbps = ("a100-40gb-sxm", 1600) if table == A100_40 else ("h100-80gb-sxm", 3200)
        stage = 3 if shard == "FULL_SHARD" else 2
        where = WHERE.format(table=table, model=model, seq=2048, gpus=gpus)
        train = (f"seq_len: 2048, global_batch: {mbs * accum * gpus}, precision: bf16, mode: full, "
                 f"zero_stage: {stage}, recompute: {'full' if ac else 'none'}, attention: flash2")
        if table == A100_40:  # bf16 PURE rows: torch before 2.1, no early stop (docstring)
            train += ", recompute_early_stop: false"
        else:  # amp_bf16 rows: FSDP mixed precision DEFAULT, gradients reduced in fp32 (docstring)
            train += ", grad_reduce_fp32: true"
        source = (f"\"{where}: {shard}, activation checkpointing {ac}, micro-batch {mbs}, grad accum {accum}, "
                  f"Throughput (T/s) {tps}\"")
        text = fsdp_case_yaml(f"../models/mpt-{model}.json", train, gpus, mbs, acc, LAYERS[model], gbps, tps, source)
        (here / f"mptscale-{model}-{acc.split('-')[0]}-g{gpus}.yaml").write_text(text)


if __name__ == "__main__":
    main()
