"""Rating: turn a lease (mode, price segments, start, end) into charge rows, and price credit intervals.

Pure functions over integers (seconds, micro-units, ticks; see ``money``), no database. The ledger calls
:func:`rate_lease` once, when a lease closes, and stores the rows; ``bill --check`` calls it again and
compares, which is how a double or torn charge is caught.

Rules:

- ``on-demand`` and ``spot``: per second at the price in force that second; the lease's billed time is
  rounded up to the offer's billing granularity (the extra seconds are a ``rounding`` row at the last
  price). Rows are split at price changes and at UTC midnight, so ``bill --by day`` is exact.
- ``hourly`` / ``daily`` / ``monthly`` packages: the whole package is charged when it is bought, at the
  package price in force then; a lease buys a first package when it opens and another each time one runs
  out. A month is 30 days.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from starverse.billing.money import TICKS_PER_MICRO

DAY_S = 86_400
"""Seconds per (UTC) day: rows are split at multiples of this."""


class PricingMode(StrEnum):
    """How a lease is priced."""

    ON_DEMAND = "on-demand"
    SPOT = "spot"
    HOURLY = "hourly"
    DAILY = "daily"
    MONTHLY = "monthly"

    @property
    def package_s(self) -> int | None:
        """Length of one package in seconds; ``None`` for per-second modes."""
        return _PACKAGE_S.get(self)


_PACKAGE_S = {PricingMode.HOURLY: 3600, PricingMode.DAILY: DAY_S, PricingMode.MONTHLY: 30 * DAY_S}


class ChargeKind(StrEnum):
    """What a charge row is for."""

    USAGE = "usage"
    """Seconds used, at the price in force."""
    ROUNDING = "rounding"
    """Seconds billed because the offer bills in whole intervals (granularity)."""
    PACKAGE = "package"
    """One package, charged whole when bought."""


@dataclass(frozen=True)
class Segment:
    """A price in force from ``start_s`` until the next segment (per hour, or per package for packages)."""

    start_s: int
    price_micros: int


@dataclass(frozen=True)
class ChargeRow:
    """One rated interval of a lease at one price."""

    seq: int
    """Position within the lease (0, 1, ...)."""
    kind: ChargeKind
    start_s: int
    end_s: int
    seconds: int
    """Billed seconds (the package length for packages)."""
    price_micros: int
    """Price per hour (per package for packages), micro-units of the job currency."""
    ticks: int
    """Amount in ticks (1/3600 micro-unit): exactly ``price_micros * seconds`` for per-second modes."""

    @property
    def day(self) -> int:
        """UTC day number (days since 1970-01-01) of the row's start."""
        return self.start_s // DAY_S


def billed_end(start_s: int, end_s: int, granularity_s: int) -> int:
    """End of the billed time: ``end_s`` rounded up to a whole number of ``granularity_s`` after start."""
    dur = end_s - start_s
    if dur <= 0:
        return start_s
    return start_s + -(-dur // granularity_s) * granularity_s


def _price_at(segments: Sequence[Segment], t: int) -> int:
    """The price in force at second ``t`` (segments sorted by start, the first at the lease start)."""
    price = segments[0].price_micros
    for seg in segments:
        if seg.start_s > t:
            break
        price = seg.price_micros
    return price


def _pieces(segments: Sequence[Segment], start_s: int, end_s: int) -> list[tuple[int, int, int]]:
    """``(start, end, price)`` pieces of ``[start_s, end_s)`` split at price changes and UTC midnight.

    ``segments`` are sorted by start; one pass, so a lease with many spot price changes rates in linear time.
    """
    out: list[tuple[int, int, int]] = []
    if end_s <= start_s or not segments:
        return out
    for i, seg in enumerate(segments):
        a = max(start_s, seg.start_s) if i else start_s
        b = min(end_s, segments[i + 1].start_s) if i + 1 < len(segments) else end_s
        if b <= a:
            continue
        t = a
        while t < b:
            nxt = min(b, (t // DAY_S + 1) * DAY_S)
            out.append((t, nxt, seg.price_micros))
            t = nxt
    return out


def rate_lease(
    mode: PricingMode, start_s: int, end_s: int, segments: Sequence[Segment], granularity_s: int = 1
) -> list[ChargeRow]:
    """Charge rows of a closed lease (see the module docstring for the rules)."""
    segs = sorted(segments, key=lambda s: s.start_s)
    package_s = mode.package_s
    if package_s is not None:
        num = max(1, -(-(end_s - start_s) // package_s))
        rows = []
        for k in range(num):
            t = start_s + k * package_s
            price = _price_at(segs, t)
            rows.append(ChargeRow(k, ChargeKind.PACKAGE, t, t + package_s, package_s, price,
                                  price * TICKS_PER_MICRO))
        return rows
    rows = []
    for a, b, price in _pieces(segs, start_s, end_s):
        rows.append(ChargeRow(len(rows), ChargeKind.USAGE, a, b, b - a, price, price * (b - a)))
    last = _price_at(segs, max(start_s, end_s - 1))
    for a, b, _ in _pieces([Segment(end_s, last)], end_s, billed_end(start_s, end_s, granularity_s)):
        rows.append(ChargeRow(len(rows), ChargeKind.ROUNDING, a, b, b - a, last, last * (b - a)))
    return rows


def accrued_ticks(
    mode: PricingMode, start_s: int, now_s: int, segments: Sequence[Segment], granularity_s: int = 1
) -> int:
    """What an open lease has cost by ``now_s``: as if it closed then (packages bought so far count whole)."""
    segs = sorted(segments, key=lambda s: s.start_s)
    package_s = mode.package_s
    if package_s is not None:
        num = (max(now_s, start_s) - start_s) // package_s + 1
        return sum(_price_at(segs, start_s + k * package_s) for k in range(num)) * TICKS_PER_MICRO
    return sum(r.ticks for r in rate_lease(mode, start_s, max(now_s, start_s), segs, granularity_s))


def interval_ticks(
    mode: PricingMode, start_s: int, end_s: int | None, segments: Sequence[Segment], a: int, b: int
) -> int:
    """Cost of the lease's seconds inside ``[a, b)`` (for credits): per second at the price in force;
    packages pro rata (rounded down, so a credit never exceeds what was charged)."""
    lo = max(a, start_s)
    hi = b if end_s is None else min(b, end_s)
    if hi <= lo:
        return 0
    segs = sorted(segments, key=lambda s: s.start_s)
    package_s = mode.package_s
    total = 0
    for x, y, price in _pieces(segs, lo, hi):
        if package_s is None:
            total += price * (y - x)
        else:
            total += price * TICKS_PER_MICRO * (y - x) // package_s
    return total


def hourly_rate_micros(mode: PricingMode, price_micros: int) -> int:
    """Cost per hour of a lease at ``price_micros`` (packages spread over their length, rounded up)."""
    package_s = mode.package_s
    if package_s is None:
        return price_micros
    return -(-price_micros * 3600 // package_s)
