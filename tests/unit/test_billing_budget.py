"""Budgets: the per-hour cap refuses plans; the total cap stops a job before the next interval exceeds it."""

from __future__ import annotations

import math
from decimal import Decimal
from pathlib import Path

import pytest

from starverse.billing import LeasePricing, Ledger, PricingMode, check_plan_budget, next_interval_exceeds
from starverse.billing.money import TICKS_PER_MICRO, price_to_micros
from starverse.errors import BudgetExceededError
from starverse.plan import Group, Plan, Pricing, Stage, TrainSpec

T0 = 1_700_000_000


def plan(pricing: Pricing | None) -> Plan:
    return Plan(model="llama-2-7b", train=TrainSpec(seq_len=128, global_batch=16),
                groups=[Group(replicas=4, stages=[Stage(accelerator="rtx-4090", layers=32)]),
                        Group(replicas=1, stages=[Stage(accelerator="a100-80gb-sxm", tp=2, layers=32)])],
                pricing=pricing)


def test_plan_above_max_budget_per_hour_is_refused():
    p = plan(Pricing(currency="USD", price_per_hour={"rtx-4090": 0.5, "a100-80gb-sxm": 2.0}))
    assert check_plan_budget(p, "6") == Decimal("6.0")  # 4 x 0.5 + 2 x 2.0, exactly at the cap
    with pytest.raises(BudgetExceededError, match=r"plan refused: its 6 devices cost 6.00 USD/h, above "
                                                  r"max_budget_per_hour 5.99 USD\. To fix: raise the budget"):
        check_plan_budget(p, "5.99")
    # an explicit price table wins over the plan's; a device without a price costs nothing
    assert check_plan_budget(p, 1, prices={"rtx-4090": "0.25"}) == Decimal("1.00")
    assert check_plan_budget(plan(None), 0) == 0


@pytest.mark.parametrize(("granularity_s", "step_s", "checkpoint_s", "mode"), [
    (1, 7.0, 0.0, PricingMode.ON_DEMAND),
    (60, 7.0, 0.0, PricingMode.ON_DEMAND),
    (60, 0.4, 5.0, PricingMode.SPOT),
    (3600, 50.0, 20.0, PricingMode.ON_DEMAND),
    (1, 130.0, 0.0, PricingMode.HOURLY),
])
def test_total_budget_stops_within_one_interval(tmp_path: Path, granularity_s, step_s, checkpoint_s, mode):
    price = Decimal("1.80")  # per device-hour (per hour package)
    interval_s = max(granularity_s, math.ceil(step_s + checkpoint_s))
    # 6.5 intervals' worth of 3 devices: the stop must land in the 6th or 7th interval
    budget = 3 * price * (1 if mode == PricingMode.HOURLY else Decimal(interval_s) / 3600) * Decimal("6.5")
    with Ledger.open(tmp_path / "l.sqlite") as led:
        job = led.start_job("j", budget_total=budget)
        leases = [led.open_lease(job, f"d{i}", "rtx-4090", LeasePricing(mode, price, "USD", granularity_s), at_s=T0)
                  for i in range(3)]
        now, steps = float(T0), 0
        while True:
            now += step_s
            steps += 1
            status = next_interval_exceeds(led, job, int(now), step_s, checkpoint_s)
            assert status is not None
            if status.stop:
                break
            if mode == PricingMode.SPOT and steps % 50 == 0:  # the spot price moves; the projection follows it
                for le in leases:
                    led.set_price(le, price + Decimal(steps % 3) / 10, at_s=int(now))

            assert steps < 10**6
        assert status.spent <= budget  # stopped before exceeding
        # the job finishes its step and checkpoints, then the leases close
        end = int(now + checkpoint_s)
        for le in leases:
            led.close_lease(le, end)
        spent_ticks = led.spent_ticks(job)
        top_price = price_to_micros(price + Decimal("0.2")) if mode == PricingMode.SPOT else price_to_micros(price)
        interval_ticks = 3 * top_price * TICKS_PER_MICRO * (3600 if mode == PricingMode.HOURLY else interval_s)
        budget_ticks = price_to_micros(budget) * TICKS_PER_MICRO
        assert spent_ticks <= budget_ticks + interval_ticks  # never overshoots by more than one interval
        assert spent_ticks <= budget_ticks  # and here, where the projection covers stop + checkpoint, not at all
        assert spent_ticks > budget_ticks - 2 * interval_ticks  # nor stops much too early


def test_no_total_budget_no_projection(tmp_path: Path):
    with Ledger.open(tmp_path / "l.sqlite") as led:
        job = led.start_job("j")
        assert next_interval_exceeds(led, job, T0, 1.0) is None
