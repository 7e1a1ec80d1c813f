"""Planning on owned/local devices: owned offers at price 0, what the objectives mean there, the runtime's
restrictions, and ``plan_for_devices`` (the API behind ``accelerate`` and the elastic re-plan)."""

from __future__ import annotations

import pytest

from starverse.catalog import load_catalog
from starverse.costmodel import estimate
from starverse.errors import CatalogError, ConfigError, InfeasiblePlanError
from starverse.models import load_model
from starverse.planner import (
    RUNTIME_CAPS,
    UNRESTRICTED,
    Objective,
    job_from_dict,
    plan_for_devices,
    pool_from_dict,
    search,
)

SMALL = {
    "model_type": "llama", "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 8192, "max_position_embeddings": 2048,
}
"""The shape of ``accelerate``'s scaled-down Llama on CPU ranks (a config dict, as the runtime has it)."""
TRAIN = {"seq_len": 512, "global_batch": 16, "precision": "bf16"}


@pytest.fixture(scope="module")
def catalog():
    return load_catalog(profile="")


def _job(objective: str, **search):
    return job_from_dict({"model": "llama-tiny", "train": {"seq_len": 512, "global_batch": 16, "tokens": 1e8},
                          "objective": objective, "search": search})


OWNED = {"offers": [{"accelerator": "rtx-4090", "count": 4, "owned": True},
                    {"accelerator": "a100-80gb-sxm", "count": 2, "owned": True}]}


def test_owned_offers_cost_nothing_unless_given_an_amortised_price(catalog):
    pool = pool_from_dict(OWNED, catalog)
    assert [o.price_per_hour for o in pool.offers] == [0.0, 0.0] and pool.free
    assert all(o.owned for o in pool.offers)
    amortised = pool_from_dict({"offers": [{"accelerator": "rtx-4090", "count": 4, "owned": True,
                                            "price_per_hour": 0.05}]}, catalog)
    assert amortised.offers[0].price_per_hour == 0.05 and not amortised.free
    # `cpu` has no catalog price: fine when owned, an error with what to do when rented
    assert pool_from_dict({"offers": [{"accelerator": "cpu", "count": 2, "owned": True}]}, catalog).free
    with pytest.raises(ConfigError, match=r"no price_per_hour given and the catalog has no on-demand price for 'cpu'"):
        pool_from_dict({"offers": [{"accelerator": "cpu", "count": 2}]}, catalog)


def test_cost_performance_on_owned_devices_ranks_by_throughput(catalog):
    pool = pool_from_dict(OWNED, catalog)
    cp = search(_job("cost-performance"), pool, catalog, top=3)
    tp = search(_job("throughput"), pool, catalog, top=3)
    assert cp.objective == Objective.THROUGHPUT
    assert cp.notes[0] == ("every device is owned (price 0): tokens per unit of money is unbounded, so objective "
                           "'cost-performance' ranks plans by throughput")
    assert [r.devices for r in cp.plans] == [r.devices for r in tp.plans]
    assert cp.best.objective_value == pytest.approx(cp.best.tokens_per_s)
    assert cp.best.objective_value == max(r.tokens_per_s for r in cp.plans)
    assert cp.best.cost_per_hour == 0 and cp.best.total_cost == 0
    # no "no price for" warning: the pool prices owned devices, not the catalog
    assert not any("no price" in n for r in cp.plans for n in r.notes)
    assert cp.best.plan.pricing is None


def test_cost_on_owned_devices_ranks_by_time(catalog):
    pool = pool_from_dict(OWNED, catalog)
    cost = search(_job("cost"), pool, catalog, top=3)
    time = search(_job("time"), pool, catalog, top=3)
    assert cost.objective == Objective.TIME and "'cost' ranks plans by time" in cost.notes[0]
    assert cost.best.objective_value == pytest.approx(-cost.best.hours)
    assert [r.devices for r in cost.plans] == [r.devices for r in time.plans]


def test_cost_performance_refused_when_free_and_priced_offers_mix(catalog):
    mixed = pool_from_dict({"offers": [{"accelerator": "rtx-4090", "count": 4, "owned": True},
                                       {"accelerator": "a100-80gb-sxm", "count": 2, "price_per_hour": 2.0}]},
                           catalog, source="pool.yaml")
    with pytest.raises(ConfigError) as e:
        search(_job("cost-performance"), mixed, catalog)
    assert str(e.value) == (
        "pool.yaml: objective 'cost-performance' is undefined when some offers are free (rtx-4090) and others are "
        "not: a plan on the free devices alone would win whatever its speed. To fix: use objective throughput, "
        "time or cost, or give the owned offers an amortised price_per_hour")
    # with every device used, each plan pays for the rented ones: well defined
    r = search(_job("cost-performance", use_all_devices=True), mixed, catalog)
    assert r.best.devices == {"rtx-4090": 4, "a100-80gb-sxm": 2} and r.best.cost_per_hour == pytest.approx(4.0)
    assert r.best.objective_value == pytest.approx(r.best.tokens_per_s * 3600 / 4.0)
    # throughput on the mixed pool is fine too
    assert search(_job("throughput"), mixed, catalog).best.tokens_per_s > 0


