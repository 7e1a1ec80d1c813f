"""Measured large-matmul efficiency of 4-byte (fp32 / TF32) training on cards without a published MAMF.

Kept apart from ``constants`` (at its size limit); ``constants.gemm_efficiency`` reads it. No imports from the
cost model, so no import circle.
"""

from __future__ import annotations

FP32_GEMM_EFFICIENCY: dict[tuple[str, str], float] = {
    # Aceso's op profiler (sailor/Planner/baselines/Aceso/profiler/<GPU>/profiled-data-fp32/
    # OPT-350_mbs8_tp1_algo0.csv in eth-easl/sailor, run in Sailor's NGC pytorch:24.10 container): forward time
    # of the MLP's first GEMM, 16384 x 4096 x 1024 (2 x 16384 x 4096 x 1024 FLOPs), one GPU, 40 timed calls
    # after 10 warm-up calls. Only the forward column: the profiler's backward (torch.autograd.grad w.r.t. the
    # op's inputs) computes no weight gradient.
    ("titan-rtx", "fp32"): 0.80,  # 10555 us: 13.0 TFLOP/s of the 16.3 fp32 datasheet peak (CUDA cores)
    ("rtx-3090", "tf32"): 0.98,  # 3941 us: 34.9 TFLOP/s of the 35.5 dense TF32 tensor-core peak (GeForce
    # boost clocks run above the datasheet's 1.695 GHz under load); TF32 because the container sets
    # TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 (NGC PyTorch release notes)
    ("v100-16gb-sxm", "fp32"): 0.92,  # V100-16 profile, same op, 9485 us: 14.5 TFLOP/s of the 15.7 fp32 peak
    ("v100-32gb-sxm", "fp32"): 0.92,  # the same SXM2 silicon and clocks
}
"""Achieved fraction of the dense 4-byte peak (``constants.peak_tflops``) of one large training-shape GEMM, by
(accelerator id, precision; a tf32 plan on a card without TF32 reads its fp32 entry,
``constants.has_tf32``): the measured counterpart of the MAMF table (``constants.GEMM_EFFICIENCY``,
single-GPU, best shape) for cards and precisions it does not cover; ``SUSTAINED_FRACTION`` applies on top as
it does to MAMF. The same profiler on the A100-40 (TF32) gives 0.80-0.84 of its 156 TFLOP/s TF32 peak, close
to the A100's bf16 MAMF (0.869) used for it. Measured at that shape, where the shape term
(``matmul.gemm_half_dim``) costs these cards ~3 %, so the model is that much below the measurement there. Plain fp32 on the RTX 3090 (no TF32: CUDA cores, whose 35.6 TF
peak counts the second fp32 datapath) is not in the table: no measurement of it was used."""


def fp32_gemm_efficiency(acc_id: str, precision: str) -> float | None:
    """The measured fraction for (``acc_id``, ``precision``), or None where none is published here."""
    return FP32_GEMM_EFFICIENCY.get((acc_id, precision))
