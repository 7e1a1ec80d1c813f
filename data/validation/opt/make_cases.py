"""Write the OPT validation case: Meta's OPT-175B pre-training run (run 12.xx) on 992 A100 80GB GPUs, Fully
Sharded Data Parallel (ZeRO-3) over 124 replicas x Megatron tensor parallelism 8 (facebookresearch/metaseq).

Usage, from this folder: ``python make_cases.py`` (no input: the figures are cited below).

Measured figure. Zhang et al. 2022, "OPT: Open Pre-trained Transformer Language Models" (arXiv:2205.01068v4),
section 2.4 "Training Efficiency": "We trained OPT-175B on 992 80GB A100 GPUs, by utilizing Fully Sharded Data
Parallel ... with Megatron-LM Tensor Parallelism ... We achieve utilization of up to 147 TFLOP/s per GPU. We
keep Adam state in FP32, since we shard it across all hosts, while the model weights remained in FP16 ...
dynamic loss scaling". Converted to tokens/s with the project's own FLOP count: metaseq
``projects/OPT/chronicles/final_update.md`` (commit f7ffa5fd61cf90f498a36d365c13dd7f1a912ff7) gives "~4.30E+23
FLOPs of compute" for the 300B training tokens, i.e. 1.433e12 FLOPs per token (Megatron's count with full
recompute, 96 l h^2 (1 + s/6h + V/16lh) per token: 1.430e12 for this model, within 0.2 %). So
992 x 147e12 / 1.433e12 = 101,738 tokens/s. The same note's "roughly ~33 days of continuous training on 1024
80GB A100s (assuming no hardware issues ...)" is this rate: 4.30e23 / (147e12 x 1024) = 33.1 days. The paper
says "up to": the figure is the run's best per-GPU rate, not its average over restarts and hardware failures
(which the case does not model); the chronicles' 56 % note says the Megatron 2.4 -> 2.6 upgrade raised "wps"
by 2 %, so the rate before it was about 2 % lower. Included because it is the steady rate of the healthy run
that the 33-day projection was made from, with every field of the layout stated in the run's own grid (below);
no logged words-per-second value was readable (the logbook PDFs, ``projects/OPT/chronicles/OPT175B_Logbook.pdf``,
are not in the stored copy of the repository).

Layout, from the run 12.00 grid that Susan Zhang posted in metaseq issue #223 ("Batch size / original script
for OPT-175B training", 2022-07-14; read from a stored copy of that script, "This is a reference document for
the run12.00 setup"): ``--ddp-backend fully_sharded`` without ``--no-reshard-after-forward`` (default False in
``metaseq/dataclass/configs.py``; ``metaseq/distributed/fully_sharded_data_parallel.py`` passes
``reshard_after_forward=not no_reshard_after_forward``: fairscale's ZeRO-3 mode, parameters gathered again for
the backward, fairscale PR #413); the later 125M-66B baselines
script ``metaseq/launcher/opt_baselines.py`` adds ``--no-reshard-after-forward``, "zero2", the 175B grid does
not) -> ``zero_stage: 3``; ``--model-parallel-size 8`` -> ``tp: 8`` (also ``opt_job_constants.py``: 175b
model_parallel 8; issue #209: "175B OPT (8 x 124)"), so 992 / 8 = 124 replicas; ``--batch-size 8``
``--update-freq 1`` -> micro-batch 8, one micro-batch per step, global batch 124 x 8 = 992 sequences of 2048
(``--tokens-per-sample 2048``), 2.03M tokens (Table 1: "2M"); ``--checkpoint-activations`` -> ``recompute:
full`` (fairscale's ``checkpoint_wrapper``, an autograd function that runs the whole layer again:
``recompute_early_stop: false``); ``--memory-efficient-fp16`` -> ``precision: fp16`` (the paper: weights in FP16, Adam state in FP32,
sharded); ``--distribute-checkpointed-activations`` splits the checkpointed layer inputs over the TP ranks
(memory only; not a plan field, no memory figure is compared).

Model (``models/opt-175b.json``), from the same grid: 96 layers, d_model 12288, FFN 4 x 12288, 96 heads,
learned positions, tied input/output embeddings (``--share-decoder-input-output-embed``), ReLU, dropout 0.1 and
attention dropout 0.1, none on embeddings (``--no-emb-dropout``); vocabulary 50272, the size metaseq gives OPT
checkpoints (``docs/faster-transformer.md``: ``--vocab-size 50272``). Attention ``eager``: the run (Nov 2021 -
Jan 2022) used metaseq's Megatron-based attention with Megatron's fused upper-triangular masked softmax
(``metaseq/modules/megatron/model/fused_softmax.py``) over materialised scores; FlashAttention (May 2022) came
after it, and metaseq's xFormers option later still.

Network: nodes of 8 GPUs on Azure NDm A100 v4 (the only Azure VM with 8 A100 80GB GPUs): 8 x 200 Gbit/s HDR
InfiniBand per VM, 1600 Gbit/s (MicrosoftDocs/azure-docs ``articles/virtual-machines/ndm-a100-v4-series.md``).
That the cluster is Azure's is read from metaseq: the chronicles name a "cloud provider", its launcher's Azure
support sets ``NCCL_TOPO_FILE=/opt/microsoft/ndv4-topo.xml`` (``metaseq/launcher/slurm.py``) and its API docs
say OPT-175B runs "Right now only on Azure, as it requires the 80GB A100s" (``docs/api.md``).

Left out: the smaller OPT models (125M-66B). Their layouts are in ``opt_baselines.py`` / ``opt_job_constants.py``
but no throughput of theirs is given in a readable source (only in ``OPT_Baselines_Logbook.pdf``, not stored).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fsdp_case import fsdp_case_yaml

GPUS = 992
TP = 8
MICRO_BATCH = 8
TFLOPS_PER_GPU = 147.0
FLOPS_PER_TOKEN = 4.30e23 / 300e9  # metaseq final_update.md: ~4.30E+23 FLOPs for 300B tokens


def main() -> None:
    """Write the case file into this folder."""
    here = Path(__file__).resolve().parent
    replicas = GPUS // TP
    tokens_per_s = round(GPUS * TFLOPS_PER_GPU * 1e12 / FLOPS_PER_TOKEN)
    train = (f"seq_len: 2048, global_batch: {replicas * MICRO_BATCH}, precision: fp16, mode: full, zero_stage: 3, "
             f"recompute: full, recompute_early_stop: false, attention: eager")
    source = ("'Zhang et al. 2022 (arXiv:2205.01068) sec. 2.4: OPT-175B on 992 A100 80GB, FSDP + Megatron TP, "
              "up to 147 TFLOP/s per GPU (the reported maximum), at metaseq final_update.md 4.30E+23 FLOPs per "
              "300B tokens; layout: run12.00 grid (metaseq issue #223); see opt/make_cases.py'")
    text = fsdp_case_yaml("models/opt-175b.json", train, replicas, MICRO_BATCH, "a100-80gb-sxm", 96, 1600,
                          tokens_per_s, source, tp=TP)
    (here / "opt-175b-a100-g992.yaml").write_text(text)


if __name__ == "__main__":
    main()
