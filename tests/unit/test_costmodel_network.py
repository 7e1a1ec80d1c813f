"""Issue 9 terms: measured links between offers, usable device memory, fp32 gradient reduction, the
tied-embedding all-reduce, and their bad-input errors."""

from __future__ import annotations

import pytest

from starverse.catalog import load_catalog
from starverse.config import parse
from starverse.costmodel import DeviceTable, estimate
from starverse.costmodel.constants import NETWORK_EFFICIENCY, usable_memory_gb
from starverse.errors import ConfigError
from starverse.models import load_model
from starverse.plan import Plan

CAT = load_catalog()


def mixed(network: dict, **train: object) -> Plan:
    t = {"seq_len": 4096, "global_batch": 16, "recompute": "full", "zero_stage": 1, "schedule": "1f1b"} | train
    return parse(Plan, {"model": "llama-2-70b", "train": t,
                        "groups": [{"replicas": 1, "micro_batch": 1, "stages": [
                            {"accelerator": "a100-80gb-sxm", "tp": 8, "layers": 60},
                            {"accelerator": "h100-80gb-sxm", "tp": 8, "layers": 20}]}],
                        "network": network}, "t.yaml")


def test_a_measured_link_between_two_offers_overrides_the_cross_group_default() -> None:
    by_link = estimate(mixed({"cross_group_gbps": 1600, "links": {"h100-80gb-sxm/a100-80gb-sxm": 10}}), CAT)
    by_default = estimate(mixed({"cross_group_gbps": 10}), CAT)
    per_send = 4096 * 8192 * 2 / 8 / (10 / 8 * NETWORK_EFFICIENCY / 8 * 1e9)
    assert by_link.breakdown["pp_comm"] == pytest.approx(2 * (16 + 2 - 1) * per_send, rel=0.01)
    assert by_link.breakdown["pp_comm"] == pytest.approx(by_default.breakdown["pp_comm"], rel=1e-9)


def test_link_between_two_groups_sets_the_gradient_sync() -> None:
    def two_groups(links: dict) -> Plan:
        stage = {"tp": 8, "layers": 80}
        return parse(Plan, {"model": "llama-2-70b",
                            "train": {"seq_len": 4096, "global_batch": 16, "recompute": "full", "zero_stage": 1},
                            "groups": [{"replicas": 1, "stages": [{"accelerator": "a100-80gb-sxm"} | stage]},
                                       {"replicas": 1, "stages": [{"accelerator": "h100-80gb-sxm"} | stage]}],
                            "network": {"cross_group_gbps": 100, "links": links}}, "t.yaml")

    base = estimate(two_groups({}), CAT).breakdown["cross_group_sync"]
    slow = estimate(two_groups({"a100-80gb-sxm/h100-80gb-sxm": 10}), CAT).breakdown["cross_group_sync"]
    assert slow == pytest.approx(10 * base, rel=0.01)  # bandwidth-bound: 10x slower link, 10x the time


def test_network_figures_that_nccl_reached_are_not_discounted_again() -> None:
    # Sailor's MIT share states what NCCL's send/recv reached between its nodes (network.achieved_gbps): the
    # pipeline sends, the tied-embedding all-reduce and the sync between groups then run at the figure itself,
    # not at NETWORK_EFFICIENCY of it; a within-kind DP ring over the NIC too
    achieved = estimate(mixed({"cross_group_gbps": 10, "achieved_gbps": True}), CAT)
    line = estimate(mixed({"cross_group_gbps": 10}), CAT)
    per_send = 4096 * 8192 * 2 / 8 / (10 / 8 / 8 * 1e9)
    assert achieved.breakdown["pp_comm"] == pytest.approx(2 * (16 + 2 - 1) * per_send, rel=0.01)
    assert line.breakdown["pp_comm"] == pytest.approx(achieved.breakdown["pp_comm"] / NETWORK_EFFICIENCY, rel=0.01)

    def dp(network: dict) -> float:
        plan = {"model": "llama-2-7b", "train": {"seq_len": 2048, "global_batch": 32, "zero_stage": 0},
                "groups": [{"replicas": 4, "micro_batch": 1, "stages": [{"accelerator": "a100-80gb-sxm", "tp": 8,
                                                                          "layers": 32}]}],
                "network": {"inter_node_gbps": {"a100-80gb-sxm": 10}} | network}
        return estimate(parse(Plan, plan, "t.yaml"), CAT).breakdown["dp_comm"]

    assert dp({}) == pytest.approx(dp({"achieved_gbps": True}) / NETWORK_EFFICIENCY, rel=0.02)


