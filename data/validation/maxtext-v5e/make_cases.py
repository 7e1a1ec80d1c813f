"""Write the MaxText TPU v5e validation cases: Google's MaxText (JAX/XLA) pre-training of 16B-128B dense models on
1 to 32 TPU v5e-256 slices (256-8192 chips), fully sharded data parallelism (FSDP, ZeRO-3) over each slice's ICI and
data parallelism between slices over the data-centre network (multislice). Apache-2.0.

Usage, from this folder: ``python make_cases.py`` (no input: the figures are the README table below).

Source: AI-Hypercomputer/maxtext (then google/maxtext) at e47fa1b5d377ee1043e663f1414024f4d0f12df0 (2023-10-31,
"Modify results table"): ``README.md`` "Runtime Performance Results / TPU v5e" and ``v5e_high_performance.md``, the
same table: TFLOP/sec/chip and MFU of the 16B, 32B, 64B and 128B models on 1x, 2x, 4x, 8x, 16x and 32x v5e-256
("See full run configs in MaxText/configs/largest_job/ as 16b.sh, 32b.sh, 64b.sh, 128b.sh"). The table is unchanged
in the README until e7829012d (2025-09-11). Runs (``MaxText/configs/largest_job/{16,32,64,128}b.sh`` at that commit):
``train.py base.yml steps=30 remat_policy=full max_target_length=2048 enable_flash_attention=true
dataset_type=synthetic reuse_example_batch=1 global_parameter_scale={16,32,64,128}`` with per_device_batch_size 6 /
4 / 2 / 1, and for 128B ``ici_fsdp_parallelism=16 ici_tensor_parallelism=16``; every other axis is base.yml's
default: ``ici_fsdp_parallelism: -1`` (all of a slice's chips) and ``dcn_data_parallelism: -1`` (the number of
slices), ``dtype: bfloat16`` activations with float32 parameters, AdamW, no dropout (``dropout_rate: 0``).

The model (``MaxText/layers.py`` and ``pyconfig.py`` at that commit): ``global_parameter_scale`` s doubles, in turn,
the heads and MLP width, the embedding width, and the layers from base.yml's 2560 / 8 heads / 8192 / 16 layers
(``get_individual_scales``), with ``head_dim: 256`` whatever the width, vocabulary 32768, logits via the embedding
(tied), a ReLU MLP of two matrices (``mlp_activations: ["relu"]``), T5 RMSNorm without bias, no biases anywhere,
QK norms and T5 relative position biases (tiny). The case models are written as Llama-family configs (RMSNorm, no
biases, head_dim given): the plan format's MLP is either two matrices of a GELU-type MLP with biases and
LayerNorm (gpt2 family, head_dim = width / heads) or the gated three; MaxText's 2 x d x M MLP is written as the
gated 3 x d x (2M/3), the same parameters and matmul FLOPs (within 0.002 % where 2M/3 is not whole) and the same
elementwise bytes (ReLU reads and writes M values; SiLU-and-multiply reads 2 x 2M/3 and writes 2M/3). MaxText's
DecoderLayer runs attention and MLP in parallel from one norm; the Llama form's second norm is d more
parameters per layer.

Throughput: the table's TFLOP/sec/chip is ``train.py``'s ``calculate_training_tflops`` per device over the step
time: 6 x parameters x tokens + 12 x heads x layers x head_dim x sequence^2 x sequences (the whole square, PaLM's
appendix B), so tokens/s = TFLOP/s/chip x 1e12 x chips / (6 N + 12 x heads x layers x head_dim x 2048), N counted
as ``calculate_num_params_from_pytree`` counts it (embedding, per layer q/k/v/o 4 d h 256 + MLP 2 d M + norms,
final norm; the relative-position tables and QK-norm scales included). The MFU column is the same figure over
197 TFLOP/s; the TFLOP/s column is given to 3 digits (the MFU's 4 digits give the same tokens/s within 0.5 %).

The plan: each slice is one group of 256 replicas (TP 1; 128B: TP 16 and 16 replicas) with ZeRO stage 3 over the
group, and the slices are groups of the same plan (``cross_group_gbps``: the v5e host's "2 x 100 Gbps NIC",
cloud.google.com/tpu/docs/v5e, "Per-host NIC configuration"; 32 hosts x 200 Gbit/s = the page's "Data center
network bandwidth per Pod 6.4 Tbps"). Recompute full (``remat_policy: full``); attention fused (``flash``, the
Pallas flash kernel). Global batch = per-device batch x chips; one micro-batch per step.
"""

from __future__ import annotations

import json
from pathlib import Path

SOURCE = ("google/maxtext@e47fa1b5 README.md, Runtime Performance Results, TPU v5e (= v5e_high_performance.md), "
          "configs MaxText/configs/largest_job/{size}.sh")