def test_search_restrictions_hold_in_every_plan(catalog):
    pool = pool_from_dict({"offers": [{"accelerator": "rtx-4090", "count": 8, "price_per_hour": 0.5}]}, catalog)
    job = job_from_dict({"model": "llama-2-7b", "train": {"seq_len": 2048, "global_batch": 32},
                         "objective": "throughput"})
    free = search(job, pool, catalog, top=5)
    # unrestricted, a 7B model on 24 GB cards needs TP or pipelines
    assert any(s.tp > 1 or g.num_stages > 1 for r in free.plans for g in r.plan.groups for s in g.stages)
    restricted = job.model_copy(update={"search": job.search.model_copy(update={"max_tp": 2,
                                                                                "max_pipeline_stages": 2})})
    r = search(restricted, pool, catalog, top=5)
    for rp in r.plans:
        for g in rp.plan.groups:
            assert g.num_stages <= 2 and all(s.tp <= 2 for s in g.stages)
    assert r.best.objective_value <= free.best.objective_value


def test_plan_for_devices_on_cpu_ranks_is_data_parallel_with_its_estimate(catalog):
    r = plan_for_devices(SMALL, {"cpu": 2}, policy="cost-performance", model_name="small.json",
                         train={"seq_len": 64, "global_batch": 8, "precision": "fp32", "zero_stage": 1},
                         catalog=catalog)
    plan = r.best.plan
    assert plan.model == "small.json" and plan.num_devices == 2
    assert [(g.replicas, g.num_stages, g.stages[0].tp, g.stages[0].accelerator) for g in plan.groups] == [
        (2, 1, 1, "cpu")]
    # the runtime's fixes win over the caller's train settings
    assert (plan.train.zero_stage, plan.train.recompute, plan.train.offload) == (0, "none", "none")
    assert plan.train.global_batch == 8 and plan.train.precision == "fp32"
    assert r.objective == Objective.THROUGHPUT
    again = estimate(plan, catalog, load_model(SMALL))
    assert r.best.estimate.step_time_s == pytest.approx(again.step_time_s)
    assert r.best.tokens_per_s == pytest.approx(8 * 64 / again.step_time_s)


def test_plan_for_devices_mixed_kinds_use_every_device_split_by_speed(catalog):
    r = plan_for_devices("llama-tiny", {"rtx-4090": 2, "a100-80gb-sxm": 1}, train=TRAIN, catalog=catalog)
    best = r.best
    assert best.kind == "hetero-dp" and best.devices == {"rtx-4090": 2, "a100-80gb-sxm": 1}
    shares = {g.stages[0].accelerator: g.batch_share for g in best.plan.groups}
    assert sum(shares.values()) == pytest.approx(1.0)
    # the A100 is faster than one 4090, so its single replica takes more than a third of a 4090 replica's share
    assert shares["a100-80gb-sxm"] > shares["rtx-4090"] / 2
    # the runtime runs pipelines now: the two 4090s may form one 2-stage replica beside the A100's (PP x DP),
    # or one group of two replicas (a tiny model's layers are launch-bound: more replicas, no pipeline)
    assert sorted(g.num_stages for g in best.plan.groups) in ([1, 1, 1], [1, 2], [1, 1])


def test_plan_for_devices_with_prices_and_unrestricted(catalog):
    priced = plan_for_devices("llama-tiny", {"rtx-4090": 2}, train=TRAIN, catalog=catalog, prices={"rtx-4090": 0.4})
    assert priced.objective == Objective.COST_PERFORMANCE and priced.best.cost_per_hour == pytest.approx(0.8)
    assert priced.best.plan.pricing.price_per_hour == {"rtx-4090": 0.4}
    # unrestricted: the planner may use a subset and any layout (here 70B needs TP/pipelines and offload)
    r = plan_for_devices("llama-2-70b", {"a100-80gb-sxm": 16}, train={"seq_len": 4096, "global_batch": 64},
                         catalog=catalog, runtime_caps=None)
    g = r.best.plan.groups[0]
    assert g.num_stages > 1 or g.stages[0].tp > 1
    with pytest.raises(InfeasiblePlanError, match=r"needs ≥ 1\.1 TB of weights\+gradients\+Adam state plus "
                                                  r"activations; the pool has 1\.28 TB .* \(searched only what the "
                                                  r"runtime executes: TP ≤ 1, "):
        plan_for_devices("llama-2-70b", {"a100-80gb-sxm": 16}, train={"seq_len": 4096, "global_batch": 64},
                         catalog=catalog, runtime_caps=RUNTIME_CAPS)
    assert UNRESTRICTED.search_options(2)["use_all_devices"] is False


def test_plan_for_devices_errors_say_what_to_do(catalog):
    with pytest.raises(InfeasiblePlanError) as e:
        plan_for_devices(SMALL, {"cpu": 3}, train={"seq_len": 64, "global_batch": 16, "precision": "fp32"},
                         catalog=catalog, model_name="small")
    assert str(e.value) == (
        "no plan for small on <devices>: every device must be used (3×cpu, one group per kind, equal replicas "
        "within a group, whole micro-batches), and a global batch of 16 sequences cannot be split that way; to "
        "fix: a global batch of 15 or 18, or use fewer devices (searched only what the runtime executes: TP ≤ 1, "
        "ZeRO-0, recompute none, offload none, full training, every device used)")
    with pytest.raises(ConfigError, match=r"^plan_for_devices: devices must map accelerator ids to counts >= 1"):
        plan_for_devices(SMALL, {}, train=TRAIN, catalog=catalog)
    with pytest.raises(ConfigError, match=r"^plan_for_devices: prices given for h100-80gb-sxm, which are not among"):
        plan_for_devices(SMALL, {"cpu": 2}, train=TRAIN, catalog=catalog, prices={"h100-80gb-sxm": 2.0})
    with pytest.raises(CatalogError, match=r"^plan_for_devices: devices: unknown accelerator 'rtx-4909'; did you "
                                           r"mean 'rtx-4090'"):
        plan_for_devices(SMALL, {"rtx-4909": 2}, train=TRAIN, catalog=catalog)
