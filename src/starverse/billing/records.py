"""The ledger's value types: a lease's pricing, and the jobs, leases and payments read back from the file.

Frozen dataclasses, plus how a row of the ``jobs`` / ``leases`` table becomes one (``to_job``, ``to_lease``, with
the column lists they expect). Pure Python: :mod:`starverse.billing.ledger` writes and reads them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Literal

from starverse.billing.money import micros_to_decimal, price_to_micros, to_decimal
from starverse.billing.rating import PricingMode
from starverse.errors import BillingError


@dataclass(frozen=True)
class LeasePricing:
    """How a lease is priced: mode, price (per hour, or per package), currency, billing granularity."""

    mode: PricingMode
    """on-demand, spot (per second), or an hourly/daily/monthly package (charged whole when bought)."""
    price: Decimal
    """Per device-hour for on-demand/spot; per package for packages."""
    currency: str = "USD"
    """ISO code of ``price``."""
    granularity_s: int = 1
    """The offer bills in whole multiples of this many seconds (1 = per second)."""

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "mode", PricingMode(self.mode))
        except ValueError:
            known = ", ".join(m.value for m in PricingMode)
            raise BillingError(f"pricing mode {self.mode!r} is unknown; use one of {known}") from None
        object.__setattr__(self, "price", to_decimal(self.price, "price"))
        price_to_micros(self.price, "price")  # rejects a negative price here, before anything is written
        if not isinstance(self.granularity_s, int) or self.granularity_s < 1:
            raise BillingError(f"granularity_s: must be a whole number of seconds >= 1 (got {self.granularity_s!r})")

    @classmethod
    def free(cls) -> LeasePricing:
        """A device that costs nothing (the user's own machine)."""
        return cls(PricingMode.ON_DEMAND, Decimal(0))

    @classmethod
    def from_offer(cls, offer: Any, *, spot: bool = False) -> LeasePricing:
        """Pricing of a catalog/pool offer (``price_per_hour``, ``spot_price_per_hour``, ``currency``,
        ``billing_granularity_s``); ``spot=True`` uses the spot price."""
        price = offer.spot_price_per_hour if spot else offer.price_per_hour
        if price is None:
            raise BillingError(f"offer {getattr(offer, 'provider', '?')}/{getattr(offer, 'accelerator', '?')} "
                               "has no spot price; lease it on-demand or add spot_price_per_hour")
        return cls(PricingMode.SPOT if spot else PricingMode.ON_DEMAND, to_decimal(price),
                   getattr(offer, "currency", "USD"), int(getattr(offer, "billing_granularity_s", 1) or 1))


@dataclass(frozen=True)
class Job:
    """A training job: all its leases are charged in ``currency``."""

    id: int
    name: str
    currency: str
    budget_total: Decimal | None
    max_budget_per_hour: Decimal | None
    run_dir: str | None
    created_s: int


PaymentKind = Literal["signup", "topup"]


@dataclass(frozen=True)
class Payment:
    """Prepaid money paid in: a sign-up credit or a top-up."""

    id: int
    kind: PaymentKind
    currency: str
    amount_micros: int
    at_s: int
    ref: str | None
    """Idempotency key: a payment with a ref already recorded is not recorded again."""
    note: str

    @property
    def amount(self) -> Decimal:
        """The amount, 6 places."""
        return micros_to_decimal(self.amount_micros)


@dataclass(frozen=True)
class Lease:
    """One device rented for one interval (``end_s`` is ``None`` while open)."""

    id: int
    job_id: int
    device: str
    accelerator: str
    provider: str
    offer: str | None
    mode: PricingMode
    offer_price: Decimal
    """Price as offered (per hour or per package), in ``offer_currency``."""
    offer_currency: str
    fx_rate: Decimal
    """Job currency per unit of the offer currency, fixed when the lease opened."""
    granularity_s: int
    start_s: int
    end_s: int | None
    last_seen_s: int
    """Last heartbeat: where :meth:`Ledger.recover` closes the lease if its process died."""


JOB_COLS = "id, name, currency, budget_total_micros, max_per_hour_micros, run_dir, created_s"
LEASE_COLS = ("id, job_id, device, accelerator, provider, offer, mode, offer_price_micros, offer_currency, "
              "fx_rate, granularity_s, start_s, end_s, last_seen_s")


def to_job(row: Sequence[Any]) -> Job:
    """A ``jobs`` row (columns ``JOB_COLS``) as a :class:`Job`."""
    return Job(row[0], row[1], row[2], None if row[3] is None else micros_to_decimal(row[3]),
               None if row[4] is None else micros_to_decimal(row[4]), row[5], row[6])


def to_lease(row: Sequence[Any]) -> Lease:
    """A ``leases`` row (columns ``LEASE_COLS``) as a :class:`Lease`."""
    return Lease(row[0], row[1], row[2], row[3], row[4], row[5], PricingMode(row[6]), micros_to_decimal(row[7]),
                 row[8], Decimal(row[9]), row[10], row[11], row[12], row[13])


def id_of(obj: Job | Lease | int) -> int:
    """The id of a job or lease given as a value or as its id."""
    return obj if isinstance(obj, int) else obj.id
