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


MXU_ROWS = 8.0
"""Rows of the left operand a TPU matrix unit takes per pass (``bf16[8,128] @ bf16[128,128]`` every 8 cycles: J. Austin et
al., "How to Scale Your Model", jax-ml/scaling-book ``tpus.md``, 2025)."""


def systolic_efficiency(m: FloatArray, n: FloatArray, k: FloatArray, rows: StageRows) -> FloatArray:
    """Fraction of peak of an (M x K) @ (K x N) matmul on a systolic matrix unit of edge E
    (``StageRows.matrix_unit``, TPUs): ``gemm_efficiency`` on the padded problem, i.e. times
    M N K / (max(M, 8) max(N, E) max(K, E)).

    A TPU's matmuls are pipelined with their HBM <-> VMEM copies, so one is compute-bound or memory-bound
    (a roofline); weight axes under the MXU's edge are padded up to it ("smaller axes are padded to 128",
    scaling-book ``tpus.md``; 256 on v6e), the activation rows to the 8 rows of a pass. There is no per-tile
    prologue or partial wave as on a GPU's SMs (:func:`gemm_half_dim`): one TensorCore runs the whole matmul.
    Axes above the edge that are not multiples of it are not charged (XLA pads them by less than one tile)."""
    e = np.maximum(np.asarray(rows.matrix_unit, dtype=np.float64), 1.0)
    m, n, k = (np.maximum(np.asarray(x, dtype=np.float64), 1e-9) for x in (m, n, k))
    fill = m * n * k / (np.maximum(m, MXU_ROWS) * np.maximum(n, e) * np.maximum(k, e))
    return np.asarray(rows.gemm_efficiency * fill, dtype=np.float64)


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
    if rows.matrix_unit is not None and np.any(rows.matrix_unit > 0):
        eff = np.where(rows.matrix_unit > 0, systolic_efficiency(m, n, k, rows), eff)
    t_compute = flops / (rows.peak_tflops * 1e12 * eff)
    t_memory = (ob * (m * k + k * n) + bytes_per_value * m * n) / (
        rows.memory_bw_gb_per_s * 1e9 * C.MEMORY_BW_EFFICIENCY)
    return np.asarray(np.maximum(t_compute, t_memory) * count, dtype=np.float64)
