"""Write the fms-fsdp validation cases: IBM's PyTorch FSDP (ZeRO-3) pre-training of Llama-2 models on
128 A100s and 96 H100s (foundation-model-stack/fms-fsdp, Apache-2.0).

Usage, from this folder: ``python make_cases.py`` (no input: the figures are the README's tables, below).

Source: the fms-fsdp README throughput table ("We benchmark the best possible throughput ... on 128 A100
GPUs as well as 96 H100 GPUs, we use the exact same scripts and configurations"): per model size the
sharding strategy, activation checkpointing, batch size (per GPU), and tokens/s/GPU on "A100 80G 128 GPUs
with 400Gbps" and "H100 96 GPUs with 800 Gbps" (https://github.com/foundation-model-stack/fms-fsdp,
README). An earlier version of the same README (commit 0d319983c4b3b7f7b3b5e2c5e7f746746b6f73a9) gives
the 70b row on the 128 A100s: FSDP, activation checkpointing, batch size 6, 380 tokens/s/GPU.

What the cases say: FSDP full sharding = ``zero_stage: 3`` over all GPUs (one data-parallel group, TP 1,
PP 1); "Full AC" = ``recompute: full``; batch size per GPU = micro-batch, global batch = batch x GPUs (one
micro-batch per step: the README's table states no gradient accumulation); bf16 mixed precision; PyTorch
SDPA's FlashAttention-2 backend (``attention: flash2``: FlashAttention-2's kernels, written for Ampere, on the
H100 too); sequence 4096 (Llama-2's context, the README's "4k context
length"). Nodes of 8 GPUs; 400 / 800 Gbit/s read as per node. Models: fms-fsdp's ``llama2_34b``
(8192 / 64 heads / 8 KV heads / 48 layers / MLP 22016) and ``llama2_70b`` configs
(``fms_fsdp/utils/config_utils.py``), vocabulary 32000.
Left out: 7b (HSDP: sharded inside a node, replicated across — not a plan the format expresses) and 13b
("Selective AC" in fms-fsdp checkpoints a fraction of the blocks, not Megatron's attention-core recompute
that ``recompute: selective`` means).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fsdp_case import fsdp_case_yaml

README = "foundation-model-stack/fms-fsdp README throughput table"
# (name, model file, accelerator, GPUs, per-node Gbit/s, batch per GPU, tokens/s/GPU, where)
RUNS = [
    ("llama2-34b-a100-g128", "models/llama-2-34b.json", "a100-80gb-sxm", 128, 400, 2, 700, README),
    ("llama2-34b-h100-g96", "models/llama-2-34b.json", "h100-80gb-sxm", 96, 800, 2, 1550, README),
    ("llama2-70b-a100-g128", "models/llama-2-70b.json", "a100-80gb-sxm", 128, 400, 6, 380,
     README + " at commit 0d319983c4b3b7f7b3b5e2c5e7f746746b6f73a9 (70b row; network from the current README)"),
]


def main() -> None:
    """Write every case file into this folder."""
    here = Path(__file__).resolve().parent
    for name, model, acc, gpus, gbps, mbs, tps, where in RUNS:
        train = (f"seq_len: 4096, global_batch: {mbs * gpus}, precision: bf16, mode: full, zero_stage: 3, "
                 f"recompute: full, attention: flash2")
        source = (f"'{where}: FSDP, full activation checkpointing, batch size {mbs}, {gpus} GPUs, "
                  f"{gbps} Gbit/s, {tps} tokens/s/GPU'")
        text = fsdp_case_yaml(model, train, gpus, mbs, acc, 48 if "34b" in name else 80, gbps, tps * gpus, source)
        (here / f"fmsfsdp-{name}.yaml").write_text(text)


if __name__ == "__main__":
    main()
