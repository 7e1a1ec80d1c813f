"""The cost model: FLOPs, memory and communication formulas, scalar/batch agreement, plan checks."""

from __future__ import annotations

import math

import numpy as np
import pytest

from starverse.catalog import load_catalog
from starverse.config import parse
from starverse.costmodel import (
    RECOMPUTE_CODES,
    Candidates,
    DeviceTable,
    ModelShape,
    TrainShape,
    estimate,
    estimate_batch,
)
from starverse.costmodel.comm import group_bus_gb_per_s, ring_allreduce_s
from starverse.costmodel.constants import COLLECTIVE_LATENCY_S, LINK_EFFICIENCY
from starverse.costmodel.group import model_numbers
from starverse.errors import ConfigError
from starverse.models import load_model
from starverse.plan import Plan

CAT = load_catalog()


def plan(groups: list[dict], **train: object) -> Plan:
    t = {"seq_len": 4096, "global_batch": 64, "precision": "bf16"} | train
    return parse(Plan, {"model": "llama-2-70b", "train": t, "groups": groups}, "test.yaml")


def gpt(h: int = 4096, layers: int = 32, heads: int = 32, vocab: int = 51200, seq: int = 2048) -> object:
    return load_model({"model_type": "gpt2", "n_embd": h, "n_layer": layers, "n_head": heads,
                       "n_inner": 4 * h, "vocab_size": vocab, "n_positions": seq})


def test_model_flops_per_token_match_megatron_formula_with_causal_attention() -> None:
    # Korthikanti et al.: 72 l h^2 (1 + s/(6h) + V/(12 l h)) per token counts the full s x s scores;
    # with causal masking the attention term halves to 6 l h (s+1)
    spec = gpt()
    mn = model_numbers(ModelShape.from_spec(spec), TrainShape(seq_len=2048))
    nl, h, s, v = 32, 4096, 2048, 51200
    expected = 72 * nl * h * h + 6 * nl * h * (s + 1) + 6 * h * v
    # biases add 2*(4h + h + 4h + h)... per layer: count them from the model's own parameters
    bias_flops = 0  # matmul FLOPs exclude bias adds
    assert mn.model_flops_per_token() == pytest.approx(expected + bias_flops, rel=1e-12)


def test_gqa_and_gated_mlp_flops() -> None:
    spec = load_model("llama-2-70b")
    mn = model_numbers(ModelShape.from_spec(spec), TrainShape(seq_len=4096))
    h, q, kv, f = 8192, 8192, 1024, 28672
    per_layer = 2 * h * (q + 2 * kv) + 2 * q * h + 3 * 2 * h * f + 4 * q * (4096 + 1) / 2
    assert mn.layer_matmul_flops_per_token() == pytest.approx(per_layer)
    # ~6N: the 70B model's matmul FLOPs per token are within 15 % of 6 x parameters at 4k
    ratio = mn.model_flops_per_token() / (6 * spec.num_params)
    assert 1.0 < ratio < 1.15


def test_ring_allreduce_and_hierarchical_bandwidth() -> None:
    t = ring_allreduce_s(8e9, 8, 100.0)
    # bandwidth term of a ring plus 2*log2(n) latency steps per collective
    assert float(t) == pytest.approx(2 * 7 / 8 * 8e9 / 100e9 + 2 * 3 * COLLECTIVE_LATENCY_S)
    assert float(ring_allreduce_s(8e9, 8, 100.0, 10)) == pytest.approx(2 * 7 / 8 * 8e9 / 100e9 + 60 * COLLECTIVE_LATENCY_S)
    assert float(ring_allreduce_s(1e9, 1, 100.0)) == 0.0
    # inside a node: NVLink; 8 per node across nodes: the node's NIC; 1 per node: a NIC eighth
    intra = group_bus_gb_per_s(8, 8, 300.0, 8, 1600.0)
    assert float(intra) == pytest.approx(300 * LINK_EFFICIENCY)
    full_node = group_bus_gb_per_s(64, 8, 300.0, 8, 1600.0)
    one_per_node = group_bus_gb_per_s(64, 1, 300.0, 8, 1600.0)
    assert float(full_node) == pytest.approx(200 * 0.9)
    assert float(one_per_node) == pytest.approx(200 * 0.9 / 8)


def _uniform(acc: str, tp: int, pp: int, replicas: int, mb: int, m: int, **kw: object) -> tuple:
    spec = load_model("llama-2-70b")
    layers = spec.num_layers
    base, rem = divmod(layers, pp)
    stages = [{"accelerator": acc, "tp": tp, "layers": base + (1 if i < rem else 0)} for i in range(pp)]
    p = plan([{"replicas": replicas, "micro_batch": mb, "stages": stages}],
             global_batch=replicas * mb * m, **({"schedule": "1f1b"} | kw))
    cand = Candidates.make(accelerator=0, tp=tp, pp=pp, replicas=replicas, micro_batch=mb, num_micro_batches=m,
                           zero_stage=kw.get("zero_stage", 0), recompute=RECOMPUTE_CODES[kw.get("recompute", "none")],
                           sequence_parallel=kw.get("sequence_parallel", False))
    dev = DeviceTable.from_catalog(CAT, [acc], p.train.precision)
    return p, spec, dev, cand


