"""Money as exact integers, and currency conversion by a rate table.

Amounts are stored as integer *ticks*: one tick is 1/3600 of a millionth of the currency unit. A price per
hour given to the micro-unit (``Decimal("1.234567")`` per hour) then costs exactly ``micros_per_hour`` ticks
per second, so per-second rating never rounds and a bill's total is exactly the sum of its per-second
charges. ``Decimal`` is the API type; floats never touch money.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping
from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation
from pathlib import Path

from starverse.errors import BillingError

MICROS_PER_UNIT = 1_000_000
"""Prices are kept to the micro-unit (1e-6 of a dollar, yuan, ...)."""
TICKS_PER_MICRO = 3600
"""Seconds per hour: a per-hour price in micros is a per-second price in ticks."""
TICKS_PER_UNIT = MICROS_PER_UNIT * TICKS_PER_MICRO
"""Ticks in one currency unit."""

_MICRO = Decimal("0.000001")

# Units of each currency per 1 EUR. Source: ECB euro foreign exchange reference rates, 2024-12-31
# (approximate mid rates; override with $STARVERSE_FX_RATES or `rates=`). Kept small on purpose: it is the
# fallback until `starverse.catalog.convert` is available, and what the tests pin.
FX_SOURCE = "ECB euro foreign exchange reference rates, 2024-12-31 (approximate)"
_RATES_PER_EUR: dict[str, Decimal] = {
    "EUR": Decimal("1"),
    "USD": Decimal("1.0389"),
    "CNY": Decimal("7.5833"),
    "JPY": Decimal("163.06"),
    "GBP": Decimal("0.82918"),
    "HKD": Decimal("8.0686"),
    "SGD": Decimal("1.4164"),
    "KRW": Decimal("1532.15"),
    "INR": Decimal("88.9335"),
    "CHF": Decimal("0.9412"),
    "CAD": Decimal("1.4948"),
    "AUD": Decimal("1.6772"),
}


def to_decimal(value: Decimal | int | float | str, what: str = "amount") -> Decimal:
    """A user-given number as ``Decimal`` (floats via their shortest repr, so ``0.1`` stays 0.1)."""
    if isinstance(value, bool):
        raise BillingError(f"{what}: expected a number, got {value!r}")
    try:
        d = Decimal(repr(value)) if isinstance(value, float) else Decimal(value)
    except (InvalidOperation, TypeError, ValueError):
        raise BillingError(f"{what}: not a number ({value!r})") from None
    if not d.is_finite():
        raise BillingError(f"{what}: must be a finite number (got {value!r})")
    return d


def price_to_micros(price: Decimal | int | float | str, what: str = "price") -> int:
    """A non-negative price as integer micro-units (rounded half-even to 1e-6)."""
    d = to_decimal(price, what)
    if d < 0:
        raise BillingError(f"{what}: must be >= 0 (got {d}); a refund is a credit, not a negative price")
    return int((d / _MICRO).quantize(Decimal(1), rounding=ROUND_HALF_EVEN))


def micros_to_decimal(micros: int) -> Decimal:
    """Integer micro-units back to a ``Decimal`` with 6 places."""
    return (Decimal(micros) * _MICRO).quantize(_MICRO)


def ticks_to_decimal(ticks: int, places: int = 6) -> Decimal:
    """Ticks as a ``Decimal`` rounded half-even to ``places`` decimals (display; sums are done in ticks)."""
    q = Decimal(1).scaleb(-places)
    return (Decimal(ticks) / Decimal(TICKS_PER_UNIT)).quantize(q, rounding=ROUND_HALF_EVEN)


def normalize_currency(code: str, rates: Mapping[str, Decimal] | None = None) -> str:
    """Upper-case ISO code, or ``BillingError`` (with did-you-mean) if neither the catalog's rate table nor
    the local one knows it."""
    table = rates if rates is not None else rate_table()
    norm = str(code).strip().upper()
    if norm in table or (rates is None and _catalog_rate(norm, norm) is not None):
        return norm
    # difflib, not starverse.config: `starverse bill` must not pay for importing pydantic
    close = difflib.get_close_matches(norm, sorted(table), n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise BillingError(
        f"unknown currency {code!r}.{hint} Known: {', '.join(sorted(table))}. "
        "To add one: give its rate under 'currencies:' in a catalog file ($STARVERSE_CATALOG), or its "
        "units per EUR in a JSON file named by $STARVERSE_FX_RATES."
    )


def rate_table() -> dict[str, Decimal]:
    """Units per EUR for each locally known currency: the built-in table, extended by ``$STARVERSE_FX_RATES``."""
    extra = os.environ.get("STARVERSE_FX_RATES", "")
    cached = _table_cache.get(extra)
    if cached is not None:
        return dict(cached)
    table = dict(_RATES_PER_EUR)
    if extra:
        path = Path(extra)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise BillingError(f"{path}: cannot read currency rates ({e.__class__.__name__}); "
                               "expected a JSON object like {\"USD\": 1.0389} (units per EUR)") from None
        if not isinstance(data, dict):
            raise BillingError(f"{path}: expected a JSON object of units per EUR, got {type(data).__name__}")
        for code, value in data.items():
            rate = to_decimal(value, f"{path}: {code}")
            if rate <= 0:
                raise BillingError(f"{path}: {code}: rate must be > 0 (got {rate})")
            table[str(code).upper()] = rate
    _table_cache.clear()
    _table_cache[extra] = table
    return dict(table)


_table_cache: dict[str, dict[str, Decimal]] = {}


def fx_rate(from_ccy: str, to_ccy: str) -> Decimal:
    """Units of ``to_ccy`` per unit of ``from_ccy``.

    The catalog's rate table (``starverse.catalog.convert``) wins when it knows both currencies; the local
    table above covers the rest (and stands alone if the catalog cannot be loaded).
    """
    src = str(from_ccy).strip().upper()
    dst = str(to_ccy).strip().upper()
    if src == dst:
        normalize_currency(src)
        return Decimal(1)
    catalog_rate = _catalog_rate(src, dst)
    if catalog_rate is not None:
        return catalog_rate
    table = rate_table()
    return table[normalize_currency(dst, table)] / table[normalize_currency(src, table)]


def _catalog_rate(src: str, dst: str) -> Decimal | None:
    """The catalog's rate (to 12 significant digits: it computes in float), or ``None`` if it has none.

    Cached per pair and catalog file: opening a lease must not re-read the catalog.
    """
    key = (src, dst, os.environ.get("STARVERSE_CATALOG", ""))
    if key not in _catalog_cache:
        _catalog_cache[key] = _load_catalog_rate(src, dst)
    return _catalog_cache[key]


_catalog_cache: dict[tuple[str, str, str], Decimal | None] = {}


def _load_catalog_rate(src: str, dst: str) -> Decimal | None:
    try:
        from starverse.catalog import convert as catalog_convert
    except ImportError:
        return None
    try:
        value = catalog_convert(1.0, src, dst)
    except Exception:  # unknown to the catalog, or no catalog at all: the local table decides
        return None
    if not isinstance(value, int | float) or not value > 0:
        return None
    return Decimal(f"{value:.12g}")


def convert(amount: Decimal, from_ccy: str, to_ccy: str) -> Decimal:
    """``amount`` in ``from_ccy`` expressed in ``to_ccy`` (not rounded)."""
    return to_decimal(amount) * fx_rate(from_ccy, to_ccy)
