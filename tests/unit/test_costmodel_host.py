"""Launch-bound layers and TF32 matmuls (issue 9: Sailor's GH200 runs on Clariden)."""

from __future__ import annotations

import pytest

from starverse.catalog import load_catalog
from starverse.config import parse
from starverse.costmodel import DeviceTable, estimate
from starverse.costmodel import constants as C
from starverse.errors import ConfigError
from starverse.models import load_model
from starverse.plan import Plan

CAT = load_catalog()
SPEC = load_model({"model_type": "gpt2", "n_embd": 1024, "n_layer": 24, "n_head": 16, "n_inner": 4096,
                   "vocab_size": 50272, "n_positions": 2048})


def step(mb: int, m: int, precision: str = "bf16", acc: str = "h100-80gb-sxm", tp: int = 4) -> float:
    p = parse(Plan, {"model": "x", "train": {"seq_len": 2048, "global_batch": mb * m, "precision": precision},
                     "groups": [{"micro_batch": mb, "stages": [{"accelerator": acc, "tp": tp, "layers": 24}]}]},
              "test.yaml")
    return estimate(p, CAT, SPEC).step_time_s


def test_small_layers_are_launch_bound_not_faster_than_the_host_issues_them() -> None:
    """Without per-micro-step synchronisation the device waits for the host where a layer's work is shorter
    than the time to issue its kernels: micro-batch 1 of a 350M model on 4 H100s costs at least the host's
    time per layer, and micro-batches of 1 are then not 8x cheaper than micro-batches of 8."""
    one = step(1, 8)
    assert one >= 8 * 24 * C.HOST_OVERHEAD_PER_LAYER_S
    eight = step(8, 1)
    assert one > 0.5 * eight
    # without the floor (a host that issues instantly) micro-batch 1 is far cheaper than the floor
    old = C.HOST_OVERHEAD_PER_LAYER_S
    try:
        C.HOST_OVERHEAD_PER_LAYER_S = 0.0
        assert step(1, 8) < 0.5 * one
        # large layers are not launch bound: the floor changes nothing there
        big = step(64, 1)
    finally:
        C.HOST_OVERHEAD_PER_LAYER_S = old
    assert step(64, 1) == pytest.approx(big, rel=1e-12)


def test_tf32_runs_fp32_values_on_half_the_tensor_core_peak_where_the_card_has_tf32() -> None:
    h100, v100 = CAT.accelerator("h100-80gb-sxm"), CAT.accelerator("v100-16gb-sxm")
    assert C.peak_tflops(h100, "tf32") == pytest.approx(h100.bf16_tflops / 2)
    assert C.peak_tflops(v100, "tf32") == v100.fp32_tflops  # Volta has no TF32: plain fp32
    assert C.gemm_efficiency(v100, "tf32") == C.gemm_efficiency(v100, "fp32")
    assert DeviceTable.from_catalog(CAT, ["h100-80gb-sxm"], "tf32").peak_tflops[0] == pytest.approx(494.7)
    # fp32 values either way (memory, bytes moved), tensor cores only with tf32: faster than fp32, slower
    # than bf16
    fp32, tf32, bf16 = step(8, 4, "fp32"), step(8, 4, "tf32"), step(8, 4, "bf16")
    assert bf16 < tf32 < fp32
    p = parse(Plan, {"model": "x", "train": {"seq_len": 2048, "global_batch": 8, "precision": "tf32"},
                     "groups": [{"micro_batch": 8, "stages": [{"accelerator": "h100-80gb-sxm", "tp": 4,
                                                                "layers": 24}]}]}, "t.yaml")
    q = parse(Plan, {"model": "x", "train": {"seq_len": 2048, "global_batch": 8, "precision": "fp32"},
                     "groups": [{"micro_batch": 8, "stages": [{"accelerator": "h100-80gb-sxm", "tp": 4,
                                                                "layers": 24}]}]}, "t.yaml")
    assert estimate(p, CAT, SPEC).memory_gb == pytest.approx(estimate(q, CAT, SPEC).memory_gb)
    assert step(8, 4, "tf32", "v100-16gb-sxm", 1) == pytest.approx(step(8, 4, "fp32", "v100-16gb-sxm", 1))


def _plan(train: dict) -> Plan:
    return parse(Plan, {"model": "x", "train": {"seq_len": 1024, "global_batch": 8, "precision": "fp16"} | train,
                        "groups": [{"micro_batch": 1, "stages": [{"accelerator": "v100-16gb-sxm", "tp": 2,
                                                                   "layers": 24}]}]}, "t.yaml")


def test_a_second_forward_of_each_layer_costs_a_recomputed_forward_in_time_not_in_memory() -> None:
    """AMP's Megatron-LM 1.1.5 runs each layer's forward twice (``train.num_layer_forwards: 2``): the step
    takes as long as with full recompute (the same forward again, its launches too) and holds what a run
    without recompute holds."""
    for sync in (False, True):
        once = estimate(_plan({"sync_micro_steps": sync}), CAT, SPEC)
        twice = estimate(_plan({"sync_micro_steps": sync, "num_layer_forwards": 2}), CAT, SPEC)
        full = estimate(_plan({"sync_micro_steps": sync, "recompute": "full"}), CAT, SPEC)
        assert twice.step_time_s > once.step_time_s * 1.1
        assert twice.step_time_s == pytest.approx(full.step_time_s, rel=1e-12)
        assert twice.memory_gb == pytest.approx(once.memory_gb, rel=1e-12)
        assert full.memory_gb < once.memory_gb


def test_num_layer_forwards_is_checked() -> None:
    with pytest.raises(ConfigError, match="num_layer_forwards"):
        _plan({"num_layer_forwards": 0})