@pytest.mark.parametrize(
    ("acc", "tp", "pp", "replicas", "mb", "m", "kw"),
    [
        ("a100-80gb-sxm", 8, 4, 2, 1, 16, {"recompute": "selective", "sequence_parallel": True, "zero_stage": 1}),
        ("h100-80gb-sxm", 8, 3, 4, 2, 8, {"recompute": "full"}),  # 80 layers over 3 stages: 27, 27, 26
        ("rtx-4090", 4, 7, 2, 1, 14, {"recompute": "full", "zero_stage": 1}),  # 12,12,12,11,11,11,11
        ("a100-80gb-sxm", 8, 1, 16, 1, 4, {"zero_stage": 3, "recompute": "full"}),
        ("h100-80gb-sxm", 4, 4, 2, 1, 8, {"schedule": "interleaved", "virtual_stages": 5, "recompute": "selective"}),
        ("v100-32gb-sxm", 8, 8, 1, 2, 8, {"schedule": "gpipe", "recompute": "selective", "precision": "fp16"}),
        ("a100-80gb-sxm", 8, 2, 2, 2, 8, {"recompute": "matmuls", "sequence_parallel": True}),
        ("rtx-4090", 2, 4, 2, 1, 8, {"recompute": "matmuls", "zero_stage": 1}),
        ("h100-80gb-sxm", 4, 2, 2, 1, 8, {"precision": "fp8", "recompute": "full"}),  # attention in bf16
        ("h100-80gb-sxm", 8, 1, 8, 1, 2, {"attention": "flash2", "seq_len": 32768, "zero_stage": 3}),
        ("t4", 2, 4, 2, 1, 8, {"precision": "fp16", "num_layer_forwards": 2, "sync_micro_steps": True}),
        ("a100-80gb-sxm", 4, 4, 2, 1, 8, {"recompute": "full", "zero_stage": 1, "grad_reduce_fp32": True,
                                          "fp32_grad_copy": True}),  # DeepSpeed's BF16_Optimizer
        ("tpu-v5e", 1, 1, 64, 4, 1, {"zero_stage": 3, "recompute": "full"}),  # XLA's memory: no reserve
    ],
)
def test_scalar_and_batch_agree(acc: str, tp: int, pp: int, replicas: int, mb: int, m: int, kw: dict) -> None:
    p, spec, dev, cand = _uniform(acc, tp, pp, replicas, mb, m, **kw)
    est = estimate(p, CAT, spec)
    b = estimate_batch(ModelShape.from_spec(spec), TrainShape.from_train(p.train), dev, cand)
    assert b.step_time_s[0] == pytest.approx(est.step_time_s, rel=1e-9)
    assert b.tokens_per_s[0] == pytest.approx(est.tokens_per_s, rel=1e-9)
    assert b.memory_gb[0] == pytest.approx(est.memory_gb, rel=1e-9)
    assert bool(b.fits[0]) == est.fits
    assert b.mfu[0] == pytest.approx(est.mfu, rel=1e-9)
    assert b.power_kw[0] == pytest.approx(est.power_kw)


def test_batch_is_vectorised_over_mixed_candidates() -> None:
    spec = load_model("llama-2-70b")
    dev = DeviceTable.from_catalog(CAT, ["a100-80gb-sxm", "rtx-4090"], "bf16")
    cand = Candidates.make(accelerator=[0, 1, 0], tp=[8, 4, 8], pp=[2, 8, 1], replicas=[1, 1, 1],
                           micro_batch=1, num_micro_batches=[8, 8, 8], recompute=2)
    b = estimate_batch(ModelShape.from_spec(spec), TrainShape(seq_len=4096), dev, cand)
    assert b.step_time_s.shape == (3,)
    # 70B with Adam states on 8 A100s without ZeRO cannot fit (16 B/param = 1.1 TB); on 16 it neither does
    assert not b.fits[2]
    # 4090s: slower per device than A100s
    assert b.model_tflops_per_device[1] < b.model_tflops_per_device[0]


def test_memory_follows_zero_stages() -> None:
    # model states per device: ZeRO (Rajbhandari 2020) 2P + 2P + 12P/N, 2P + 14P/N, 16P/N
    spec = load_model("llama-2-7b")
    dev = DeviceTable.from_catalog(CAT, ["a100-80gb-sxm"], "bf16")
    n = 64
    cand = Candidates.make(accelerator=0, tp=1, pp=1, replicas=n, micro_batch=1, num_micro_batches=1,
                           zero_stage=[0, 1, 2, 3], recompute=2)
    b = estimate_batch(ModelShape.from_spec(spec), TrainShape(seq_len=4096), dev, cand)
    p = spec.num_params / 1e9
    assert b.optimizer_gb[0] == pytest.approx(12 * p)
    assert b.optimizer_gb[1] == pytest.approx(12 * p / n)
    assert b.grads_gb[1] == pytest.approx(2 * p)
    assert b.grads_gb[2] == pytest.approx(2 * p / n)
    gathered = 2 * 2 * spec.params_per_layer / 1e9  # two layers gathered at a time
    assert b.weights_gb[3] == pytest.approx(2 * p / n + gathered)
    assert list(b.memory_gb) == sorted(b.memory_gb, reverse=True)