BASE = {"emb": 2560, "heads": 8, "mlp": 8192, "layers": 16}
HEAD_DIM = 256
VOCAB = 32768
SEQ = 2048
SLICES = (1, 2, 4, 8, 16, 32)
# size -> (global_parameter_scale, per-device batch, ICI tensor parallelism, TFLOP/sec/chip per slice count)
TABLE = {
    "16b": (16, 6, 1, (120, 117, 117, 115, 111, 108)),
    "32b": (32, 4, 1, (132, 128, 126, 125, 123, 119)),
    "64b": (64, 2, 1, (118, 112, 110, 108, 105, 99)),
    "128b": (128, 1, 16, (110, 110, 108, 104, 100, 91)),
}
CHIPS_PER_SLICE = 256
DCN_GBPS_PER_HOST = 200


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


def maxtext_params(d: dict[str, int]) -> int:
    """Parameters as ``calculate_num_params_from_pytree`` counts them (MaxText layers.py at e47fa1b5)."""
    emb, heads, mlp, layers = d["emb"], d["heads"], d["mlp"], d["layers"]
    per_layer = (4 * emb * heads * HEAD_DIM  # query, key, value, out
                 + 2 * emb * mlp  # wi, wo
                 + emb  # pre_self_attention_layer_norm
                 + 2 * HEAD_DIM  # query_layer_norm, key_layer_norm (over head_dim)
                 + 32 * heads)  # relpos_bias: 32 buckets x heads
    return VOCAB * emb + layers * per_layer + emb  # shared embedding, layers, decoder_norm


def tokens_per_s(tflops_per_chip: float, d: dict[str, int], chips: int) -> float:
    """``train.calculate_training_tflops``' per-device FLOPs per step, inverted: tokens/s of all chips."""
    flops_per_token = 6 * maxtext_params(d) + 12 * d["heads"] * d["layers"] * HEAD_DIM * SEQ
    return tflops_per_chip * 1e12 * chips / flops_per_token


def model_json(d: dict[str, int]) -> dict[str, object]:
    """The Llama-family config the case names (module docstring: the MLP as the gated equivalent)."""
    return {"model_type": "llama", "hidden_size": d["emb"], "num_attention_heads": d["heads"],
            "num_key_value_heads": d["heads"], "head_dim": HEAD_DIM, "intermediate_size": round(2 * d["mlp"] / 3),
            "num_hidden_layers": d["layers"], "vocab_size": VOCAB, "max_position_embeddings": SEQ,
            "tie_word_embeddings": True}


def case_yaml(size: str, slices: int) -> str:
    """The case file of one table cell."""
    scale, pdbs, tp, tflops = TABLE[size]
    d = dims(scale)
    chips = slices * CHIPS_PER_SLICE
    tflop = tflops[SLICES.index(slices)]
    train = (f"seq_len: {SEQ}, global_batch: {pdbs * chips // tp}, precision: bf16, mode: full, zero_stage: 3, "
             f"recompute: full, attention: flash")
    group = (f"- replicas: {CHIPS_PER_SLICE // tp}\n  micro_batch: {pdbs}\n  stages:\n"
             f"  - {{accelerator: tpu-v5e, tp: {tp}, layers: {d['layers']}}}\n")
    network = "network:\n  devices_per_node: {tpu-v5e: 8}\n"
    if slices > 1:
        network += f"  cross_group_gbps: {DCN_GBPS_PER_HOST}\n"
    source = (f"'{SOURCE.format(size=size)}: {size.upper()} on {slices}x v5e-256 ({chips} chips), per-device batch "
              f"{pdbs}, ICI FSDP {CHIPS_PER_SLICE // tp} x TP {tp}, DCN data parallelism {slices}, "
              f"{tflop} TFLOP/sec/chip; {maxtext_params(d) / 1e9:.3f}B parameters as MaxText counts them'")
    return (f"model: models/maxtext-{size}.json\ntrain: {{{train}}}\ngroups:\n{group * slices}{network}"
            f"measured: {{tokens_per_s: {tokens_per_s(tflop, d, chips):.1f}}}\nsource: {source}\n")


def main() -> None:
    """Write the model files and every case file into this folder."""
    here = Path(__file__).resolve().parent
    for size, (scale, *_rest) in TABLE.items():
        text = json.dumps(model_json(dims(scale)), indent=2) + "\n"
        (here / "models" / f"maxtext-{size}.json").write_text(text)
        for slices in SLICES:
            (here / f"maxtext_v5e-{size}-s{slices}.yaml").write_text(case_yaml(size, slices))


if __name__ == "__main__":
    main()
