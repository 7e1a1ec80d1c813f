"""Write the llm-foundry long-sequence validation cases: MosaicML's MPT throughput runs on 8 H100s at
8K-64K tokens per sequence with PyTorch FSDP (FULL_SHARD = ZeRO-3), FlashAttention, no context parallelism
(mosaicml/llm-foundry, Apache-2.0).

Usage, from this folder: ``python make_cases.py`` (no input: the figures are the README's table rows, below).

Source: mosaicml/llm-foundry ``scripts/train/benchmarking/README.md`` (the table "H100 80GB BF16", the same
table as ``../llm-foundry-scale``'s 64-GPU 13b row and the ``mpt-*-h100-*`` cases one folder up): every row
of that table with a sequence of 8192 tokens or more whose model config is in ``../models`` (MPT 1b, 3b,
7b, 13b, 30b; the 760m rows are left out, no config here). Per row the README gives the model, sequence
length, GPUs (8 for all of these), micro-batch, gradient accumulation, global batch, precision (amp_bf16),
sharding strategy (FULL_SHARD for all), activation checkpointing and the whole job's measured "Throughput
(T/s)"; that figure is ``measured.tokens_per_s``. Read as in ``../llm-foundry-scale/make_cases.py``:
FULL_SHARD = ``zero_stage: 3`` over the 8 GPUs (one node, NVLink), "Activation Checkpointing True" =
``recompute: full``, global batch = micro-batch x accumulation x GPUs. These are the runs issue 9 names
("a 7B model at 64K-token sequences on 8 H100s"): long sequences without context parallelism, where the
attention core dominates (the README: "our models use Flash Attention"). Source id ``mptlong``. Full recompute as
it ran: the sweep's image ``mosaicml/pytorch:2.1.0_cu121`` (``sweep.sh``) and the pretrain yamls'
``activation_checkpointing_reentrant: false``: PyTorch's non-reentrant checkpoint with early stop, the default
``recompute_early_stop``. Every row's "MP Mode" is DEFAULT: Composer 0.16's FSDP mixed precision with bf16
parameters and gradients reduced in fp32 (``grad_reduce_fp32: true``; ``../llm-foundry-scale/make_cases.py`` says
where that is read).

Attention kernel. The table was written by #543 (commit b2a43a14, 2023-10-19), whose ``sweep.sh`` runs
``submit_benchmarks.py`` with no ``--attn_impl`` for these rows; its default is ``triton``
(``parser.add_argument('--attn_impl', type=str, default='triton')``, also what ``yamls/pretrain/mpt-*.yaml``
state), and each run installs llm-foundry v0.3.0 ``.[gpu]`` (flash-attn 1.0.9, ``triton-pre-mlir`` from
``vchiley/triton@triton_pre_mlir_sm90``): llm-foundry's ``llmfoundry/models/layers/flash_attn_triton.py``,
flash-attn's Triton FlashAttention ("Tested with triton==2.0.0.dev20221202", "only been tested on A100"), not
flash-attn 2. No ALiBi: the table's NumParams grow with the sequence by (s - 2048) x d_model (1b:
1,445,974,016 at 64K, 1,315,950,592 at 2K), learned positional embeddings (MPT's default ``learned_pos_emb``).
The cases state ``attention: flash2`` (FlashAttention-2's rate): the one run of this kernel at a long sequence
on the A100 (``../mpt-7b-a100-80gb-sxm-s32768-g8``, the same commit's A100 table) is predicted +7.6 % at that
rate and -22.9 % with FlashAttention-2's published advantage over FlashAttention in Triton (Dao 2023, section
4.1: 1.3-1.5x forward, 2x backward, on the A100), so that ratio does not describe this kernel as run; its H100
rate is not published (docs/costmodel.md, ``mptlong``).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fsdp_case import fsdp_case_yaml

WHERE = ("mosaicml/llm-foundry scripts/train/benchmarking/README.md, table 'H100 80GB BF16', "
         "row {model} seq {seq} 8 GPUs")
LAYERS = {"1b": 24, "3b": 32, "7b": 32, "13b": 40, "30b": 48}
# (model, sequence, micro-batch, grad accum, activation checkpointing, Throughput (T/s)); all 8 GPUs FULL_SHARD
ROWS = [
    ("30b", 8192, 1, 21, True, 11072),
    ("13b", 32768, 1, 3, True, 15812),
    ("13b", 16384, 3, 3, True, 23881),
    ("7b", 65536, 1, 2, True, 15654),
    ("7b", 32768, 2, 2, True, 26550),
    ("7b", 8192, 8, 2, True, 55481),
    ("3b", 65536, 1, 2, True, 26099),
    ("3b", 32768, 3, 6, True, 46984),
    ("3b", 16384, 1, 6, False, 89223),
    ("3b", 8192, 3, 6, False, 132626),
    ("1b", 65536, 1, 2, True, 44050),
    ("1b", 32768, 1, 4, False, 96203),
    ("1b", 16384, 2, 4, False, 157194),
    ("1b", 8192, 3, 4, False, 233256),
]


def main() -> None:
    """Write every case file into this folder."""
    here = Path(__file__).resolve().parent
    for model, seq, mbs, accum, ac, tps in ROWS:
        train = (f"seq_len: {seq}, global_batch: {mbs * accum * 8}, precision: bf16, mode: full, "
                 f"zero_stage: 3, recompute: {'full' if ac else 'none'}, attention: flash2, grad_reduce_fp32: true")
        source = (f"\"{WHERE.format(model=model, seq=seq)}: FULL_SHARD, activation checkpointing {ac}, "
                  f"micro-batch {mbs}, grad accum {accum}, Throughput (T/s) {tps}\"")
        text = fsdp_case_yaml(f"../models/mpt-{model}.json", train, 8, mbs, "h100-80gb-sxm", LAYERS[model], 3200,
                              tps, source)
        (here / f"mptlong-{model}-h100-s{seq // 1024}k-g8.yaml").write_text(text)


if __name__ == "__main__":
    main()
