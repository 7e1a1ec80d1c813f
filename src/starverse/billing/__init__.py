"""Billing: the per-second ledger (SQLite, WAL), rating, budgets and insurance credits.

Pure Python and SQLite; never imports torch. The runtime glue (:class:`BillingCallback`, a
``starverse.runtime.callbacks.Callback``) lives in ``starverse.metrics.callbacks`` because callbacks import
torch; it is re-exported here lazily, so ``import starverse.billing`` stays torch-free.
"""

from __future__ import annotations

from typing import Any

from starverse.billing.budget import (
    BudgetStatus,
    check_plan_budget,
    next_interval_exceeds,
    plan_cost_per_hour,
)
from starverse.billing.insurance import Credit, CreditKind, Event, EventKind
from starverse.billing.ledger import LEDGER_FILE, Job, Lease, LeasePricing, Ledger
from starverse.billing.money import convert, fx_rate, ticks_to_decimal
from starverse.billing.rating import ChargeKind, ChargeRow, PricingMode, Segment, rate_lease
from starverse.billing.report import (
    Bill,
    BillLine,
    CheckResult,
    GroupBy,
    check_ledger,
    make_bill,
    resolve_ledger_path,
)
from starverse.billing.schema import MIGRATIONS, SCHEMA_VERSION

__all__ = [
    "LEDGER_FILE",
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "Bill",
    "BillLine",
    "BudgetStatus",
    "ChargeKind",
    "ChargeRow",
    "CheckResult",
    "Credit",
    "CreditKind",
    "Event",
    "EventKind",
    "GroupBy",
    "Job",
    "Lease",
    "LeasePricing",
    "Ledger",
    "PricingMode",
    "Segment",
    "check_ledger",
    "check_plan_budget",
    "convert",
    "fx_rate",
    "make_bill",
    "next_interval_exceeds",
    "plan_cost_per_hour",
    "rate_lease",
    "resolve_ledger_path",
    "ticks_to_decimal",
]


def __getattr__(name: str) -> Any:
    if name == "BillingCallback":
        from starverse.metrics.callbacks import BillingCallback

        return BillingCallback
    raise AttributeError(f"module 'starverse.billing' has no attribute {name!r}")