def test_usable_memory_is_the_drivers_figure_and_a_plan_can_override_it() -> None:
    t4 = CAT.accelerator("t4")
    assert usable_memory_gb(t4) == pytest.approx(15360 * 2**20 / 1e9)  # ECC on: 15360 MiB, not 16 GiB
    assert usable_memory_gb(CAT.accelerator("a100-80gb-sxm")) == pytest.approx(80 * 2**30 / 1e9)
    plan = {"model": "llama-2-7b", "train": {"seq_len": 1024, "global_batch": 16, "zero_stage": 3,
                                               "recompute": "full", "precision": "fp16"},
            "groups": [{"replicas": 4, "stages": [{"accelerator": "t4", "tp": 4, "layers": 32}]}]}
    default = estimate(parse(Plan, plan, "t.yaml"), CAT)
    smaller = estimate(parse(Plan, plan | {"network": {"usable_memory_gb": {"t4": 12.0}}}, "t.yaml"), CAT)
    assert default.capacity_gb == pytest.approx(15360 * 2**20 / 1e9 * 0.94, rel=1e-6)
    assert smaller.capacity_gb == pytest.approx(12.0 * 0.94, rel=1e-6)
    table = DeviceTable.from_catalog(CAT, ["t4", "rtx-4090"], usable_memory_gb={"t4": 12.0})
    assert table.memory_gb[0] == 12.0 and table.memory_gb[1] == pytest.approx(24 * 2**30 / 1e9)


def test_fp32_gradient_reduction_doubles_data_parallel_traffic() -> None:
    def dp(**train: object) -> Plan:
        return parse(Plan, {"model": "llama-2-7b",
                            "train": {"seq_len": 2048, "global_batch": 64, "recompute": "full"} | train,
                            "groups": [{"replicas": 16, "micro_batch": 1, "stages": [
                                {"accelerator": "a100-80gb-sxm", "tp": 4, "layers": 32}]}],
                            "network": {"inter_node_gbps": {"a100-80gb-sxm": 25}}}, "t.yaml")

    bf16, fp32 = estimate(dp(), CAT), estimate(dp(grad_reduce_fp32=True), CAT)
    assert fp32.breakdown["dp_comm"] > 1.8 * bf16.breakdown["dp_comm"] > 0


def test_fp32_gradient_reduction_under_zero3_is_the_reduce_scatter_alone() -> None:
    """FSDP's ``reduce_dtype=float32`` (Composer's mixed precision DEFAULT, llm-foundry's runs): the gradients'
    reduce-scatter moves 4 bytes a value, the parameters' two all-gathers stay 16-bit: 2 x 2 + 4 = 8 bytes against
    6 for bf16, so a step bound by those collectives takes 4/3 as long."""
    def z3(**train: object) -> Plan:
        return parse(Plan, {"model": "llama-2-7b",
                            "train": {"seq_len": 2048, "global_batch": 16, "recompute": "full", "zero_stage": 3} | train,
                            "groups": [{"replicas": 16, "micro_batch": 1, "stages": [
                                {"accelerator": "a100-80gb-sxm", "tp": 1, "layers": 32}]}],
                            "network": {"inter_node_gbps": {"a100-80gb-sxm": 1}}}, "t.yaml")

    bf16, fp32 = estimate(z3(), CAT), estimate(z3(grad_reduce_fp32=True), CAT)
    assert bf16.breakdown["dp_comm"] > 100 * bf16.breakdown["compute"]  # bound by the collectives
    assert fp32.breakdown["dp_comm"] / bf16.breakdown["dp_comm"] == pytest.approx(4 / 3, rel=0.01)


def test_tied_embeddings_are_all_reduced_between_first_and_last_stage() -> None:
    gpt = load_model({"model_type": "gpt2", "n_embd": 2048, "n_layer": 24, "n_head": 16, "vocab_size": 50257,
                      "n_positions": 2048})
    assert gpt.tie_embeddings

    def pp(links: dict) -> Plan:
        return parse(Plan, {"model": "gpt2", "train": {"seq_len": 2048, "global_batch": 8, "precision": "fp16"},
                            "groups": [{"replicas": 1, "micro_batch": 1, "stages": [
                                {"accelerator": "rtx-3090", "tp": 1, "layers": 12},
                                {"accelerator": "titan-rtx", "tp": 1, "layers": 12}]}],
                            "network": {"links": links}}, "t.yaml")

    fast = estimate(pp({"rtx-3090/titan-rtx": 5}), CAT, gpt)
    slow = estimate(pp({"rtx-3090/titan-rtx": 1}), CAT, gpt)
    # fp16 gradient of the 50257 x 2048 embedding, 2-rank all-reduce (volume 1x) over 1 Gbit/s
    tied = 50257 * 2048 * 2 / (1 / 8 * NETWORK_EFFICIENCY * 1e9)
    assert slow.breakdown["dp_comm"] - fast.breakdown["dp_comm"] == pytest.approx(tied * (1 - 1 / 5), rel=0.01)