def test_eager_attention_is_slower_and_stores_scores() -> None:
    # unfused attention materialises 5 a s^2 b bytes per layer (Korthikanti Eq. 1); selective recompute drops them
    h, s, b, heads = 4096, 2048, 1, 32
    dev = DeviceTable.from_catalog(CAT, ["a100-80gb-sxm"], "bf16")
    shape = ModelShape.from_spec(gpt(h=h, layers=3, heads=heads))
    shape2 = ModelShape.from_spec(gpt(h=h, layers=2, heads=heads))

    def run(sh: ModelShape, attention: str, rc: int) -> object:
        cand = Candidates.make(accelerator=0, tp=1, pp=1, replicas=1, micro_batch=b, num_micro_batches=1, recompute=rc)
        return estimate_batch(sh, TrainShape(seq_len=s, attention=attention), dev, cand)

    per_layer = float(run(shape, "eager", 0).activations_gb[0] - run(shape2, "eager", 0).activations_gb[0]) * 1e9
    assert per_layer == pytest.approx(s * b * h * (34 + 5 * heads * s / h))
    per_layer_sel = float(run(shape, "eager", 1).activations_gb[0] - run(shape2, "eager", 1).activations_gb[0]) * 1e9
    assert per_layer_sel == pytest.approx(34 * s * b * h)
    assert run(shape, "eager", 0).step_time_s[0] > 1.1 * run(shape, "flash", 0).step_time_s[0]


def test_activation_memory_is_korthikanti() -> None:
    # one more layer adds s*b*h*34 bytes (no TP, dropout) or s*b*h*34/t with TP + SP, 2sbh with full recompute
    h, s, b, t = 4096, 2048, 2, 4
    dev = DeviceTable.from_catalog(CAT, ["a100-80gb-sxm"], "bf16")

    def act(layers: int, tp: int, sp: bool, rc: int) -> float:
        shape = ModelShape.from_spec(gpt(h=h, layers=layers))
        cand = Candidates.make(accelerator=0, tp=tp, pp=1, replicas=1, micro_batch=b, num_micro_batches=1,
                               recompute=rc, sequence_parallel=sp)
        return float(estimate_batch(shape, TrainShape(seq_len=s), dev, cand).activations_gb[0]) * 1e9

    assert act(3, 1, False, 0) - act(2, 1, False, 0) == pytest.approx(34 * s * b * h)
    assert act(3, t, True, 0) - act(2, t, True, 0) == pytest.approx(34 * s * b * h / t)
    assert act(3, t, False, 0) - act(2, t, False, 0) == pytest.approx(s * b * h * (10 + 24 / t))
    assert act(3, 1, False, 2) - act(2, 1, False, 2) == pytest.approx(2 * s * b * h)


def test_pipeline_bubble_is_p_minus_1_over_m() -> None:
    p_, spec, _dev, _cand = _uniform("a100-80gb-sxm", 8, 4, 1, 1, 16, recompute="full")
    est = estimate(p_.model_copy(update={"groups": [p_.groups[0].model_copy(update={"stages": [
        p_.groups[0].stages[0].model_copy(update={"layers": 20, "repeat": 4})]})]}), CAT, spec)
    # uniform stages except the LM head on the last: bubble ~ (p-1)/m of the steady state
    steady = est.step_time_s - sum(v for k, v in est.breakdown.items() if k in ("pipeline_bubble", "pp_comm"))
    assert est.breakdown["pipeline_bubble"] / steady == pytest.approx(3 / 16, rel=0.1)


def test_schedule_omitted_tries_interleaving() -> None:
    stages = [{"accelerator": "a100-80gb-sxm", "tp": 8, "layers": 10, "repeat": 8}]
    auto = plan([{"replicas": 1, "micro_batch": 1, "stages": stages}], global_batch=16, recompute="full")
    fixed = auto.model_copy(update={"train": auto.train.model_copy(update={"schedule": "1f1b"})})
    fixed = parse(Plan, fixed.model_dump(exclude_unset=True) | {"train": fixed.train.model_dump()}, "t.yaml")
    e_auto, e_fixed = estimate(auto, CAT), estimate(fixed, CAT)
    assert e_fixed.groups[0].schedule == "1f1b"
    # 8 stages, 16 micro-batches: the bubble (7/16) is worth interleaving (v divides the 10 layers)
    assert e_auto.groups[0].schedule == "interleaved"
    assert e_auto.groups[0].virtual_stages in (2, 5, 10)
    assert e_auto.step_time_s < e_fixed.step_time_s
    assert e_auto.breakdown["pipeline_bubble"] < e_fixed.breakdown["pipeline_bubble"]


def test_micro_batch_omitted_picks_fastest_that_fits() -> None:
    stages = [{"accelerator": "a100-80gb-sxm", "tp": 8, "layers": 10, "repeat": 8}]
    p = plan([{"replicas": 2, "stages": stages}], global_batch=64, recompute="selective",
             sequence_parallel=True, zero_stage=1)
    est = estimate(p, CAT)
    assert est.fits
    chosen = est.groups[0].micro_batch
    for mb in (1, 2, 4, 8, 16, 32):
        forced = p.model_copy(update={"groups": [p.groups[0].model_copy(update={"micro_batch": mb})]})
        other = estimate(forced, CAT)
        if other.fits:
            assert est.step_time_s <= other.step_time_s * (1 + 1e-12)
    assert chosen in (1, 2, 4, 8, 16, 32)


