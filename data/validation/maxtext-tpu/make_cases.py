"""Write the MaxText TPU validation cases: Google's MaxText (JAX/XLA) pre-training of dense models, fully sharded data
parallelism (FSDP, ZeRO-3; with tensor parallelism for the larger ones) over each slice's ICI and data parallelism
between slices over the data-centre network (multislice). Apache-2.0. Two tables, two sources:

- ``maxtext_v5e``: 16B-128B on 1 to 32 TPU v5e-256 slices (256-8192 chips).
- ``maxtext_v5p``: 32B-1024B on 1 and 2 slices of v5p-128 to v5p-4096 (64-2048 chips per slice; v5p-N has N
  TensorCores, 2 per chip).

Usage, from this folder: ``python make_cases.py`` (no input: the figures are the tables below).

v5e source: AI-Hypercomputer/maxtext (then google/maxtext) at e47fa1b5d377ee1043e663f1414024f4d0f12df0 (2023-10-31,
"Modify results table"): ``README.md`` "Runtime Performance Results / TPU v5e" and ``v5e_high_performance.md``, the
same table: TFLOP/sec/chip and MFU of the 16B, 32B, 64B and 128B models on 1x, 2x, 4x, 8x, 16x and 32x v5e-256
("See full run configs in MaxText/configs/largest_job/ as 16b.sh, 32b.sh, 64b.sh, 128b.sh"). The table is unchanged
in the README until e7829012d (2025-09-11). Runs (``MaxText/configs/largest_job/{16,32,64,128}b.sh`` at that commit):
``train.py base.yml steps=30 remat_policy=full max_target_length=2048 enable_flash_attention=true
dataset_type=synthetic reuse_example_batch=1 global_parameter_scale={16,32,64,128}`` with per_device_batch_size 6 /
4 / 2 / 1, and for 128B ``ici_fsdp_parallelism=16 ici_tensor_parallelism=16``; every other axis is base.yml's
default: ``ici_fsdp_parallelism: -1`` (all of a slice's chips) and ``dcn_data_parallelism: -1`` (the number of
slices), ``dtype: bfloat16`` activations with float32 parameters, AdamW, no dropout (``dropout_rate: 0``).

v5p source: the same repository at 64c851db4 (2024-01-23), ``MaxText/configs/v5p/README.md`` ("Expected performance
results for 32B, 64B, 128B, 256B, 512B, and 1024B parameter models running on TPU v5p": TFLOP/sec/chip and MFU per
hardware, 1x and 2x of each slice size; unchanged from its first version, 76bd53b0f, 2023-12-15) and the runs of the
same folder's ``{32,64,128,256,512,1024}b.sh``: ``per_device_batch_size`` 8 / 4 / 2 / 2 / 2 / 2,
``ici_fsdp_parallelism=-1`` with ``ici_tensor_parallelism`` 4 / 4 / 8 / 8 / 16 / 16, ``remat_policy`` minimal for
32B-256B and full for 512B and 1024B, ``attention='flash'``, base.yml's sequence 2048. ``minimal`` is
``jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims`` (``MaxText/layers/models.py``): the outputs of the
projections (dots without batch dimensions) are saveable, and JAX keeps those the backward reads; the attention
core (its dots batch over heads) and the elementwise work are recomputed: the plan format's ``recompute: dots``.

The model (``MaxText/layers.py`` / ``layers/models.py`` and ``pyconfig.py``): ``global_parameter_scale`` s doubles,
in turn, the heads and MLP width, the embedding width, and the layers from base.yml's 2560 / 8 heads / 8192 / 16
layers (``get_individual_scales``), with ``head_dim: 256`` whatever the width, vocabulary 32768, logits via the
embedding (tied), a ReLU MLP of two matrices (``mlp_activations: ["relu"]``), RMSNorm without bias, no biases
anywhere; at e47fa1b5 also QK norms and T5 relative position biases (tiny), at 64c851db4 rotary embeddings;
attention and MLP in parallel from one norm (``DecoderLayer``). The case models are MaxText configs
(``model_type: maxtext``, estimates only; ``starverse.models.families._maxtext`` reads MaxText's keys as
``pyconfig`` resolves them): ``decoder_block: default`` (the parallel block), ``mlp_activations: [relu]``,
``logits_via_embedding``, ``dropout_rate: 0``. Not in them: the QK norms' and relative biases' 2 x 256 + 32 x heads
values per layer (below 0.001 % of the parameters; ``maxtext_params`` counts them for the FLOPs).

Throughput: the tables' TFLOP/sec/chip is ``train.py``'s ``calculate_training_tflops`` per device over the step
time: 6 x parameters x tokens plus the attention's 12 x heads x layers x head_dim x sequence^2 x sequences (the whole
square, PaLM's appendix B) at e47fa1b5, half of that ("due to causality in attention") at 64c851db4; so tokens/s =
TFLOP/s/chip x 1e12 x chips / (6 N + attention per token), N counted as ``calculate_num_params_from_pytree`` counts
it (embedding, per layer q/k/v/o 4 d h 256 + MLP 2 d M + norms, final norm). The MFU column is the same figure over
the chip's peak (197 / 459 TFLOP/s); the TFLOP/s column is given to 3 digits.

The plan: each slice is one group (ZeRO stage 3 over its replicas, TP as the run's), the slices groups of the same
plan, ``cross_group_gbps`` the host's data-centre network: v5e "2 x 100 Gbps NIC" per host of 8 chips
(cloud.google.com/tpu/docs/v5e, "Per-host NIC configuration"; 32 hosts x 200 Gbit/s = the page's "Data center
network bandwidth per Pod 6.4 Tbps"), v5p "Data center network (DCN) bandwidth per chip (Gbps) 50"
(cloud.google.com/tpu/docs/v5p) x 4 chips per host. Attention fused (``flash``, the Pallas flash kernel).

Batch: ``pyconfig.py`` sets ``global_batch_size_to_train_on = int(num_devices * per_device_batch_size)`` (at both
commits), one micro-batch per step, and inside the model activations batch over the data and FSDP axes only
(base.yml ``logical_axis_rules``: ``activation_batch`` -> ``['data', 'fsdp']``, ``activation_embed`` ->
``tensor``): the TP ranks of one FSDP shard share per-device batch x TP sequences, their residual stream split
along the embedding. So a case's micro-batch is per-device batch x TP, its global batch per-device batch x chips,
and where TP > 1 ``sequence_parallel: true`` (Megatron's layout of the same split, in cost: the residual stream
and its elementwise work 1/TP per rank, all-gathers and reduce-scatters around the projections).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

BASE = {"emb": 2560, "heads": 8, "mlp": 8192, "layers": 16}
HEAD_DIM = 256
VOCAB = 32768
SEQ = 2048


@dataclass(frozen=True)
class Run:
    """One table cell: a model size on ``slices`` slices of ``chips`` chips."""

    size: str
    chips: int
    slices: int
    tflops_per_chip: float


@dataclass(frozen=True)
class Table:
    """One source: its chip, the settings of each size's run script and its cells."""

    source: str
    where: str
    accelerator: str
    chips_per_host: int
    dcn_gbps_per_host: int
    causal_attention_flops: bool
    """``calculate_training_tflops`` halves the attention term (64c851db4) or not (e47fa1b5)."""
    qk_norm_relpos: bool
    """The model has QK norms and T5 relative position biases (e47fa1b5) or rotary embeddings (64c851db4)."""
    sizes: dict[str, tuple[int, int, int, str]]
    """size -> (global_parameter_scale, per-device batch, ICI tensor parallelism, plan recompute: ``remat_policy``
    full -> full, minimal -> dots)."""
    runs: tuple[Run, ...]


