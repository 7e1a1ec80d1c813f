"""network.collective_gb_per_s: a node's measured all-reduce bus bandwidth per group size (issue 9)."""

from __future__ import annotations

import numpy as np
import pytest

from starverse.catalog import load_catalog
from starverse.config import parse
from starverse.costmodel import Candidates, DeviceTable, ModelShape, TrainShape, estimate, estimate_batch
from starverse.costmodel.comm import ring_allreduce_s
from starverse.costmodel.constants import LINK_EFFICIENCY, intra_node_gb_per_s
from starverse.errors import ConfigError
from starverse.models import load_model
from starverse.plan import Plan

CAT = load_catalog()
SPEC = load_model({"model_type": "gpt2", "n_embd": 1024, "n_layer": 24, "n_head": 16, "n_inner": 4096,
                   "vocab_size": 50272, "n_positions": 2048})


def _plan(tp: int, network: dict[str, object]) -> Plan:
    return parse(Plan, {"model": "x", "train": {"seq_len": 2048, "global_batch": 16, "precision": "fp32",
                                                "attention": "eager"},
                        "groups": [{"micro_batch": 2, "stages": [{"accelerator": "rtx-3090", "tp": tp, "layers": 24}]}],
                        "network": network}, "test.yaml")


def test_measured_bus_bandwidth_of_the_group_size_sets_the_tp_all_reduce() -> None:
    """A TP 8 group on a node measured at 1.35 GB/s busbw pays its all-reduces at that bandwidth; a TP 2 group
    on the same node (its own figure) and any size without a figure keep theirs."""
    measured = {"collective_gb_per_s": {"rtx-3090": {2: 35.8, 8: 1.35}}}
    slow = estimate(_plan(8, measured), CAT, SPEC).breakdown["tp_comm"]
    catalog = estimate(_plan(8, {}), CAT, SPEC).breakdown["tp_comm"]
    # 4 all-reduces per layer of mb x seq x h fp32 values, 24 layers, 8 micro-batches (+ embedding and head)
    values = 2 * 2048 * 1024 * 4
    ring = float(ring_allreduce_s(values, 8, 1.35)) * 4 * 24 * 8
    assert ring < slow < 1.2 * ring
    cat_bus = intra_node_gb_per_s(CAT.accelerator("rtx-3090"))
    assert slow / catalog == pytest.approx(cat_bus * 0.78 / 1.35, rel=0.15)
    fast = estimate(_plan(2, measured), CAT, SPEC).breakdown["tp_comm"]
    assert fast < estimate(_plan(2, {}), CAT, SPEC).breakdown["tp_comm"]
    unlisted = {"collective_gb_per_s": {"rtx-3090": {2: 35.8}}}
    assert estimate(_plan(8, unlisted), CAT, SPEC).breakdown["tp_comm"] == pytest.approx(catalog)


def test_a_measured_bandwidth_must_be_positive() -> None:
    with pytest.raises(ConfigError) as exc:
        _plan(8, {"collective_gb_per_s": {"rtx-3090": {8: 0}}})
    assert "collective_gb_per_s" in str(exc.value)


@pytest.mark.parametrize(("tp", "replicas"), [(8, 1), (2, 4), (4, 2)])
def test_batch_path_reads_the_measured_figure_as_the_scalar_estimate_does(tp: int, replicas: int) -> None:
    """The planner's DeviceTable gives a row's measured bus bandwidth at the TP degree that has one (TP
    all-reduces and the intra-node part of the DP ring), the catalog rule at any other (TP 4 here), and
    the batch estimate equals the scalar one on the same plan."""
    network = {"collective_gb_per_s": {"rtx-3090": {2: 35.8, 8: 1.35}}}
    p = parse(Plan, {"model": "x", "train": {"seq_len": 2048, "global_batch": 16, "precision": "fp32",
                                             "attention": "eager"},
                     "groups": [{"micro_batch": 2, "replicas": replicas,
                                 "stages": [{"accelerator": "rtx-3090", "tp": tp, "layers": 24}]}],
                     "network": network}, "test.yaml")
    dev = DeviceTable.from_catalog(CAT, ["rtx-3090"], "fp32", devices_per_node={"rtx-3090": 8},
                                   collective_gb_per_s=network["collective_gb_per_s"])
    plain = DeviceTable.from_catalog(CAT, ["rtx-3090"], "fp32", devices_per_node={"rtx-3090": 8})
    cand = Candidates.make(accelerator=0, tp=tp, pp=1, replicas=replicas, micro_batch=2,
                           num_micro_batches=8 // replicas)
    est = estimate(p, CAT, SPEC)
    b = estimate_batch(ModelShape.from_spec(SPEC), TrainShape.from_train(p.train), dev, cand)
    assert b.step_time_s[0] == pytest.approx(est.step_time_s, rel=1e-9)
    unmeasured = estimate_batch(ModelShape.from_spec(SPEC), TrainShape.from_train(p.train), plain, cand)
    assert (b.step_time_s[0] == unmeasured.step_time_s[0]) == (tp == 4)
    at = dev.intra_node_at(np.zeros(3, dtype=np.int64), np.array([2, 4, 8]))
    assert at.tolist() == pytest.approx([35.8 / LINK_EFFICIENCY, plain.intra_node_gb_per_s[0], 1.35 / LINK_EFFICIENCY])


def test_a_profiles_measured_intra_node_link_keeps_precedence_in_the_batch_path() -> None:
    """As in ``costmodel.step._intra_node``: a row's profile with ``links_gb_per_s.intra_node`` wins over the
    offer's per-size figures; the other row keeps its measured figure."""
    from starverse.costmodel.profile import ModelProfile

    prof = ModelProfile(path="p.json", accelerator="rtx-3090", model={}, entries=(),
                        links_gb_per_s={"intra_node": 12.5})
    acc = CAT.accelerator("rtx-3090")
    dev = DeviceTable.from_accelerators([acc, acc], "fp32", profiles=[prof, None],
                                        collective_gb_per_s=[{2: 35.8}, {2: 35.8}])
    at = dev.intra_node_at(np.array([0, 1]), np.array([2, 2]))
    assert at.tolist() == pytest.approx([12.5 / LINK_EFFICIENCY, 35.8 / LINK_EFFICIENCY])
