"""Rating: per-second charges are exact, spot segments, granularity, UTC days, packages, credits' pricing."""

from __future__ import annotations

import itertools
import random
from decimal import Decimal
from fractions import Fraction

import pytest

from starverse.billing.money import TICKS_PER_UNIT, price_to_micros, ticks_to_decimal
from starverse.billing.rating import (
    DAY_S,
    ChargeKind,
    PricingMode,
    Segment,
    accrued_ticks,
    billed_end,
    hourly_rate_micros,
    interval_ticks,
    rate_lease,
)
from starverse.errors import BillingError

T0 = 1_700_000_000  # 2023-11-14 22:13:20 UTC


def per_second_total(segments: list[Segment], start: int, end: int) -> Fraction:
    """Reference: add up one exact charge per second at the price in force (price per hour / 3600)."""
    total = Fraction(0)
    for t in range(start, end):
        price = [s for s in segments if s.start_s <= t][-1].price_micros
        total += Fraction(price, 1_000_000 * 3600)
    return total


def test_on_demand_is_price_times_seconds_exactly():
    rows = rate_lease(PricingMode.ON_DEMAND, T0, T0 + 1000, [Segment(T0, price_to_micros("2.5"))])
    assert [(r.kind, r.seconds) for r in rows] == [(ChargeKind.USAGE, 1000)]
    assert rows[0].ticks == 2_500_000 * 1000
    # 2.5/h for 1000 s = 0.69444...: exact in ticks, rounded only for display
    assert Decimal(rows[0].ticks) / TICKS_PER_UNIT == Decimal("2.5") * 1000 / 3600
    assert ticks_to_decimal(rows[0].ticks) == Decimal("0.694444")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_total_equals_sum_of_per_second_charges_with_spot_changes(seed):
    rng = random.Random(seed)
    start, end = T0, T0 + 5000
    segs = [Segment(start, rng.randrange(0, 5_000_000))]
    for t in sorted(rng.sample(range(start + 1, end), 12)):
        segs.append(Segment(t, rng.randrange(0, 5_000_000)))
    rows = rate_lease(PricingMode.SPOT, start, end, segs)
    assert sum(r.seconds for r in rows) == 5000
    assert Fraction(sum(r.ticks for r in rows), TICKS_PER_UNIT) == per_second_total(segs, start, end)
    # rows are contiguous, in order, each at the price in force at its start
    assert all(a.end_s == b.start_s for a, b in itertools.pairwise(rows))
    for r in rows:
        assert r.price_micros == [s for s in segs if s.start_s <= r.start_s][-1].price_micros


def test_granularity_rounds_up_at_the_last_price():
    segs = [Segment(T0, 3_600_000), Segment(T0 + 30, 7_200_000)]
    rows = rate_lease(PricingMode.SPOT, T0, T0 + 61, segs, granularity_s=60)
    assert [(r.kind, r.seconds, r.price_micros) for r in rows] == [
        (ChargeKind.USAGE, 30, 3_600_000), (ChargeKind.USAGE, 31, 7_200_000), (ChargeKind.ROUNDING, 59, 7_200_000)]
    assert billed_end(T0, T0 + 61, 60) == T0 + 120
    assert billed_end(T0, T0 + 60, 60) == T0 + 60
    assert rate_lease(PricingMode.ON_DEMAND, T0, T0, [Segment(T0, 1)], 60) == []


def test_rows_split_at_utc_midnight():
    midnight = (T0 // DAY_S + 1) * DAY_S
    rows = rate_lease(PricingMode.ON_DEMAND, midnight - 100, midnight + 50, [Segment(midnight - 100, 3_600_000)])
    assert [(r.start_s, r.end_s, r.day) for r in rows] == [
        (midnight - 100, midnight, midnight // DAY_S - 1), (midnight, midnight + 50, midnight // DAY_S)]
    assert sum(r.ticks for r in rows) == 3_600_000 * 150


def test_packages_charged_whole_when_bought_at_the_price_then():
    # daily package 20.00, price changes to 18.00 after the first day: 25 h buys two packages
    segs = [Segment(T0, 20_000_000), Segment(T0 + 3600, 18_000_000)]
    rows = rate_lease(PricingMode.DAILY, T0, T0 + 25 * 3600, segs)
    assert [(r.kind, r.start_s, r.seconds, r.price_micros) for r in rows] == [
        (ChargeKind.PACKAGE, T0, DAY_S, 20_000_000), (ChargeKind.PACKAGE, T0 + DAY_S, DAY_S, 18_000_000)]
    assert ticks_to_decimal(sum(r.ticks for r in rows)) == Decimal("38")
    # a package is paid when bought: one second in, the whole first day is spent
    assert accrued_ticks(PricingMode.DAILY, T0, T0 + 1, segs) == 20_000_000 * 3600
    assert accrued_ticks(PricingMode.DAILY, T0, T0 + DAY_S, segs) == 38_000_000 * 3600
    assert len(rate_lease(PricingMode.MONTHLY, T0, T0 + 31 * DAY_S, [Segment(T0, 1)])) == 2
    assert len(rate_lease(PricingMode.HOURLY, T0, T0 + 1, [Segment(T0, 1)])) == 1


def test_accrued_matches_rating_for_per_second_modes():
    segs = [Segment(T0, 1_000_000), Segment(T0 + 100, 2_000_000)]
    assert accrued_ticks(PricingMode.SPOT, T0, T0 + 250, segs, 60) == sum(
        r.ticks for r in rate_lease(PricingMode.SPOT, T0, T0 + 250, segs, 60))
    assert accrued_ticks(PricingMode.SPOT, T0, T0 + 250, segs, 60) == 1_000_000 * 100 + 2_000_000 * 200


def test_interval_cost_and_hourly_rate():
    segs = [Segment(T0, 3_600_000)]
    assert interval_ticks(PricingMode.ON_DEMAND, T0, T0 + 100, segs, T0 - 50, T0 + 10) == 3_600_000 * 10
    assert interval_ticks(PricingMode.ON_DEMAND, T0, None, segs, T0 + 10, T0 + 20) == 3_600_000 * 10
    assert interval_ticks(PricingMode.ON_DEMAND, T0, T0 + 5, segs, T0 + 10, T0 + 20) == 0
    # a daily package of 86.4 credits pro rata: 1/864 of it for 100 s
    assert interval_ticks(PricingMode.DAILY, T0, None, [Segment(T0, 86_400_000)], T0, T0 + 100) == \
        86_400_000 * 3600 * 100 // DAY_S
    assert hourly_rate_micros(PricingMode.DAILY, 24_000_000) == 1_000_000
    assert hourly_rate_micros(PricingMode.SPOT, 123) == 123


def test_negative_price_is_refused():
    with pytest.raises(BillingError, match=r"price: must be >= 0 \(got -1\)"):
        price_to_micros("-1")
    with pytest.raises(BillingError, match="not a number"):
        price_to_micros("abc")