V5E = Table(
    source="maxtext_v5e", accelerator="tpu-v5e", chips_per_host=8, dcn_gbps_per_host=200,
    where=("google/maxtext@e47fa1b5 README.md, Runtime Performance Results, TPU v5e (= v5e_high_performance.md), "
           "configs MaxText/configs/largest_job/{size}.sh"),
    causal_attention_flops=False, qk_norm_relpos=True,
    sizes={"16b": (16, 6, 1, "full"), "32b": (32, 4, 1, "full"), "64b": (64, 2, 1, "full"),
           "128b": (128, 1, 16, "full")},
    runs=tuple(Run(size, 256, s, tf) for size, row in {
        "16b": (120, 117, 117, 115, 111, 108), "32b": (132, 128, 126, 125, 123, 119),
        "64b": (118, 112, 110, 108, 105, 99), "128b": (110, 110, 108, 104, 100, 91)}.items()
        for s, tf in zip((1, 2, 4, 8, 16, 32), row, strict=True)),
)
V5P = Table(
    source="maxtext_v5p", accelerator="tpu-v5p", chips_per_host=4, dcn_gbps_per_host=4 * 50,
    where="google/maxtext@64c851db MaxText/configs/v5p/README.md, runs MaxText/configs/v5p/{size}.sh",
    causal_attention_flops=True, qk_norm_relpos=False,
    sizes={"32b": (32, 8, 4, "dots"), "64b": (64, 4, 4, "dots"), "128b": (128, 2, 8, "dots"),
           "256b": (256, 2, 8, "dots"), "512b": (512, 2, 16, "full"), "1024b": (1024, 2, 16, "full")},
    # (size, TensorCores per slice (v5p-N), slices, TFLOP/sec/chip)
    runs=tuple(Run(size, cores // 2, s, tf) for size, cores, s, tf in (
        ("32b", 128, 1, 328), ("32b", 128, 2, 319), ("64b", 128, 1, 323), ("64b", 128, 2, 309),
        ("128b", 256, 1, 315), ("128b", 256, 2, 305), ("128b", 512, 1, 316), ("128b", 512, 2, 274),
        ("256b", 1024, 1, 308), ("256b", 1024, 2, 289), ("512b", 1024, 1, 294), ("512b", 1024, 2, 282),
        ("1024b", 2048, 1, 254), ("1024b", 2048, 2, 237), ("1024b", 4096, 1, 297), ("1024b", 4096, 2, 279))),
)
TABLES = (V5E, V5P)


