"""Pools with measured links between offers and measured profiles per offer (issue 9, item 2): the planner's
batch search uses them as the scalar estimate does, and bad input is one clear error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import TINY
from starverse.catalog import load_catalog
from starverse.costmodel import ModelShape, estimate
from starverse.costmodel.profile import PROFILE_FORMAT, shape_key
from starverse.errors import ConfigError
from starverse.models import load_model
from starverse.planner import job_from_dict, pool_from_dict, search
from starverse.planner.search import best_combinations

CAT = load_catalog(profile="")
MIXED = {"currency": "USD", "cross_offer_gbps": 100, "offers": [
    {"accelerator": "rtx-4090", "count": 16, "price_per_hour": 0.69},
    {"accelerator": "a100-80gb-sxm", "count": 4, "price_per_hour": 2.45}]}
JOB7B = {"model": "llama-2-7b", "train": {"seq_len": 4096, "global_batch": 128, "tokens": 1e9},
         "objective": "throughput", "constraints": {"max_budget_per_hour": 20}}


def test_measured_link_between_offers_is_used_by_the_search_and_the_emitted_plan() -> None:
    slow_pool = pool_from_dict({**MIXED, "network": {"links": {"rtx-4090/a100-80gb-sxm": 1}}}, CAT)
    job = job_from_dict(JOB7B)
    slow = search(job, slow_pool, CAT, top=1).best
    fast = search(job, pool_from_dict(MIXED, CAT), CAT, top=1).best
    assert fast.kind in ("hetero-dp", "hetero-pipeline")  # both offers, across the link
    # at 1 Gbit/s between the two offers the gradient sync between them costs more than it brings
    assert slow.tokens_per_s < fast.tokens_per_s
    # the emitted plan carries the link, and the figure shown is the scalar estimate of that plan
    est = estimate(slow.plan, CAT)
    assert slow.tokens_per_s == pytest.approx(est.tokens_per_s, rel=1e-12)
    if len(slow.devices) == 2:
        assert slow.plan.network.link_gbps("rtx-4090", "a100-80gb-sxm") == 1
    if slow.kind == "hetero-dp":  # what the data-parallel search ranked by (a pipeline is ranked by pipeleaf)
        combos, _, _ = best_combinations(job, slow_pool, CAT, load_model("llama-2-7b"), "full")
        assert combos[0].tps == pytest.approx(est.tokens_per_s, rel=1e-9)


@pytest.mark.parametrize(("links", "message"), [
    ({"rtx-4090/a100-80gb-sxm": 0}, "network.links.rtx-4090/a100-80gb-sxm: must be greater than 0"),
    ({"rtx-4090/a100-80gb-sxm": -5}, "must be greater than 0 (got -5). To fix: give a number more than 0"),
    ({"rtx-4090/h100": 10}, "must name two offers"),
    ({"rtx-4090": 10}, "must name two offers"),
])
def test_bad_links_are_one_clear_error(links: dict, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        pool_from_dict({**MIXED, "network": {"links": links}}, CAT)
    assert message in str(e.value) and "\n" not in str(e.value)


def _profile(tmp: Path, accelerator: str, vocab: int) -> str:
    spec = load_model(TINY | {"vocab_size": vocab})
    doc = {"format": PROFILE_FORMAT, "version": 1, "accelerator": accelerator,
           "model": shape_key(ModelShape.from_spec(spec)),
           "entries": [{"micro_batch": 1, "seq_len": 64, "tp": 1, "precision": "fp32", "layer_forward_s": 0.01,
                        "layer_backward_s": 0.02, "head_forward_s": 0.004, "head_backward_s": 0.006}],
           "links_gb_per_s": {}}
    path = tmp / f"{accelerator}-{vocab}.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_offer_profiles_are_checked_against_accelerator_and_model(tmp_path: Path) -> None:
    (tmp_path / "tiny.json").write_text(json.dumps(TINY | {"num_hidden_layers": 4}))
    job = job_from_dict({"model": str(tmp_path / "tiny.json"),
                         "train": {"seq_len": 64, "global_batch": 4, "precision": "fp32", "steps": 10}})
    offer = {"accelerator": "cpu", "count": 1, "price_per_hour": 0.1}
    # a profile of another device kind: refused when the pool is read
    with pytest.raises(ConfigError, match=r"offers\[0\]\.profile: .* measured on 'rtx-4090'"):
        pool_from_dict({"offers": [offer | {"profile": _profile(tmp_path, "rtx-4090", 320)}]}, CAT)
    # a profile of another model: refused when the search starts
    pool = pool_from_dict({"offers": [offer | {"profile": _profile(tmp_path, "cpu", 640)}]}, CAT)
    with pytest.raises(ConfigError, match=r"offers\[0\]\.profile: profile .* is of another model"):
        search(job, pool, CAT, top=1)
    # the right one: the search's figures are the scalar estimate's with the same profile
    pool = pool_from_dict({"offers": [offer | {"profile": _profile(tmp_path, "cpu", 320)}]}, CAT)
    best = search(job, pool, CAT, top=1).best
    assert best.plan.network.profiles == {"cpu": _profile(tmp_path, "cpu", 320)}
    assert best.tokens_per_s == pytest.approx(estimate(best.plan, CAT).tokens_per_s, rel=1e-12)


def test_measured_collectives_of_an_offer_change_the_plan_and_travel_in_it() -> None:
    """An offer's measured all-reduce bus bandwidth per TP group size decides its TP: Sailor's RTX 3090 node (an
    NVLink-bridged pair at 35.8 GB/s, 4 and 8 GPUs through host memory at 5.28 / 1.35) keeps TP 2 and runs it
    faster than the catalog's PCIe rule says; the same node without the bridges (every group at the 8-GPU
    figure) makes TP 1 the plan. The emitted plan carries the figures, and the batch figure the search ranked by
    is the scalar estimate of that plan."""
    job = job_from_dict({"model": "llama-2-7b", "train": {"seq_len": 4096, "global_batch": 64, "tokens": 1e9},
                         "objective": "throughput", "search": {"hetero_pipelines": False}})
    offer = {"accelerator": "rtx-3090", "count": 16, "price_per_hour": 0.3, "devices_per_node": 8}
    measured = {2: 35.8, 4: 5.28, 8: 1.35}
    plain = search(job, pool_from_dict({"offers": [offer]}, CAT), CAT, top=1).best
    pool = pool_from_dict({"offers": [offer | {"collective_gb_per_s": measured}]}, CAT)
    best = search(job, pool, CAT, top=1).best
    unbridged = {2: 1.35, 4: 1.35, 8: 1.35}
    slow = search(job, pool_from_dict({"offers": [offer | {"collective_gb_per_s": unbridged}]}, CAT), CAT,
                  top=1).best
    assert {s.tp for s in best.plan.groups[0].stages} == {2}
    assert {s.tp for s in slow.plan.groups[0].stages} == {1}
    # the catalog's PCIe rule may choose TP 1 too (as it does since full recompute skips the down projection)
    assert best.tokens_per_s > plain.tokens_per_s >= slow.tokens_per_s
    assert best.plan.network.collective_gb_per_s == {"rtx-3090": measured}
    assert plain.plan.network.collective_gb_per_s == {}
    combos, _, _ = best_combinations(job, pool, CAT, load_model("llama-2-7b"), "full")
    est = estimate(best.plan, CAT)
    assert combos[0].tps == pytest.approx(est.tokens_per_s, rel=1e-9)
    assert best.tokens_per_s == pytest.approx(est.tokens_per_s, rel=1e-12)


@pytest.mark.parametrize(("measured", "message"), [
    ({1: 10.0}, "offers[0].collective_gb_per_s: group size 1 is not one TP can use here; give sizes from 2 to 8"),
    ({16: 10.0}, "group size 16 is not one TP can use here; give sizes from 2 to 8"),
    ({2: 0}, "offers[0].collective_gb_per_s: 2: 0 GB/s; give the measured all-reduce bus bandwidth"),
    ({2: -3.5}, "2: -3.5 GB/s"),
])
def test_bad_measured_collectives_are_one_clear_error(measured: dict, message: str) -> None:
    offer = {"accelerator": "rtx-3090", "count": 8, "price_per_hour": 0.3, "devices_per_node": 8,
             "collective_gb_per_s": measured}
    with pytest.raises(ConfigError) as e:
        pool_from_dict({"offers": [offer]}, CAT)
    assert message in str(e.value) and "\n" not in str(e.value)