@pytest.mark.parametrize(("network", "message"), [
    ({"links": {"rtx-4090/a100-80gb-sxm": 0}}, "network.links.rtx-4090/a100-80gb-sxm"),
    ({"links": {"rtx-4090/a100-80gb-sxm": -5}}, "greater than 0"),
    ({"links": {"rtx-4090": 10}}, "must name two accelerators as 'a/b'"),
    ({"usable_memory_gb": {"t4": 0}}, "network.usable_memory_gb.t4"),
])
def test_bad_network_input_is_one_clear_error(network: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("/", "/")):
        parse(Plan, {"model": "llama-2-7b", "train": {"seq_len": 2048, "global_batch": 8},
                     "groups": [{"stages": [{"accelerator": "t4", "layers": 32}]}], "network": network}, "plan.yaml")


def test_data_parallel_groups_reduce_in_one_ring_not_an_in_group_plus_a_cross_group_ring() -> None:
    """12 V100 replicas over 3 nodes + 4 T4 replicas, 10 Gbit/s (AMP's mixed cluster): DeepSpeed reduces
    the gradients in one 16-rank ring; the step pays that ring, not the 12-rank ring plus a 2-rank one."""
    from starverse.costmodel.batch import joint_sync_s
    from starverse.costmodel.comm import ring_allreduce_s

    nic = 10 / 8 * NETWORK_EFFICIENCY
    s = 1.4e9
    extra = joint_sync_s(s, [12, 4], [nic, 20.0], [1.0, 1.0], 10.0)
    count = -(-s // 25e6)
    joint = float(ring_allreduce_s(s, 16, nic, count))
    assert extra[0] == pytest.approx(joint - float(ring_allreduce_s(s, 12, nic, count)), rel=1e-9)
    assert extra[1] == pytest.approx(joint - float(ring_allreduce_s(s, 4, 20.0, count)), rel=1e-9)
    # the old sum charged the whole 2-rank ring on top of the 12-rank one
    assert extra[0] < 0.2 * float(ring_allreduce_s(s, 2, nic, count))
    # one replica per group on the full link: the ring of the groups
    assert joint_sync_s(s, [1, 1, 1], [float("inf")] * 3, [1.0] * 3, 10.0) == pytest.approx(
        float(ring_allreduce_s(s, 3, nic, count)), rel=1e-9)

    from pathlib import Path

    from starverse.costmodel.validate import load_case

    case = load_case(Path(__file__).resolve().parents[2] / "data" / "validation" / "amp-aws" / "mixed"
                     / "amp_mixed-mp1-dp16-pp1-mbs1.yaml")
    est = estimate(case.plan, CAT, case.spec)
    v100, t4 = est.groups
    # the V100 group already pays a 12-rank ring over its 10 Gbit/s NICs: far less than the old 2-rank ring
    # of the whole gradient on top; the T4 group (one node) now waits for the 16-rank ring
    grads = 4.0 * case.spec.num_params
    old = v100.step_time_s + float(ring_allreduce_s(grads, 2, nic, -(-grads // 25e6)))
    assert max(v100.step_time_s, t4.step_time_s) < est.step_time_s < old - 0.5
    assert est.step_time_s == pytest.approx(t4.step_time_s + est.breakdown["cross_group_sync"], rel=1e-9)


def test_fp32_eager_attention_pays_the_unfused_softmax_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Megatron's fused scale-mask-softmax is fp16/bf16 only: fp32 (Sailor's GH200 runs, TF32) scales and
    masks the scores in separate passes; 16-bit eager attention keeps the fused kernel."""
    from pathlib import Path

    from starverse.costmodel import constants as C
    from starverse.costmodel.validate import load_case

    case = load_case(Path(__file__).resolve().parents[2] / "data" / "validation" / "sailor-clariden"
                     / "sailor_gh200-opt350m-n16-pp4-dp4-mbs8-gbs1024.yaml")
    bf16 = case.plan.model_copy(update={"train": case.plan.train.model_copy(update={"precision": "bf16"})})
    with_passes = estimate(case.plan, CAT, case.spec).breakdown["memory"]
    bf16_with = estimate(bf16, CAT, case.spec).breakdown["memory"]
    monkeypatch.setattr(C, "EAGER_UNFUSED_SOFTMAX_BYTES", 0.0)
    assert estimate(case.plan, CAT, case.spec).breakdown["memory"] < 0.85 * with_passes
    assert estimate(bf16, CAT, case.spec).breakdown["memory"] == pytest.approx(bf16_with, rel=1e-12)


def test_overlapped_interleaved_sends_expose_only_the_fill_and_drain() -> None:
    """NeMo 2.0 overlaps an interleaved pipeline's sends with the next chunk (``train.overlap_p2p_comm``)."""
    from pathlib import Path

    from starverse.costmodel.validate import load_case

    case = load_case(Path(__file__).resolve().parents[2] / "data" / "validation" / "nemo-h100"
                     / "nemo2412-llama2-70b-g64.yaml")
    assert case.plan.train.overlap_p2p_comm and case.plan.train.schedule == "interleaved"
    plain = case.plan.model_copy(update={"train": case.plan.train.model_copy(update={"overlap_p2p_comm": False})})
    over, exposed = estimate(case.plan, CAT, case.spec), estimate(plain, CAT, case.spec)
    g = exposed.groups[0]
    pp, v, m = 4, g.virtual_stages, g.num_micro_batches
    per_send = exposed.breakdown["pp_comm"] / (2 * (m + pp - 1) * v)
    assert over.breakdown["pp_comm"] == pytest.approx(2 * (pp - 1) * per_send, rel=1e-9)
    assert over.step_time_s < exposed.step_time_s


def test_nccl_latency_of_a_ring_grows_with_the_ring_and_an_all_reduce_may_take_the_tree() -> None:
    from starverse.costmodel import constants as K
    from starverse.costmodel.comm import nccl_latency_s

    # all-gather / reduce-scatter: a ring only; 512 ranks on 64 nodes: 448 NVLink steps and 63 network steps
    ring = float(nccl_latency_s(512, 64, False))
    assert ring == pytest.approx(K.NCCL_BASE_LATENCY_S + 448 * K.NCCL_INTRA_RING_STEP_S + 63 * K.NCCL_NET_RING_STEP_S)
    assert float(nccl_latency_s(512, 64, False)) > 3.5 * float(nccl_latency_s(128, 16, False))
    # all-reduce over many nodes: the tree's 2 log2(nodes) network steps beat the ring's 2(nodes - 1)
    tree = K.NCCL_BASE_LATENCY_S + 2 * (7 * K.NCCL_INTRA_TREE_STEP_S + 6 * K.NCCL_NET_TREE_STEP_S)
    assert float(nccl_latency_s(512, 64, True)) == pytest.approx(tree)
    # inside one node the ring is faster; one rank has no collective
    assert float(nccl_latency_s(8, 1, True)) == pytest.approx(K.NCCL_BASE_LATENCY_S + 14 * K.NCCL_INTRA_RING_STEP_S)
    assert float(nccl_latency_s(1, 1, True)) == 0.0


def test_zero3_per_gpu_throughput_falls_with_the_ring_size() -> None:
    # llm-foundry's FSDP runs (mptscale): tokens/s per GPU falls from 128 to 512 H100s; the ring latency of the
    # per-layer gathers and reduce-scatters grows with the ring (a pure bandwidth ring would keep it flat)
    def per_gpu(replicas: int) -> float:
        plan = parse(Plan, {"model": "llama-2-7b",
                            "train": {"seq_len": 2048, "global_batch": 6 * replicas, "zero_stage": 3},
                            "groups": [{"replicas": replicas, "micro_batch": 6,
                                        "stages": [{"accelerator": "h100-80gb-sxm", "tp": 1, "layers": 32}]}]},
                     "t.yaml")
        est = estimate(plan, CAT)
        return est.tokens_per_s / replicas

    assert per_gpu(512) < per_gpu(256) < per_gpu(128)
    # 96 collectives per step at ~0.6 ms (128 ranks) and ~2.4 ms (512 ranks) of latency each, overlapped but
    # taking SMs: ~3 % per GPU (MPT-7B measured: 7.7 %); NCCL's tree-like 2 log2(n) steps gave 0.1 %
    assert per_gpu(128) / per_gpu(512) > 1.02


def _slices(zero_stage: int, network: dict, slices: int = 2) -> Plan:
    """MaxText's multislice layout: ``slices`` groups of one TPU v5e slice (16 FSDP replicas x TP 8)."""
    group = {"replicas": 16, "micro_batch": 8, "stages": [{"accelerator": "tpu-v5e", "tp": 8, "layers": 40}]}
    return parse(Plan, {"model": "llama-2-13b",
                        "train": {"seq_len": 2048, "global_batch": 128 * slices, "zero_stage": zero_stage,
                                  "recompute": "full"},
                        "groups": [group] * slices, "network": network}, "t.yaml")


def test_groups_of_one_kind_meet_over_the_cross_group_link() -> None:
    """TPU slices of one kind meet only over the data-centre network (the catalog's note on ``inter_node_gbps``):
    ``cross_group_gbps`` is the link between groups whatever their kinds, the node's NIC (ICI within a slice)
    only when it is not given."""
    dcn = estimate(_slices(3, {"cross_group_gbps": 200}), CAT).breakdown["cross_group_sync"]
    ici = estimate(_slices(3, {}), CAT).breakdown["cross_group_sync"]
    assert dcn > 20 * ici > 0


def test_sharded_gradients_cross_between_groups_as_each_ranks_shard() -> None:
    """With ZeRO-2/3 inside each group only each rank's gradient shard crosses between the groups (XLA's reduction
    of a parameter sharded over a slice and replicated over slices; FSDP's HYBRID_SHARD; the runtime's sharded
    replicas): one ring per shard over the slices, every device of a host sending its shard through the host's
    link at once; with ZeRO 0-1 the one ring over every replica (DeepSpeed's, Megatron's)."""
    from starverse.costmodel.comm import ring_allreduce_s
    from starverse.costmodel.constants import GRADIENT_BUCKET_BYTES

    spec = load_model("llama-2-13b")
    for slices in (2, 8):
        est = estimate(_slices(3, {"cross_group_gbps": 200}, slices), CAT)
        shard = spec.num_params * 2 / 8 / 16  # bf16 gradients, 1/TP, 1/(FSDP replicas)
        per_chip = 200 / 8 * NETWORK_EFFICIENCY / 8  # a v5e host's 8 chips share its link
        want = float(ring_allreduce_s(shard, slices, per_chip, -(-shard // GRADIENT_BUCKET_BYTES)))
        assert est.breakdown["cross_group_sync"] == pytest.approx(want, rel=0.02)
    flat = estimate(_slices(1, {"cross_group_gbps": 200}), CAT).breakdown["cross_group_sync"]
    sharded = estimate(_slices(3, {"cross_group_gbps": 200}), CAT).breakdown["cross_group_sync"]
    assert flat > 5 * sharded


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_the_search_ranks_a_two_offer_plan_by_its_scalar_estimate(zero_stage: int) -> None:
    """Two offers over a slow link between them: the plan's network carries the link, and the figure the search
    ranked the plan by is its scalar estimate, the cross-group sync included (ZeRO-1: one ring over every
    replica; ZeRO-3: each rank's shard); a plan of one offer has no link between offers."""
    from starverse.planner import job_from_dict, pool_from_dict, search

    job = job_from_dict({"model": "llama-2-7b", "objective": "throughput", "search": {"hetero_pipelines": False},
                         "train": {"seq_len": 2048, "global_batch": 64, "tokens": 1e9, "zero_stage": zero_stage,
                                   "recompute": "full"}})
    offers = [{"name": "a", "accelerator": "a100-80gb-sxm", "count": 8, "price_per_hour": 1.0},
              {"name": "h", "accelerator": "h100-80gb-sxm", "count": 8, "price_per_hour": 1.0}]
    res = search(job, pool_from_dict({"offers": offers, "cross_offer_gbps": 25}, CAT), CAT, top=20)
    two = [p for p in res.plans if len(p.plan.groups) == 2]
    assert two, [p.plan.groups for p in res.plans]
    for p in two:
        est = estimate(p.plan, CAT)
        assert p.plan.network.cross_group_gbps == 25
        assert est.breakdown["cross_group_sync"] > 0
        assert p.tokens_per_s == pytest.approx(est.tokens_per_s, rel=1e-9)
    one = search(job, pool_from_dict({"offers": offers[:1], "cross_offer_gbps": 25}, CAT), CAT, top=1).best
    assert one.plan.network.cross_group_gbps is None