def scales(scale: int) -> tuple[int, int, int, int]:
    """``pyconfig.get_individual_scales``: (emb, heads, mlp, layers) exponents of 2 for a global scale."""
    log2 = scale.bit_length() - 1
    base, rem = divmod(log2, 3)
    heads = base + int(rem > 0)
    return base + int(rem > 1), heads, heads, base


def dims(scale: int) -> dict[str, int]:
    """The model's widths at a global parameter scale."""
    e, h, m, layer = scales(scale)
    return {"emb": BASE["emb"] << e, "heads": BASE["heads"] << h, "mlp": BASE["mlp"] << m,
            "layers": BASE["layers"] << layer}


def maxtext_params(d: dict[str, int], qk_norm_relpos: bool = True) -> int:
    """Parameters as ``calculate_num_params_from_pytree`` counts them."""
    emb, heads, mlp, layers = d["emb"], d["heads"], d["mlp"], d["layers"]
    per_layer = (4 * emb * heads * HEAD_DIM  # query, key, value, out
                 + 2 * emb * mlp  # wi, wo
                 + emb)  # pre-attention norm
    if qk_norm_relpos:
        per_layer += 2 * HEAD_DIM + 32 * heads  # query / key norms over head_dim; relpos_bias: 32 buckets x heads
    return VOCAB * emb + layers * per_layer + emb  # shared embedding, layers, decoder_norm


def tokens_per_s(table: Table, run: Run) -> float:
    """``train.calculate_training_tflops``' per-device FLOPs per step, inverted: tokens/s of all chips."""
    d = dims(table.sizes[run.size][0])
    attention = 12 * d["heads"] * d["layers"] * HEAD_DIM * SEQ / (2 if table.causal_attention_flops else 1)
    flops_per_token = 6 * maxtext_params(d, table.qk_norm_relpos) + attention
    return run.tflops_per_chip * 1e12 * run.chips * run.slices / flops_per_token


def model_json(d: dict[str, int]) -> dict[str, object]:
    """The MaxText config the case names (module docstring)."""
    return {"model_type": "maxtext", "decoder_block": "default", "emb_dim": d["emb"], "num_query_heads": d["heads"],
            "num_kv_heads": d["heads"], "head_dim": HEAD_DIM, "mlp_dim": d["mlp"], "num_decoder_layers": d["layers"],
            "vocab_size": VOCAB, "max_target_length": SEQ, "mlp_activations": ["relu"], "logits_via_embedding": True,
            "dropout_rate": 0.0}


def case_name(table: Table, run: Run) -> str:
    """File stem: source, size, chips per slice (where a size has several), slices."""
    several = len({r.chips for r in table.runs if r.size == run.size}) > 1
    return f"{table.source}-{run.size}" + (f"-c{run.chips}" if several else "") + f"-s{run.slices}"


def case_yaml(table: Table, run: Run) -> str:
    """The case file of one table cell."""
    scale, pdbs, tp, recompute = table.sizes[run.size]
    d = dims(scale)
    acc = table.accelerator
    train = (f"seq_len: {SEQ}, global_batch: {pdbs * run.chips * run.slices}, precision: bf16, mode: full, "
             f"zero_stage: 3, recompute: {recompute}, attention: flash"
             + (", sequence_parallel: true, tp_comm_overlap: true" if tp > 1 else ""))
    group = (f"- replicas: {run.chips // tp}\n  micro_batch: {pdbs * tp}\n  stages:\n"
             f"  - {{accelerator: {acc}, tp: {tp}, layers: {d['layers']}}}\n")
    network = f"network:\n  devices_per_node: {{{acc}: {table.chips_per_host}}}\n"
    if run.slices > 1:
        network += f"  cross_group_gbps: {table.dcn_gbps_per_host}\n"
    params = maxtext_params(d, table.qk_norm_relpos) / 1e9
    source = (f"'{table.where.format(size=run.size)}: {run.size.upper()} on {run.slices}x {run.chips} chips, "
              f"per-device batch {pdbs}, ICI FSDP {run.chips // tp} x TP {tp}, DCN data parallelism {run.slices}, "
              f"{run.tflops_per_chip:g} TFLOP/sec/chip; {params:.3f}B parameters as MaxText counts them'")
    return (f"model: models/maxtext-{run.size}.json\ntrain: {{{train}}}\ngroups:\n{group * run.slices}{network}"
            f"measured: {{tokens_per_s: {tokens_per_s(table, run):.1f}}}\nsource: {source}\n")


def main() -> None:
    """Write the model files and every case file into this folder."""
    here = Path(__file__).resolve().parent
    for table in TABLES:
        for size, (scale, *_rest) in table.sizes.items():
            text = json.dumps(model_json(dims(scale)), indent=2) + "\n"
            (here / "models" / f"maxtext-{size}.json").write_text(text)
        for run in table.runs:
            (here / f"{case_name(table, run)}.yaml").write_text(case_yaml(table, run))


if __name__ == "__main__":
    main()
