"""Matmul time on one accelerator: a roofline of shape-dependent compute and HBM traffic (``gemm_time_s``)."""

from __future__ import annotations

import numpy as np

from starverse.costmodel import constants as C
from starverse.costmodel.rows import FloatArray, StageRows


def gemm_half_dim(rows: StageRows, operand_scale: float = 1.0) -> FloatArray:
    """D of the matmul shape term: ``GEMM_HALF_DIM_PER_FLOP_PER_BYTE`` x the machine balance in FLOPs per
    operand byte. The constant is stated for the 16-bit operands of the datasheet peak; a GEMM whose operands
    are ``operand_scale`` times as wide (FP8: 0.5, at twice the 16-bit peak) has the same arithmetic
    intensity per tile edge relative to its peak, hence the same D as a 16-bit GEMM (NVIDIA, "Matrix
    Multiplication Background User's Guide": arithmetic intensity 2MNK / (bytes per element x (MK + NK + MN)))."""
    return np.asarray(C.GEMM_HALF_DIM_PER_FLOP_PER_BYTE * operand_scale * rows.peak_tflops * 1e3
                      / rows.memory_bw_gb_per_s, dtype=np.float64)


def gemm_time_s(m: FloatArray, n: FloatArray, k: FloatArray, rows: StageRows, bytes_per_value: float,
                count: FloatArray | float = 1.0, operand_bytes: float | None = None) -> FloatArray:
    """Time of ``count`` matmuls (M x K) @ (K x N): roofline of shape-dependent compute and HBM traffic.

    ``operand_bytes``: bytes per element of the two inputs where the GEMM reads them in another format than
    the stored ``bytes_per_value`` (FP8 GEMMs: ``constants.GEMM_OPERAND_BYTES``); the output keeps
    ``bytes_per_value``. The shape term's machine balance is per operand byte (:func:`gemm_half_dim`)."""
    ob = bytes_per_value if operand_bytes is None else operand_bytes
    flops = 2.0 * m * n * k
    d = gemm_half_dim(rows, ob / bytes_per_value)
    eff = rows.gemm_efficiency / (1.0 + d / np.maximum(m, 1e-9) + d / np.maximum(n, 1e-9) + d / np.maximum(k, 1e-9))
    t_compute = flops / (rows.peak_tflops * 1e12 * eff)
    t_memory = (ob * (m * k + k * n) + bytes_per_value * m * n) / (
        rows.memory_bw_gb_per_s * 1e9 * C.MEMORY_BW_EFFICIENCY)
    return np.asarray(np.maximum(t_compute, t_memory) * count, dtype=np.float64)
