"""Context parallelism in the cost model (``groups[].cp``, issue 9): the sequence split over cp ranks, ring
attention's KV exchange overlapped with attention, and the runtime's refusal (it does not run CP)."""

from __future__ import annotations

from pathlib import Path

import pytest

from starverse.catalog import load_catalog
from starverse.costmodel import estimate
from starverse.costmodel.validate import load_case
from starverse.errors import ConfigError
from starverse.plan import Plan
from starverse.runtime.plan_check import check_ranks

CAT = load_catalog()
CASE = Path(__file__).resolve().parents[2] / "data" / "validation" / "nemo-h100" / "nemolong-llama2-7b-s128k-g128.yaml"


def with_group(plan: Plan, **changes: object) -> Plan:
    return plan.model_copy(update={"groups": [plan.groups[0].model_copy(update=changes)]})


def test_context_parallel_ranks_hold_a_cp_th_of_each_sequence() -> None:
    case = load_case(CASE)
    plan = case.plan
    assert plan.groups[0].cp == 4 and plan.num_devices == 128  # 8 replicas x cp 4 x tp 4
    cp4 = estimate(plan, CAT, case.spec)
    cp2 = estimate(with_group(plan, cp=2), CAT, case.spec)
    assert cp2.num_devices == 64
    # activations per device: flash attention stores no s x s scores, so they scale with the rank's tokens
    a4, a2 = cp4.groups[0].stages[0].activations_gb, cp2.groups[0].stages[0].activations_gb
    assert a4 == pytest.approx(a2 / 2, rel=0.05)
    # twice the ranks per sequence: close to half the step (the KV exchange is hidden behind attention on NVLink)
    assert 0.45 < cp4.step_time_s / cp2.step_time_s < 0.6


def test_the_kv_exchange_is_exposed_only_where_the_link_is_slower_than_attention() -> None:
    case = load_case(CASE)
    fast = estimate(case.plan, CAT, case.spec)
    # tp 4 x cp 4 = 16 ranks: the ring crosses the node's NIC; at 10 Gbit/s it cannot hide behind attention
    slow_plan = case.plan.model_copy(update={"network": case.plan.network.model_copy(
        update={"inter_node_gbps": {"h100-80gb-sxm": 10}})})
    slow = estimate(slow_plan, CAT, case.spec)
    assert slow.breakdown["tp_comm"] > 10 * fast.breakdown["tp_comm"]
    assert slow.step_time_s > 2 * fast.step_time_s


def test_the_runtime_refuses_a_context_parallel_plan() -> None:
    plan = load_case(CASE).plan
    with pytest.raises(ConfigError, match=r"groups\[0\]\.cp is 4.*set cp: 1"):
        check_ranks(plan, [])
