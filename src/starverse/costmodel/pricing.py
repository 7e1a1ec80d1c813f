"""Prices for the estimate: the plan's own, else the catalog's cheapest on-demand offer, in USD."""

from __future__ import annotations

from typing import Any


def cheapest_price_per_hour(catalog: Any, acc_id: str, currency: str = "USD") -> float | None:
    """Cheapest on-demand price per device-hour of ``acc_id`` in ``currency`` (None when no offer).

    Uses ``catalog.cheapest_offer``/``catalog.convert`` when the catalog has them (converted to
    ``currency``); a catalog without exchange rates only contributes offers already in ``currency``.
    """
    if catalog is None:
        return None
    cheapest = getattr(catalog, "cheapest_offer", None)
    if cheapest is not None:
        offer = cheapest(acc_id, currency=currency)
        if offer is None:
            return None
        return float(catalog.convert(offer.price_per_hour, offer.currency, currency))
    prices = [o.price_per_hour for o in getattr(catalog, "offers", ()) if o.accelerator == acc_id
              and o.currency.upper() == currency.upper()]
    return min(prices) if prices else None
