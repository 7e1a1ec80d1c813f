"""Write the fms-fsdp validation cases: IBM's PyTorch FSDP (ZeRO-3) pre-training of Llama-2 models on
128 A100s and 96 H100s (foundation-model-stack/fms-fsdp, Apache-2.0).

Usage, from this folder: ``python make_cases.py`` (no input: the figures are the README's tables, below).

Source: the fms-fsdp README's throughput table before it was "updated with `torch.compile`" (3b1ce15f,
2024-05-09): README.md lines 10-17 at commit 4ffb9bdfa30e957e339ccfbb617a589fd07c495e (2024-03-21), "We
benchmark the best possible throughput ... on 128 A100 GPUs as well as 96 H100 GPUs, we use the exact same
scripts and configurations for these GPUs"; per model size the sharding strategy, activation checkpointing,
batch size (per GPU) and tokens/s/GPU on "A100 80G 128 GPUs with 400Gbps" and "H100 96 GPUs with 800 Gbps"
(https://github.com/foundation-model-stack/fms-fsdp). Rows used: 34b (FSDP, Full AC, batch 2: 700 / 1550)
and 70b (FSDP, Full AC, batch 2: 370 / 800), unchanged since cf6e42c7 (2024-02-27, "update perf numbers");
5e522b4c (2024-03-13) added the networks to the column titles. The table's MFU / HFU rows (lines 23-28)
agree with a full recompute: HFU / MFU = 0.64 / 0.47 (34B) and 0.67 / 0.50 (70B) on the A100, about 4/3.
Not the current README's table (3b1ce15 onwards: "numbers are updated with `torch.compile`", 34b and 70b
with "Selective AC"), whose compiled runs and fractional checkpointing the plan format does not state.
Until issue 9's eleventh wave (the fms-fsdp review) the 70b case was the row of an earlier table (commit
0d319983, 2024-02-21: "Activation Checkpointing True", batch size 6, 380 tokens/s/GPU, "128 * A100", no
network stated) with the later table's network; the later table re-ran 70b at batch 2 ("we could increase
the throughput by a few percentage points when we increase the batch size. However, we have left the
batches to be smaller", README line 32) and is the one that states the network and the H100 runs, so all
four cases are its rows.

The code those rows ran (fms-fsdp at 5e522b4c, 2024-03-13, the commit that added the network to the table):
``main_training.py`` wraps the model in ``FSDP(..., sharding_strategy=FULL_SHARD for "fsdp",
limit_all_gathers=True, use_orig_params=cfg.use_torch_compile)`` with the default backward prefetch
(BACKWARD_PRE) and no forward prefetch; ``fms_fsdp/utils/train_utils.py`` ``get_policies`` maps
``sharding_strategy="fsdp"`` to ``ShardingStrategy.FULL_SHARD`` and takes ``bfSixteen``
(``fms_fsdp/policies/mixed_precision.py``: param, reduce and buffer dtype bf16: bf16 gathers and
reduce-scatters) when bf16 is supported; ``fms_fsdp/policies/ac_handler.py`` wraps every ``LLaMABlock`` whose
count is a multiple of ``selective_checkpointing`` (default 1: every block, i.e. full recompute) with
``checkpoint_wrapper(NO_REENTRANT)`` (on ``torch>=2.1.0``, ``requirements.txt``: PyTorch's early stop, the
default ``recompute_early_stop``); ``use_torch_compile`` defaults to False and raises with activation
checkpointing ("Compile does not yet work well with llama+ac"), so these runs were eager. Optimizer AdamW.
The reported figure is ``train_utils.train``'s "overall token per gpu per sec": steps x world size x batch
size x seq_length / world size / wall time since the loop started (data loading included).

What the cases say: FSDP full sharding = ``zero_stage: 3`` over all GPUs (one data-parallel group, TP 1,
PP 1); "Full AC" = ``recompute: full``; batch size per GPU = micro-batch, global batch = batch x GPUs (one
micro-batch per step: ``train`` has no gradient accumulation); bf16 mixed precision; PyTorch
SDPA's FlashAttention-2 backend (``attention: flash2``: FlashAttention-2's kernels, written for Ampere, on the
H100 too); sequence 4096 (``fms_fsdp/config/training.py`` ``seq_length: int = 4096``). Nodes of 8 GPUs
(``scripts/train.slurm``: ``--gres=gpu:8``, torchrun ``--nproc_per_node=8``); 400 / 800 Gbit/s read as per
node. Models: fms-fsdp's ``34b`` (8192 / 64 heads / 8 KV heads / 48 layers / MLP 22016) and ``70b`` configs
(``fms_fsdp/utils/config_utils.py`` ``get_model_config``), vocabulary 32000 (FMS ``LLaMAConfig`` default).
Left out: 7b (HSDP: sharded inside a node, replicated across — not a plan the format expresses) and 13b
("Selective AC" in fms-fsdp checkpoints every k-th block, not Megatron's attention-core recompute
that ``recompute: selective`` means; k is not stated).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fsdp_case import fsdp_case_yaml

README = "foundation-model-stack/fms-fsdp@4ffb9bdf README.md throughput table (cf6e42c7 to 4ffb9bdf)"
# (name, model file, accelerator, GPUs, per-node Gbit/s, batch per GPU, tokens/s/GPU, where)
RUNS = [
    ("llama2-34b-a100-g128", "models/llama-2-34b.json", "a100-80gb-sxm", 128, 400, 2, 700, README),
    ("llama2-34b-h100-g96", "models/llama-2-34b.json", "h100-80gb-sxm", 96, 800, 2, 1550, README),
    ("llama2-70b-a100-g128", "models/llama-2-70b.json", "a100-80gb-sxm", 128, 400, 2, 370, README),
    ("llama2-70b-h100-g96", "models/llama-2-70b.json", "h100-80gb-sxm", 96, 800, 2, 800, README),
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
