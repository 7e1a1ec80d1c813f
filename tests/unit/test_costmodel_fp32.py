"""Measured 4-byte matmul efficiency of cards without a MAMF figure (issue 9: Sailor's consumer-GPU runs)."""

from __future__ import annotations

import pytest

from starverse.catalog import load_catalog
from starverse.config import parse
from starverse.costmodel import constants as C
from starverse.costmodel import estimate
from starverse.costmodel.fp32_matmul import FP32_GEMM_EFFICIENCY, fp32_gemm_efficiency
from starverse.models import load_model
from starverse.plan import Plan

CAT = load_catalog()
SPEC = load_model({"model_type": "gpt2", "n_embd": 1024, "n_layer": 4, "n_head": 16, "n_inner": 4096,
                   "vocab_size": 50272, "n_positions": 2048})


def _step(acc: str, precision: str) -> float:
    p = parse(Plan, {"model": "x", "train": {"seq_len": 2048, "global_batch": 8, "precision": precision},
                     "groups": [{"micro_batch": 8, "stages": [{"accelerator": acc, "tp": 1, "layers": 4}]}]},
              "t.yaml")
    return estimate(p, CAT, SPEC).step_time_s


def test_measured_fraction_replaces_the_stack_fallback_where_published() -> None:
    r3090, titan, a100 = (CAT.accelerator(i) for i in ("rtx-3090", "titan-rtx", "a100-80gb-sxm"))
    # TF32 on the RTX 3090: Aceso's profile (34.9 of 35.5 TFLOP/s) times the sustained fraction
    assert C.gemm_efficiency(r3090, "tf32") == pytest.approx(0.98 * C.SUSTAINED_FRACTION)
    # plain fp32 on the 3090 (CUDA cores) has no measurement: the stack fallback stays
    assert fp32_gemm_efficiency("rtx-3090", "fp32") is None
    assert C.gemm_efficiency(r3090, "fp32") == pytest.approx(C.GEMM_EFFICIENCY_BY_STACK["cuda"] * C.SUSTAINED_FRACTION)
    # Turing has no TF32: a tf32 plan on the Titan RTX gets the same (fp32) figure as an fp32 plan
    assert C.gemm_efficiency(titan, "tf32") == C.gemm_efficiency(titan, "fp32")
    # 16-bit matmuls on these cards are untouched (tensor cores: the pre-Ampere / stack figures)
    assert C.gemm_efficiency(titan, "fp16") == pytest.approx(C.PRE_AMPERE_EFFICIENCY * C.SUSTAINED_FRACTION)
    # a MAMF measurement keeps precedence
    assert C.gemm_efficiency(a100, "tf32") == pytest.approx(C.GEMM_EFFICIENCY["a100-80gb-sxm"] * C.SUSTAINED_FRACTION)
    assert all(0.5 < v <= 1.0 for v in FP32_GEMM_EFFICIENCY.values())


def test_a_higher_measured_fraction_makes_the_3090_tf32_step_faster_than_its_fp32_step() -> None:
    """Same peak (35.5 vs 35.6 TFLOP/s), same 4-byte values: only the measured TF32 efficiency differs, so the
    matmul-bound step is shorter in TF32, by about the ratio of the two fractions on its matmul part."""
    tf32, fp32 = _step("rtx-3090", "tf32"), _step("rtx-3090", "fp32")
    assert tf32 < 0.95 * fp32
    assert tf32 > fp32 * C.GEMM_EFFICIENCY_BY_STACK["cuda"] / 0.98 * 0.99
    # without the table entry the two agree to the peak's rounding
    saved = FP32_GEMM_EFFICIENCY.pop(("rtx-3090", "tf32"))
    try:
        assert _step("rtx-3090", "tf32") == pytest.approx(fp32, rel=0.01)
    finally:
        FP32_GEMM_EFFICIENCY[("rtx-3090", "tf32")] = saved


def test_cards_without_tf32_read_their_fp32_entry_for_a_tf32_plan() -> None:
    for acc_id in ("v100-16gb-sxm", "titan-rtx"):
        acc = CAT.accelerator(acc_id)
        assert C.gemm_efficiency(acc, "tf32") == C.gemm_efficiency(acc, "fp32")
        assert C.gemm_efficiency(acc, "fp32") == pytest.approx(FP32_GEMM_EFFICIENCY[(acc_id, "fp32")]
                                                                * C.SUSTAINED_FRACTION)


def test_v100_fp16_matmuls_run_at_their_measured_fraction_and_the_t4_at_the_fitted_one() -> None:
    """Issue 9: pre-Ampere cards' achieved matmul efficiency from public measurements where there is one
    (V100-SXM2: 97.36 of 125 TFLOP/s, fp16 torch.mm), not the blanket fraction fitted on AMP's T4s."""
    from starverse.costmodel.constants import MEASURED_GEMM_EFFICIENCY

    for acc_id in ("v100-16gb-sxm", "v100-32gb-sxm"):
        acc = CAT.accelerator(acc_id)
        assert C.gemm_efficiency(acc, "fp16") == pytest.approx(0.779 * C.SUSTAINED_FRACTION)
        # bf16 on Volta runs at the fp32 rate: no measurement, the fitted fraction
        assert C.gemm_efficiency(acc, "bf16") == pytest.approx(C.PRE_AMPERE_EFFICIENCY * C.SUSTAINED_FRACTION)
    t4 = CAT.accelerator("t4")
    assert "t4" not in MEASURED_GEMM_EFFICIENCY
    assert C.gemm_efficiency(t4, "fp16") == pytest.approx(C.PRE_AMPERE_EFFICIENCY * C.SUSTAINED_FRACTION)
    # GeForce cards run above their datasheet boost clock, so a measured fraction may exceed 1 a little
    assert all(0.5 < v <= 1.1 for v in MEASURED_GEMM_EFFICIENCY.values())


@pytest.mark.parametrize(("acc_id", "measured"), [("rtx-3090", 1.065), ("rtx-4090", 1.008), ("rtx-a6000", 0.778),
                                                  ("l40s", 0.729)])
def test_ampere_and_ada_cards_run_16_bit_matmuls_at_their_measured_fraction(acc_id: str, measured: float) -> None:
    """Issue 9: the consumer and workstation cards it names get their public 16-bit torch.mm measurement, not the
    0.80 stack fallback, in fp16 and bf16 alike (they have bf16 tensor cores); their 4-byte matmuls keep theirs."""
    acc = CAT.accelerator(acc_id)
    for precision in ("fp16", "bf16"):
        assert C.gemm_efficiency(acc, precision) == pytest.approx(measured * C.SUSTAINED_FRACTION)
    fp32 = FP32_GEMM_EFFICIENCY.get((acc_id, "fp32"), C.GEMM_EFFICIENCY_BY_STACK["cuda"])
    assert C.gemm_efficiency(acc, "fp32") == pytest.approx(fp32 * C.SUSTAINED_FRACTION)
    # a card in neither table keeps the stack fallback
    nvl = CAT.accelerator("h100-94gb-nvl")
    assert C.gemm_efficiency(nvl, "bf16") == pytest.approx(C.GEMM_EFFICIENCY_BY_STACK["cuda"] * C.SUSTAINED_FRACTION)
