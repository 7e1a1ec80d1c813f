"""Full recompute on a GPU as PyTorch's non-reentrant checkpoint runs it (``train.recompute_early_stop``): it stops
at the last tensor the backward saved, so a dense block does not run its MLP's down projection again, nor the TP
reduction after it; Megatron-LM's and DeepSpeed's checkpoint functions run the whole forward again."""

from __future__ import annotations

import numpy as np
import pytest

from starverse.catalog import load_catalog
from starverse.config import parse
from starverse.costmodel import ModelShape
from starverse.costmodel.group import model_numbers
from starverse.costmodel.shapes import TrainShape
from starverse.costmodel.stage import layer_costs
from starverse.costmodel.step import _stage_rows
from starverse.models import load_model
from starverse.plan import Plan

CAT = load_catalog()
# a llama block wide enough that its GEMMs are compute-bound: their time goes with their FLOPs
WIDE = {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
        "num_key_value_heads": 8, "num_hidden_layers": 4, "vocab_size": 32000}


def _layer(cfg: dict, recompute: str, early_stop: bool, tp: int = 1, mode: str = "full") -> dict[str, float]:
    """``costmodel.stage.layer_costs`` of one layer of this plan (one A100 stage, micro-batch 4 x 4096 tokens)."""
    train = {"seq_len": 4096, "global_batch": 4, "recompute": recompute, "recompute_early_stop": early_stop,
             "precision": "bf16", "mode": mode}
    plan = parse(Plan, {"model": "x", "train": train, "groups": [{"replicas": 1, "micro_batch": 4, "stages": [
        {"accelerator": "a100-80gb-sxm", "tp": tp, "layers": cfg["num_hidden_layers"]}]}]}, "t.yaml")
    mn = model_numbers(ModelShape.from_spec(load_model(cfg)), TrainShape.from_train(plan.train))
    rows = _stage_rows(plan, plan.groups[0], CAT, np.array([4]), np.array([1]), {})
    return {k: float(np.asarray(v).ravel()[0]) for k, v in layer_costs(mn, rows).items()
            if k in ("gemm_layer", "tp_layer")}


def _flops(cfg: dict) -> tuple[float, float]:
    """A llama block's projection FLOPs per token (all seven, the down projection alone)."""
    h, f = cfg["hidden_size"], cfg["intermediate_size"]
    q = h
    kv = h * cfg["num_key_value_heads"] // cfg["num_attention_heads"]
    return 2.0 * (h * (q + 2 * kv) + q * h + 3 * h * f), 2.0 * h * f


def test_full_recompute_with_early_stop_runs_the_projections_before_the_down_projection_again() -> None:
    none = _layer(WIDE, "none", True)
    early, whole = _layer(WIDE, "full", True), _layer(WIDE, "full", False)
    forward = none["gemm_layer"] / 3.0  # forward + backward's two GEMMs per projection (attention core: ~1 %)
    total, down = _flops(WIDE)
    # the whole forward again (Megatron's checkpoint) against six of seven projections (PyTorch's early stop:
    # what tests/unit/test_parallel_config.py counts the runtime doing)
    assert (whole["gemm_layer"] - none["gemm_layer"]) / forward == pytest.approx(1.0, abs=0.02)
    assert (early["gemm_layer"] - none["gemm_layer"]) / forward == pytest.approx((total - down) / total, abs=0.02)
    assert whole["gemm_layer"] - early["gemm_layer"] > 0.2 * forward


def test_early_stop_skips_the_tp_reduction_after_the_down_projection() -> None:
    none, matmuls = _layer(WIDE, "none", True, tp=4), _layer(WIDE, "matmuls", True, tp=4)
    early, whole = _layer(WIDE, "full", True, tp=4), _layer(WIDE, "full", False, tp=4)
    one_reduce = (matmuls["tp_layer"] - none["tp_layer"]) / 2.0  # op SAC runs the forward's two all-reduces again
    assert one_reduce > 0
    assert whole["tp_layer"] - none["tp_layer"] == pytest.approx(2.0 * one_reduce, rel=1e-9)
    assert early["tp_layer"] - none["tp_layer"] == pytest.approx(one_reduce, rel=1e-9)


@pytest.mark.parametrize("extra", [{"hidden_dropout": 0.1}, {"model_type": "mixtral", "num_local_experts": 8,
                                                              "num_experts_per_tok": 2}])
def test_no_early_stop_where_a_tensor_after_the_down_projection_is_saved(extra: dict) -> None:
    """Dropout after the MLP saves its mask (the down projection must run to make it); an MoE block's combine
    saves the experts' outputs: the whole forward runs again either way."""
    cfg = WIDE | extra
    assert _layer(cfg, "full", True) == _layer(cfg, "full", False)


def test_no_early_stop_of_the_frozen_down_projection_under_lora() -> None:
    """A LoRA adapter on the down projection saves its input after the frozen GEMM ran, so the recompute runs that
    GEMM again (the runtime's count: tests/unit/test_parallel_config.py)."""
    assert _layer(WIDE, "full", True, mode="lora") == _layer(WIDE, "full", False, mode="lora")


def test_early_stop_is_the_default_and_changes_nothing_without_full_recompute() -> None:
    plan = parse(Plan, {"model": "x", "train": {"seq_len": 128, "global_batch": 1},
                        "groups": [{"stages": [{"accelerator": "a100-80gb-sxm", "layers": 1}]}]}, "t.yaml")
    assert plan.train.recompute_early_stop is True
    for recompute in ("none", "selective", "matmuls"):
        assert _layer(WIDE, recompute, True) == _layer(WIDE, recompute, False)