def test_not_fitting_plan_is_reported() -> None:
    p = plan([{"replicas": 1, "micro_batch": 1, "stages": [{"accelerator": "rtx-4090", "tp": 8, "layers": 80}]}],
             global_batch=8)
    est = estimate(p, CAT)
    assert not est.fits and est.margin_gb < 0
    assert any("does not fit" in w for w in est.warnings)


def test_heterogeneous_groups_and_pipeline() -> None:
    a100 = {"replicas": 1, "stages": [{"accelerator": "a100-80gb-sxm", "tp": 8, "layers": 40, "repeat": 2}]}
    mixed = {"replicas": 1, "stages": [{"accelerator": "a100-80gb-sxm", "tp": 8, "layers": 60},
                                       {"accelerator": "rtx-4090", "tp": 8, "layers": 20}]}
    p = plan([a100, mixed], global_batch=64, recompute="full", zero_stage=1)
    est = estimate(p, CAT)
    g0, g1 = est.groups
    assert g0.sequences_per_step + g1.sequences_per_step == 64
    assert est.step_time_s == pytest.approx(max(g0.step_time_s, g1.step_time_s) + est.breakdown["cross_group_sync"])
    assert est.breakdown["cross_group_sync"] > 0
    # the split by speed keeps the two groups' times within one micro-batch of each other
    assert abs(g0.step_time_s - g1.step_time_s) / est.step_time_s < 0.35
    assert [s.accelerator for s in g1.stages] == ["a100-80gb-sxm", "rtx-4090"]
    # fixed shares: giving the mixed group more work makes the step slower
    p2 = p.model_copy(update={"groups": [p.groups[0].model_copy(update={"batch_share": 0.25}),
                                         p.groups[1].model_copy(update={"batch_share": 0.75})]})
    assert estimate(p2, CAT).step_time_s > est.step_time_s


def test_cost_and_power() -> None:
    stages = [{"accelerator": "a100-80gb-sxm", "tp": 8, "layers": 80}]
    p = parse(Plan, {"model": "llama-2-70b", "train": {"seq_len": 4096, "global_batch": 8, "recompute": "full",
                                                        "zero_stage": 3, "tokens": 1e9},
                     "groups": [{"replicas": 4, "stages": stages}],
                     "pricing": {"currency": "USD", "price_per_hour": {"a100-80gb-sxm": 2.0}}}, "t.yaml")
    est = estimate(p, CAT)
    assert est.cost_per_hour == pytest.approx(32 * 2.0)
    assert est.cost_per_million_tokens == pytest.approx(64.0 / (est.tokens_per_s * 3600) * 1e6)
    assert est.power_kw == pytest.approx(32 * 0.4)
    assert est.job_hours == pytest.approx(1e9 / est.tokens_per_s / 3600)
    assert est.bottleneck in ("compute", "memory", "tp_comm", "dp_comm", "pp_comm", "pipeline_bubble")
    assert math.isclose(sum(v for v in est.breakdown.values()), est.step_time_s, rel_tol=1e-9)


def test_lora_needs_far_less_memory_than_full() -> None:
    stages = [{"accelerator": "a100-80gb-sxm", "tp": 1, "layers": 32}]
    full = parse(Plan, {"model": "llama-2-7b", "train": {"seq_len": 2048, "global_batch": 8, "recompute": "full"},
                        "groups": [{"replicas": 1, "micro_batch": 1, "stages": stages}]}, "t.yaml")
    lora = full.model_copy(update={"train": full.train.model_copy(update={"mode": "lora"})})
    qlora = full.model_copy(update={"train": full.train.model_copy(update={"mode": "qlora"})})
    e_full, e_lora, e_q = (estimate(x, CAT) for x in (full, lora, qlora))
    spec = load_model("llama-2-7b")
    assert e_full.groups[0].stages[0].optimizer_gb == pytest.approx(12 * spec.num_params / 1e9)
    assert e_lora.memory_gb < e_full.memory_gb / 3
    assert e_q.groups[0].stages[0].weights_gb < e_lora.groups[0].stages[0].weights_gb / 3
    assert e_lora.step_time_s < e_full.step_time_s  # no weight gradients of the frozen base


def test_offload_moves_optimizer_to_host() -> None:
    stages = [{"accelerator": "rtx-4090", "tp": 1, "layers": 32}]
    base = {"model": "llama-2-7b", "groups": [{"replicas": 8, "micro_batch": 1, "stages": stages}]}
    on = parse(Plan, base | {"train": {"seq_len": 2048, "global_batch": 16, "zero_stage": 2, "recompute": "full"}},
               "t.yaml")
    off = on.model_copy(update={"train": on.train.model_copy(update={"offload": "optimizer"})})
    e_on, e_off = estimate(on, CAT), estimate(off, CAT)
    assert e_off.groups[0].stages[0].optimizer_gb == 0.0
    assert e_on.groups[0].stages[0].optimizer_gb > 1.0
    assert e_off.memory_gb < e_on.memory_gb


