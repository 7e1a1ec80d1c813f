"""The attention core's sustained rate per accelerator: the precision it runs in, and the measured fraction of
peak of the fused kernel (cuDNN on Hopper) and of FlashAttention-2 where one is published; elsewhere the large-
matmul rate (``constants.gemm_efficiency``). Reads ``constants.SUSTAINED_FRACTION`` at call time (it is fitted)."""

from __future__ import annotations

from typing import Any

from starverse.costmodel import constants as C

ATTENTION_PRECISION: dict[str, str] = {"fp8": "bf16"}
"""Precision the attention core (QK^T, softmax, PV) runs in, by training precision, where it differs:
FP8 training with Transformer Engine casts the linear layers' GEMMs to FP8 and runs attention in bf16
(cuDNN / FlashAttention fused kernels in bf16; TE's FP8 attention, ``DelayedScaling(fp8_dpa=True)``, is off
by default — Transformer Engine docs, ``transformer_engine.common.recipe.DelayedScaling``; NeMo enables it
only with ``fp8_dot_product_attention``, off in its recipes). So at long sequences, where attention
dominates, FP8 training runs at the bf16 rate."""


FUSED_ATTENTION_EFFICIENCY: dict[str, float] = {
    # Transformer Engine docs/examples/attention/attention.ipynb, benchmarks/attention/benchmark_attention.py
    # on "NVIDIA H100 80GB HBM3": test_3 (batch 2, 32 heads, head dim 128, 8192 tokens, causal), forward +
    # backward 7.4875 ms with cuDNN attention: 4*2*32*8192^2*128/2 FLOPs forward x 3.5 = 3.85e12 FLOPs,
    # 514 TFLOP/s = 0.520 of the 989.4 bf16 peak (flash-attn 2 in the same run: 11.89 ms, 0.327)
    "h100-80gb-sxm": 0.520,
    "h200-141gb-sxm": 0.520,  # the same SMs and clocks (attention at long sequences is compute-bound)
}
"""Measured fraction of the dense 16-bit peak that the fused attention kernel Transformer Engine selects
(cuDNN on sm90: ``DotProductAttention`` "Select FusedAttention on sm90 and FlashAttention on others for
performance") reaches, forward + backward at head dim 128, where one is published. Elsewhere fused
attention runs at the MAMF x ``d / (d + ATTENTION_HEAD_DIM_HALF)`` (FlashAttention-2 on A100, which reaches
0.63 of peak at d = 128 there, the same as this table would give). FlashAttention-2 reaches much less of
the H100 than of the A100 (0.327 above; FlashAttention-3, Shah et al. 2024: "only 35% utilization on the
H100")."""


FLASH2_ATTENTION_EFFICIENCY: dict[str, float] = {
    # the same Transformer Engine benchmark run (test_3, H100 80GB HBM3): flash-attn 2, 11.8879 ms forward +
    # backward for 3.85e12 FLOPs = 324 TFLOP/s, 0.327 of the bf16 peak
    "h100-80gb-sxm": 0.327,
    "h200-141gb-sxm": 0.327,
}
"""Measured fraction of the dense 16-bit peak that FlashAttention-2 reaches (``train.attention: flash2``),
where it differs from :data:`FUSED_ATTENTION_EFFICIENCY`: its kernels are written for Ampere (mma.sync, no
Hopper wgmma / TMA), so on the H100 it reaches about a third of the peak (FlashAttention-3, Shah et al. 2024:
"FlashAttention-2 achieving only 35% utilization on the H100 GPU"); on the A100 it is the fused kernel
``d / (d + ATTENTION_HEAD_DIM_HALF)`` describes."""


def _attention_tflops(acc: Any, precision: str, measured: dict[str, float]) -> float:
    p = ATTENTION_PRECISION.get(precision, precision)
    if acc.id in measured and p in ("bf16", "fp16"):
        # the measured fraction at head dim 128, as the large-matmul rate d / (d + 48) scales by head dim
        at_128 = 128.0 / (128.0 + C.ATTENTION_HEAD_DIM_HALF)
        return C.peak_tflops(acc, p) * measured[acc.id] / at_128 * C.SUSTAINED_FRACTION
    return C.peak_tflops(acc, p) * C.gemm_efficiency(acc, p)


def attention_tflops(acc: Any, precision: str) -> float:
    """Sustained TFLOP/s of the attention core's matmuls at the precision it runs in
    (:data:`ATTENTION_PRECISION`: bf16 under fp8 training): at head dim 128 the measured fused kernel's
    fraction of peak (:data:`FUSED_ATTENTION_EFFICIENCY`) where published, x the sustained fraction, expressed
    as the large-matmul rate that ``d / (d + ATTENTION_HEAD_DIM_HALF)`` scales by head dim; else the GEMMs'."""
    return _attention_tflops(acc, precision, FUSED_ATTENTION_EFFICIENCY)


def flash2_attention_tflops(acc: Any, precision: str) -> float:
    """:func:`attention_tflops` of FlashAttention-2 (``train.attention: flash2``): its measured fraction of peak
    (:data:`FLASH2_ATTENTION_EFFICIENCY`) where published, else the same as :func:`attention_tflops`."""
    if acc.id in FLASH2_ATTENTION_EFFICIENCY:
        return _attention_tflops(acc, precision, FLASH2_ATTENTION_EFFICIENCY)
    return attention_tflops(acc, precision)


def attention_tflops_for(acc: Any, precision: str, attention: str) -> float:
    """The attention core's rate for a plan's ``train.attention``: FlashAttention-2's for ``flash2``, else the
    platform's fused kernel's."""
    return flash2_attention_tflops(acc, precision) if attention == "flash2" else attention_tflops(acc, precision)
