"""Eager attention's fused-softmax fallback (``train.softmax_fusion``): issue 9, BigScience's 176B layout
search, where some head counts and micro-batches ran Megatron's torch softmax."""

from __future__ import annotations

from typing import Any

import pytest

from starverse.catalog import load_catalog
from starverse.config import parse
from starverse.costmodel import constants as C
from starverse.costmodel import estimate
from starverse.errors import ConfigError
from starverse.models import load_model
from starverse.plan import Plan

CAT = load_catalog()
A100 = "a100-80gb-sxm"
LAYERS = 2
SEQ = 2048


def _spec(heads: int) -> Any:
    """A small BLOOM-like model with ``heads`` heads of dimension 64."""
    return load_model({"model_type": "gpt2", "n_embd": 64 * heads, "n_layer": LAYERS, "n_head": heads,
                       "n_inner": 4 * 64 * heads, "vocab_size": 1024, "n_positions": SEQ})


def _plan(tp: int, mb: int, m: int = 2, seq: int = SEQ, **train: Any) -> Plan:
    t = {"seq_len": seq, "global_batch": mb * m, "precision": "bf16", "attention": "eager", "recompute": "full"}
    return parse(Plan, {"model": "x", "train": {**t, **train},
                        "groups": [{"micro_batch": mb, "stages": [{"accelerator": A100, "tp": tp, "layers": LAYERS}]}]},
                 "t.yaml")


def _memory_s(heads: int, tp: int, mb: int, rule: str, seq: int = SEQ, **train: Any) -> float:
    return estimate(_plan(tp, mb, seq=seq, softmax_fusion=rule, **train), CAT, _spec(heads)).breakdown["memory"]


def _bw() -> float:
    return CAT.accelerator(A100).memory_bw_gb_per_s * 1e9 * C.MEMORY_BW_EFFICIENCY


def _torch_softmax_s(heads_per_rank: int, mb: int, seq: int = SEQ, m: int = 2, path: str = "torch-fp32") -> float:
    """The fallback's extra time per step over the fused kernel: its passes' bytes per score less the kernel's,
    forward (twice: full recompute) and backward."""
    scores = mb * heads_per_rank * seq * seq
    (ff, fb), (tf, tb) = C.SOFTMAX_PASS_BYTES["fused"], C.SOFTMAX_PASS_BYTES[path]
    return m * LAYERS * scores * ((tf - ff) * 2.0 + (tb - fb)) / _bw()


@pytest.mark.parametrize(("heads", "tp", "mb", "falls_back"), [
    (104, 4, 2, True),   # 26 heads per rank x 2 = 52 score batches; 26 -> 32 lanes -> 8 per block: 52 % 8 = 4
    (64, 8, 2, True),    # 8 x 2 = 16; 8 lanes -> 32 per block
    (64, 8, 4, False),   # 8 x 4 = 32
    (64, 4, 2, False),   # 16 x 2 = 32; 16 lanes -> 16 per block
    (112, 4, 2, False),  # 28 x 2 = 56; 8 per block (BLOOM's 112 heads on TP 4)
    (96, 4, 2, False),   # 24 x 2 = 48
])
def test_bigscience_2022_fork_takes_the_batches_per_block_from_the_heads_per_rank(
        heads: int, tp: int, mb: int, falls_back: bool) -> None:
    fused = _memory_s(heads, tp, mb, "always")
    fork = _memory_s(heads, tp, mb, "megatron-bsc-2022")
    extra = _torch_softmax_s(heads // tp, mb) if falls_back else 0.0
    assert fork - fused == pytest.approx(extra, rel=1e-9, abs=1e-12)
    # Megatron's corrected check (batches per block from the 2048-key rows: 4) runs the kernel on all of these
    assert _memory_s(heads, tp, mb, "megatron") == pytest.approx(fused, rel=1e-12)


def test_megatron_rule_falls_back_beyond_its_longest_row_and_on_score_batches_not_divisible_by_4() -> None:
    fused = _memory_s(16, 1, 1, "always", seq=8192)
    assert _memory_s(16, 1, 1, "megatron", seq=8192) - fused == pytest.approx(
        _torch_softmax_s(16, 1, seq=8192), rel=1e-9)
    # 4096 keys is the corrected kernel's longest row, 2048 the 2022 fork's
    assert _memory_s(16, 1, 1, "megatron", seq=4096) == pytest.approx(_memory_s(16, 1, 1, "always", seq=4096))
    assert _memory_s(16, 1, 1, "megatron-bsc-2022", seq=4096) > _memory_s(16, 1, 1, "always", seq=4096)
    # 6 heads x micro-batch 1: 6 score batches
    assert _memory_s(6, 1, 1, "megatron") - _memory_s(6, 1, 1, "always") == pytest.approx(
        _torch_softmax_s(6, 1), rel=1e-9)


def test_fp32_scores_and_flash_attention_do_not_take_the_16_bit_fallback() -> None:
    # fp32 training already prices the torch softmax (EAGER_UNFUSED_SOFTMAX_BYTES); flash has no softmax pass
    for train in ({"precision": "fp32"}, {"attention": "flash"}):
        assert _memory_s(104, 4, 2, "megatron-bsc-2022", **train) == pytest.approx(
            _memory_s(104, 4, 2, "always", **train), rel=1e-12)


def test_softmax_fusion_is_checked() -> None:
    with pytest.raises(ConfigError, match="softmax_fusion"):
        _plan(4, 2, softmax_fusion="sometimes")


def test_fused_causal_softmax_and_dropout_move_what_the_kernels_move() -> None:
    """Issue 9 (DLPerf's single-V100 Megatron-LM runs): the fused causal kernel reads the lower triangle and writes
    every row (3 B per score forward, 4 B backward), dropout 5 B each way; the score GEMMs' write and read are in
    their roofline, not counted again. Under full recompute the forward runs twice: 2 x 8 + 9 = 25 B per score."""
    heads, tp, mb, m = 16, 1, 1, 2
    eager = _memory_s(heads, tp, mb, "always")
    flash = estimate(_plan(tp, mb, attention="flash"), CAT, _spec(heads)).breakdown["memory"]
    per_score = 2.0 * (3.0 + 5.0) + (4.0 + 5.0)
    assert eager - flash == pytest.approx(m * LAYERS * mb * heads * SEQ * SEQ * per_score / _bw(), rel=1e-9)


def test_megatron_1_1_5_without_the_fusion_flag_runs_the_fp16_torch_softmax() -> None:
    """AMP's Megatron-LM 1.1.5 (``softmax_fusion: unfused-fp16``): masked_fill_ and torch.nn.Softmax in fp16,
    8 B forward and 10 B backward per score, everywhere; not the fp32 fallback's 36 / 40."""
    fused = _memory_s(16, 1, 1, "always")
    assert _memory_s(16, 1, 1, "unfused-fp16") - fused == pytest.approx(
        _torch_softmax_s(16, 1, path="torch-fp16"), rel=1e-9)
    assert C.SOFTMAX_PASS_BYTES["torch-fp16"] == (8.0, 10.0)