@pytest.mark.parametrize(
    ("groups", "train", "message"),
    [
        ([{"stages": [{"accelerator": "a100-80gb-sxm", "tp": 8, "layers": 70}]}], {},
         "groups[0].stages: layers sum to 70 but model 'llama-2-70b' has 80; make the stages' layers"),
        ([{"stages": [{"accelerator": "a100-80gb-sxm", "tp": 3, "layers": 80}]}], {},
         "groups[0].stages[0].tp: 3 does not divide the model's 64 attention heads and 8 KV heads; use one of 1, 2, 4, 8"),
        ([{"replicas": 3, "stages": [{"accelerator": "a100-80gb-sxm", "tp": 8, "layers": 80}]}], {"global_batch": 64},
         "train.global_batch: 64 sequences cannot be divided into micro-batches over groups[0] (replicas=3); "
         "use a global_batch that is a multiple of 3"),
        ([{"replicas": 2, "micro_batch": 3, "stages": [{"accelerator": "a100-80gb-sxm", "tp": 8, "layers": 80}]}],
         {"global_batch": 64},
         "train.global_batch: 64 sequences cannot be divided into micro-batches over groups[0] "
         "(replicas=2 x micro_batch=3); use a global_batch that is a multiple of 6"),
        ([{"stages": [{"accelerator": "a100-80gb-sxn", "tp": 8, "layers": 80}]}], {},
         "groups[0].stages[0].accelerator: unknown accelerator 'a100-80gb-sxn'"),
    ],
)
def test_plan_errors_name_the_field(groups: list, train: dict, message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        estimate(plan(groups, **train), CAT)
    assert message in str(exc.value)


def test_device_table_prices_and_efficiency() -> None:
    dev = DeviceTable.from_catalog(CAT, ["a100-80gb-sxm", "h100-80gb-sxm"], "bf16",
                                   price_per_hour={"a100-80gb-sxm": 1.5})
    assert dev.price_per_hour[0] == 1.5
    assert dev.peak_tflops[1] == CAT.accelerator("h100-80gb-sxm").bf16_tflops
    assert 0.5 < dev.gemm_efficiency[0] < 1.0 and dev.gemm_efficiency[1] < dev.gemm_efficiency[0]
    assert np.all(dev.devices_per_node == 8)


def test_attention_auto_is_eager_only_without_fused_kernels() -> None:
    shape = ModelShape.from_spec(gpt(h=2048, layers=4, heads=16))
    dev = DeviceTable.from_catalog(CAT, ["v100-32gb-sxm", "a100-80gb-sxm"], "fp16")
    assert list(dev.flash_attention) == [False, True]
    cand = Candidates.make(accelerator=[0, 1], tp=1, pp=1, replicas=1, micro_batch=1, num_micro_batches=1)

    def run(attention: str) -> object:
        return estimate_batch(shape, TrainShape(seq_len=2048, precision="fp16", attention=attention), dev, cand)

    auto, flash, eager = run("auto"), run("flash"), run("eager")
    assert auto.step_time_s[0] == eager.step_time_s[0] and auto.step_time_s[1] == flash.step_time_s[1]
    assert auto.activations_gb[0] == eager.activations_gb[0] > flash.activations_gb[0]


def test_batch_shares_must_split_into_micro_batches() -> None:
    a = {"replicas": 2, "batch_share": 0.5, "stages": [{"accelerator": "a100-80gb-sxm", "tp": 8, "layers": 80}]}
    b = {"replicas": 3, "batch_share": 0.5, "stages": [{"accelerator": "h100-80gb-sxm", "tp": 8, "layers": 80}]}
    with pytest.raises(ConfigError) as exc:
        estimate(plan([a, b], global_batch=64, recompute="full", zero_stage=1), CAT)
    assert ("groups[1].batch_share: 0.5 of train.global_batch=64 is 32 sequences, not a multiple of "
            "replicas x micro_batch = 3") in str(exc.value)
    ok = estimate(plan([a, b | {"replicas": 4}], global_batch=64, recompute="full", zero_stage=1), CAT)
    assert [g.sequences_per_step for g in ok.groups] == [32, 32]


def test_geforce_without_peer_to_peer_halves_tp_bandwidth() -> None:
    from starverse.costmodel.constants import PCIE_COLLECTIVE_FRACTION

    dev = DeviceTable.from_catalog(CAT, ["rtx-4090", "l40s", "a100-80gb-sxm"], "bf16")
    pcie = PCIE_COLLECTIVE_FRACTION
    assert dev.intra_node_gb_per_s[0] == pytest.approx(CAT.accelerator("rtx-4090").intra_node_gb_per_s * pcie / 2)
    assert dev.intra_node_gb_per_s[1] == pytest.approx(CAT.accelerator("l40s").intra_node_gb_per_s * pcie)
    # NVLink nodes keep their link (LINK_EFFICIENCY applies to both)
    assert dev.intra_node_gb_per_s[2] == CAT.accelerator("a100-80gb-sxm").intra_node_gb_per_s


def test_nodes_without_peer_to_peer_halve_the_link_in_both_paths() -> None:
    """network.peer_to_peer: {t4: false} (a cloud VM without PCIe P2P) halves the T4's collective bandwidth,
    in the scalar estimate and in the batch path's DeviceTable alike."""
    from starverse.costmodel.constants import intra_node_gb_per_s

    t4 = CAT.accelerator("t4")
    assert intra_node_gb_per_s(t4, False) == pytest.approx(intra_node_gb_per_s(t4) / 2)
    dev = DeviceTable.from_catalog(CAT, ["t4"], "fp16", peer_to_peer={"t4": False})
    assert dev.intra_node_gb_per_s[0] == pytest.approx(intra_node_gb_per_s(t4) / 2)
    spec = gpt(h=1024, layers=24, heads=16, vocab=50304, seq=1024)

    def tp_comm(p2p: bool) -> float:
        p = parse(Plan, {"model": "llama-2-70b", "train": {"seq_len": 1024, "global_batch": 4, "precision": "fp16"},
                         "groups": [{"micro_batch": 1, "stages": [{"accelerator": "t4", "tp": 4, "layers": 24}]}],
                         "network": {"peer_to_peer": {"t4": p2p}}}, "test.yaml")
        return estimate(p, CAT, spec).breakdown["tp_comm"]

    assert tp_comm(False) > 1.5 * tp_comm(True)


def test_host_overhead_only_where_the_framework_synchronises_per_micro_step() -> None:
    """DeepSpeed's pipeline engine with wall_clock_breakdown synchronises per micro-step: the host's launch
    time per layer is added there (fitted constant), nowhere else; smaller micro-batches pay it more often."""
    from starverse.costmodel.constants import HOST_OVERHEAD_PER_LAYER_S

    spec = gpt(h=1024, layers=24, heads=16, vocab=50304, seq=1024)

    def step(sync: bool, mb: int) -> float:
        p = parse(Plan, {"model": "llama-2-70b", "train": {"seq_len": 1024, "global_batch": 8, "precision": "fp16",
                                                          "sync_micro_steps": sync},
                         "groups": [{"micro_batch": mb, "stages": [{"accelerator": "t4", "tp": 1, "layers": 24}]}]},
                  "test.yaml")
        return estimate(p, CAT, spec).step_time_s

    # micro-batch 8: the layers' device time exceeds the host's, so without synchronisation nothing is added
    assert step(True, 8) - step(False, 8) == pytest.approx(24 * HOST_OVERHEAD_PER_LAYER_S, rel=1e-6)
    # micro-batch 1: added 8 times under synchronisation; without it the host's time is only a floor
    # (tests/unit/test_costmodel_host.py), so less is added
    extra = step(True, 1) - step(False, 1)
    assert 0.0 < extra <= 24 * HOST_OVERHEAD_PER_LAYER_S * 8 * (1 + 1e-9)


def test_fp8_uses_its_own_peak_and_efficiency() -> None:
    from starverse.costmodel.constants import SUSTAINED_FRACTION

    h100 = CAT.accelerator("h100-80gb-sxm")
    bf16 = DeviceTable.from_catalog(CAT, ["h100-80gb-sxm"], "bf16")
    fp8 = DeviceTable.from_catalog(CAT, ["h100-80gb-sxm"], "fp8")
    assert fp8.peak_tflops[0] == h100.fp8_tflops
    assert fp8.gemm_efficiency[0] == pytest.approx(0.709 * SUSTAINED_FRACTION)
    assert bf16.gemm_efficiency[0] == pytest.approx(0.803 * SUSTAINED_FRACTION)
    shape = ModelShape.from_spec(load_model("llama-2-70b"))
    cand = Candidates.make(accelerator=0, tp=8, pp=4, replicas=8, micro_batch=1, num_micro_batches=32,
                           zero_stage=1, recompute=2)
    t_bf16 = estimate_batch(shape, TrainShape(seq_len=4096), bf16, cand).step_time_s[0]
    t_fp8 = estimate_batch(shape, TrainShape(seq_len=4096, precision="fp8"), fp8, cand).step_time_s[0]
    assert 1.2 < t_bf16 / t_fp8 < 2.0  # faster, but far from the 2x of the peaks


def test_fp8_runs_attention_at_the_bf16_rate() -> None:
    # Transformer Engine casts the linear layers' GEMMs to FP8, attention stays bf16 (fp8_dpa off): the
    # attention core's rate is the bf16 one, so FP8's gain shrinks as attention grows with the sequence
    from starverse.costmodel.attention_rates import FUSED_ATTENTION_EFFICIENCY, attention_tflops
    from starverse.costmodel.constants import (
        ATTENTION_HEAD_DIM_HALF,
        SUSTAINED_FRACTION,
        gemm_efficiency,
        peak_tflops,
    )

    h100 = CAT.accelerator("h100-80gb-sxm")
    assert attention_tflops(h100, "fp8") == pytest.approx(attention_tflops(h100, "bf16"))
    # the H100's fused attention at its measured rate (cuDNN, FUSED_ATTENTION_EFFICIENCY), not the MAMF's
    at_128 = 128.0 / (128.0 + ATTENTION_HEAD_DIM_HALF)
    assert attention_tflops(h100, "bf16") * at_128 == pytest.approx(
        peak_tflops(h100, "bf16") * FUSED_ATTENTION_EFFICIENCY["h100-80gb-sxm"] * SUSTAINED_FRACTION)
    assert attention_tflops(h100, "bf16") < peak_tflops(h100, "bf16") * gemm_efficiency(h100, "bf16")
    a100 = CAT.accelerator("a100-80gb-sxm")  # no published fused-attention figure: FlashAttention-2 vs the MAMF
    assert attention_tflops(a100, "bf16") == pytest.approx(peak_tflops(a100, "bf16") * gemm_efficiency(a100, "bf16"))
    shape = ModelShape.from_spec(load_model("llama-2-7b"))
    cand = Candidates.make(accelerator=0, tp=1, pp=1, replicas=8, micro_batch=1, num_micro_batches=1,
                           zero_stage=1, recompute=2)
    speedup = {}
    for seq in (4096, 65536):
        t = {pr: estimate_batch(shape, TrainShape(seq_len=seq, precision=pr),
                                DeviceTable.from_catalog(CAT, ["h100-80gb-sxm"], pr), cand).step_time_s[0]
             for pr in ("bf16", "fp8")}
        speedup[seq] = t["bf16"] / t["fp8"]
    assert 1.0 < speedup[65536] < 1.2 < 1.3 < speedup[4096]  # 1.16 and 1.50 here


def test_tp_comm_overlap_hides_tp_collectives_behind_the_gemms() -> None:
    # Transformer Engine userbuffers (NeMo's ub_tp_comm_overlap): TP collectives overlap the linear layers'
    # GEMMs; only the SM share they occupy (and any excess over the GEMMs) stays on the step
    def run(overlap: bool) -> object:
        p = plan([{"replicas": 1, "micro_batch": 1, "stages": [{"accelerator": "h100-80gb-sxm", "tp": 8,
                                                                "layers": 80}]}],
                 global_batch=8, sequence_parallel=True, recompute="selective", tp_comm_overlap=overlap)
        return estimate(p, CAT)

    exposed, hidden = run(False), run(True)
    t_ex, t_hid = exposed.groups[0].breakdown["tp_comm"], hidden.groups[0].breakdown["tp_comm"]
    assert t_hid == pytest.approx(0.20 * t_ex, rel=0.05)  # OVERLAP_SM_FRACTION of it: the GEMMs are longer
    assert hidden.step_time_s < exposed.step_time_s
    assert hidden.step_time_s == pytest.approx(exposed.step_time_s - 0.8 * t_ex, rel=0.02)


def test_pipeline_across_accelerator_types_sends_over_the_cross_link() -> None:
    def mixed(gbps: float) -> Plan:
        return parse(Plan, {"model": "llama-2-70b", "train": {"seq_len": 4096, "global_batch": 16, "recompute": "full",
                                                              "zero_stage": 1, "schedule": "1f1b"},
                            "groups": [{"replicas": 1, "micro_batch": 1, "stages": [
                                {"accelerator": "a100-80gb-sxm", "tp": 8, "layers": 60},
                                {"accelerator": "h100-80gb-sxm", "tp": 8, "layers": 20}]}],
                            "network": {"cross_group_gbps": gbps}}, "t.yaml")

    slow, fast = estimate(mixed(10), CAT), estimate(mixed(1600), CAT)
    per_send = 4096 * 8192 * 2 / 8 / (10 / 8 * 0.9 / 8 * 1e9)
    assert slow.breakdown["pp_comm"] == pytest.approx(2 * (16 + 2 - 1) * per_send, rel=0.01)
    assert fast.breakdown["pp_comm"] < slow.breakdown["pp_comm"] / 50


def test_gradient_reduce_after_the_last_backward_is_exposed() -> None:
    """DeepSpeed's pipeline engine all-reduces gradients after the last backward (overlap_grad_reduce: false):
    the whole all-reduce is on the step; overlapped (the default) only what the last backward does not hide."""
    spec = gpt(h=1024, layers=24, heads=16, vocab=50304, seq=1024)

    def est(overlap: bool) -> object:
        p = parse(Plan, {"model": "llama-2-70b",
                         "train": {"seq_len": 1024, "global_batch": 16, "precision": "fp16",
                                   "overlap_grad_reduce": overlap},
                         "groups": [{"replicas": 16, "micro_batch": 1,
                                     "stages": [{"accelerator": "t4", "tp": 1, "layers": 24}]}]}, "test.yaml")
        return estimate(p, CAT, spec)

    hidden, exposed = est(True), est(False)
    assert exposed.breakdown["dp_comm"] > hidden.breakdown["dp_comm"] > 0.0
    assert exposed.step_time_s - hidden.step_time_s == pytest.approx(
        exposed.breakdown["dp_comm"] - hidden.breakdown["dp_comm"], rel=0.35)


def test_fp8_gemm_shape_term_is_per_operand_byte() -> None:
    # Transformer Engine's FP8 GEMMs read 1-byte operands at twice the 16-bit peak: the same arithmetic
    # intensity per tile edge relative to the peak, so the same shape loss (D) as a 16-bit GEMM; with D taken
    # from the FP8 peak per 2-byte value (before) a 4k-wide FP8 GEMM lost twice as much as a bf16 one
    from types import SimpleNamespace

    from starverse.costmodel.matmul import gemm_half_dim, gemm_time_s

    def rows(peak: float) -> SimpleNamespace:
        return SimpleNamespace(peak_tflops=np.array([peak]), memory_bw_gb_per_s=np.array([3350.0]),
                               gemm_efficiency=np.array([0.6]), matrix_unit=None)

    bf16, fp8 = rows(989.4), rows(1978.8)
    assert gemm_half_dim(fp8, 0.5)[0] == pytest.approx(gemm_half_dim(bf16)[0])
    n = np.array([4096.0])
    t_bf16 = gemm_time_s(n, n, n, bf16, 2.0)[0]
    t_fp8 = gemm_time_s(n, n, n, fp8, 2.0, operand_bytes=1.0)[0]
    t_fp8_per_2_bytes = gemm_time_s(n, n, n, fp8, 2.0)[0]
    assert t_bf16 / t_fp8 == pytest.approx(2.0)  # the peaks' ratio at the same efficiency
    assert t_bf16 / t_fp8_per_2_bytes < 1.85


def test_tpu_matmuls_are_a_padded_roofline() -> None:
    # a systolic matrix unit (TPU MXU, Accelerator.matrix_unit) runs a matmul at its fraction of peak whatever the
    # shape above the unit's edge (no GPU tile/wave term), and pads weight axes under the edge up to it (128; 256 on
    # v6e) and activation rows to 8; a GPU row of the same table keeps the shape term
    from types import SimpleNamespace

    from starverse.costmodel.matmul import gemm_time_s, systolic_efficiency

    rows = SimpleNamespace(peak_tflops=np.array([459.0, 459.0]), memory_bw_gb_per_s=np.array([2765.0, 2765.0]),
                           gemm_efficiency=np.array([0.8, 0.8]), matrix_unit=np.array([128.0, 0.0]))
    big = np.array([4096.0, 4096.0])
    t = gemm_time_s(big, big / 4, big, rows, 2.0)
    assert t[0] == pytest.approx(2.0 * 4096 * 1024 * 4096 / (459e12 * 0.8))
    assert t[1] > t[0] * 1.05  # the GPU form loses to tiles and waves at 1024
    narrow = np.array([64.0, 64.0])
    assert systolic_efficiency(big, narrow, big, rows)[0] == pytest.approx(0.8 * 64 / 128)
    assert systolic_efficiency(np.array([4.0]), np.array([256.0]), np.array([256.0]),
                               SimpleNamespace(gemm_efficiency=np.array([0.8]), matrix_unit=np.array([256.0])))[0] \
        == pytest.approx(0.8 * 4 / 8)
    assert CAT.accelerator("tpu-v5p").matrix_unit == 128
    assert CAT.accelerator("tpu-v6e").matrix_unit == 256
    assert CAT.accelerator("h100-80gb-sxm").matrix_unit is None


def test_flash_attention_2_is_slower_on_hopper_only() -> None:
    # FlashAttention-2 (flash-attn 2, PyTorch SDPA's flash backend) is written for Ampere: on an H100 it reaches
    # 0.327 of the peak against cuDNN's 0.520 (Transformer Engine's attention benchmark), on an A100 it is the
    # fused kernel the model already describes; the step grows with attention's share (the sequence)
    from starverse.costmodel.attention_rates import FLASH2_ATTENTION_EFFICIENCY, FUSED_ATTENTION_EFFICIENCY

    shape = ModelShape.from_spec(load_model("llama-2-7b"))
    cand = Candidates.make(accelerator=0, tp=1, pp=1, replicas=8, micro_batch=1, num_micro_batches=1,
                           zero_stage=3, recompute=2)

    def step(acc: str, attention: str, seq: int) -> float:
        dev = DeviceTable.from_catalog(CAT, [acc], "bf16")
        return float(estimate_batch(shape, TrainShape(seq_len=seq, attention=attention), dev, cand).step_time_s[0])

    ratio = FUSED_ATTENTION_EFFICIENCY["h100-80gb-sxm"] / FLASH2_ATTENTION_EFFICIENCY["h100-80gb-sxm"]
    slow = {seq: step("h100-80gb-sxm", "flash2", seq) / step("h100-80gb-sxm", "flash", seq) for seq in (2048, 65536)}
    assert 1.0 < slow[2048] < slow[65536] < ratio
    assert slow[65536] > 1.3
    assert step("a100-80gb-sxm", "flash2", 65536) == pytest.approx(step("a100-80gb-sxm", "flash", 65536))


def test_zero3_per_gpu_rate_falls_when_a_fixed_batch_spreads_over_more_nodes() -> None:
    # ZeRO-3 all-gathers every layer's parameters forward and backward and reduce-scatters its gradients each
    # micro-step: traffic per step per GPU is ~3x the model whatever the GPU count, so with a fixed global batch
    # (512 sequences) over 128 -> 512 A100s the micro-batch per GPU shrinks (4 -> 1) and the time the node's
    # NIC needs stops hiding under compute; the fall is a network effect (smaller at 3200 Gbit/s per node)
    shape = ModelShape.from_spec(load_model("llama-2-70b"))

    def per_gpu(gbps: float, gpus: int) -> float:
        dev = DeviceTable.from_catalog(CAT, ["a100-80gb-sxm"], "bf16", inter_node_gbps={"a100-80gb-sxm": gbps})
        cand = Candidates.make(accelerator=0, tp=1, pp=1, replicas=gpus, micro_batch=512 // gpus, num_micro_batches=1,
                               zero_stage=3, recompute=2)
        b = estimate_batch(shape, TrainShape(seq_len=4096), dev, cand)
        assert bool(b.fits[0])
        return float(b.tokens_per_s[0]) / gpus

    slow = [per_gpu(400.0, n) for n in (128, 256, 512)]
    fast = [per_gpu(3200.0, n) for n in (128, 256, 512)]
    assert slow[0] > slow[1] > slow[2]
    assert slow[2] / slow[0] < 0.92
    assert 1.0 - slow[2] / slow[0] > 1.5 * (1.0 - fast[2] / fast[0])
