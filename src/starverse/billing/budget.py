"""Budgets: a cap per hour (refuses plans and leases above it) and a total cap (stop before exceeding it).

The per-hour cap is checked when a plan is accepted (:func:`check_plan_budget`) and again by the ledger at
every ``open_lease``. The total cap is enforced at step boundaries by :func:`next_interval_exceeds`: the
job stops when what it will have spent by the end of the next interval (the longer of one billing interval
and one step plus a checkpoint) would be above the budget; so the spend when it stops is at most the budget
plus one interval, and usually below the budget.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import TYPE_CHECKING

from starverse.billing.ledger import Job, Ledger
from starverse.billing.money import TICKS_PER_MICRO, fx_rate, price_to_micros, ticks_to_decimal, to_decimal
from starverse.errors import BudgetExceededError

if TYPE_CHECKING:
    from starverse.plan import Plan


def plan_cost_per_hour(plan: Plan, currency: str = "USD",
                       prices: Mapping[str, Decimal | float | str] | None = None,
                       prices_currency: str | None = None) -> Decimal:
    """What the plan's devices cost per hour in ``currency``: ``prices`` (per device-hour by accelerator
    id, in ``prices_currency``) else the plan's own ``pricing``; an accelerator without a price costs 0."""
    if prices is None:
        prices = dict(plan.pricing.price_per_hour) if plan.pricing is not None else {}
        prices_currency = plan.pricing.currency if plan.pricing is not None else currency
    rate = fx_rate(prices_currency or currency, currency)
    devices: dict[str, int] = {}
    for g in plan.groups:
        for s in g.stages:
            devices[s.accelerator] = devices.get(s.accelerator, 0) + g.replicas * s.tp * s.repeat
    total = Decimal(0)
    for acc, n in devices.items():
        price = to_decimal(prices.get(acc, 0), f"price_per_hour[{acc}]")
        price_to_micros(price, f"price_per_hour[{acc}]")  # refuses a negative price
        total += price * n
    return total * rate


def check_plan_budget(plan: Plan, max_budget_per_hour: Decimal | float | str, currency: str = "USD",
                      prices: Mapping[str, Decimal | float | str] | None = None,
                      prices_currency: str | None = None) -> Decimal:
    """The plan's cost per hour, or ``BudgetExceededError`` if it is above ``max_budget_per_hour``."""
    cap = to_decimal(max_budget_per_hour, "max_budget_per_hour")
    cost = plan_cost_per_hour(plan, currency, prices, prices_currency)
    if cost > cap:
        raise BudgetExceededError(
            f"plan refused: its {plan.num_devices} devices cost {cost.quantize(Decimal('0.01'))} {currency}/h, "
            f"above max_budget_per_hour {cap} {currency}. To fix: raise the budget, or plan on fewer or "
            "cheaper devices (spot)")
    return cost


@dataclass(frozen=True)
class BudgetStatus:
    """Where a job stands against its total budget."""

    spent: Decimal
    """Charged and accrued so far (job currency)."""
    projected: Decimal
    """What will have been spent at the end of the next interval."""
    budget: Decimal
    horizon_s: int
    """Length of the next interval."""

    @property
    def stop(self) -> bool:
        """True when the next interval would exceed the budget: stop now."""
        return self.projected > self.budget


def next_interval_exceeds(ledger: Ledger, job: Job, now_s: int, step_s: float,
                          checkpoint_s: float = 0.0) -> BudgetStatus | None:
    """Project the job's spend one interval ahead (``None`` if it has no total budget).

    The interval is the longest billing granularity among its open leases, or one step plus a
    checkpoint if that is longer: a stop decided now takes effect after the current step and a checkpoint.
    """
    j = ledger.job(job.id)
    if j.budget_total is None:
        return None
    grans = [le.granularity_s for le in ledger.leases(j.id, open_only=True)]
    horizon = max([1, *grans, int(-(-(step_s + checkpoint_s) // 1))])
    spent = ledger.spent_ticks(j.id, at_s=now_s)
    projected = ledger.spent_ticks(j.id, at_s=now_s + horizon)
    budget_ticks = price_to_micros(j.budget_total) * TICKS_PER_MICRO
    return BudgetStatus(ticks_to_decimal(spent), ticks_to_decimal(projected),
                        ticks_to_decimal(budget_ticks), horizon)
