"""Prices that make sense, over the whole bundled catalog: spot never above on-demand, packages billed by the
day or month never compared with (or shown as) hourly prices, every price with its source and date."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from starverse.catalog import Catalog, load_catalog
from starverse.catalog.core import HOUR_S
from starverse.cli import app


@pytest.fixture(scope="module")
def cat() -> Catalog:
    return load_catalog(profile="")


def test_every_price_has_source_date_and_a_sane_spot(cat: Catalog) -> None:
    for o in cat.offers:
        assert o.source.strip() and re.fullmatch(r"\d{4}(-\d{2}){0,2}", o.as_of), o
        assert o.spot_price_per_hour is None or o.spot_price_per_hour <= o.price_per_hour, o


def test_cheapest_compares_like_with_like(cat: Catalog) -> None:
    """The cheapest hourly offer is the minimum over hourly offers only (converted to one currency), and the
    cheapest hourly spot price is never above the cheapest hourly on-demand one."""
    packages = 0
    for acc in cat.accelerators:
        offers = cat.offers_for(acc)
        packages += sum(not o.hourly for o in offers)
        for spot in (False, True):
            best = cat.cheapest_offer(acc, spot=spot)
            priced = [o for o in offers if (o.spot_price_per_hour if spot else o.price_per_hour) is not None]
            hourly = [o for o in priced if o.billing_granularity_s <= HOUR_S]
            if not hourly:
                assert best is None
                continue
            assert best is not None and best.hourly

            def usd(o, spot=spot):
                return cat.convert(o.spot_price_per_hour if spot else o.price_per_hour, o.currency, "USD")

            assert usd(best) == min(usd(o) for o in hourly)
        od, sp = cat.cheapest_offer(acc), cat.cheapest_offer(acc, spot=True)
        if od is not None and sp is not None:
            assert (cat.convert(sp.spot_price_per_hour, sp.currency, "USD")
                    <= cat.convert(od.price_per_hour, od.currency, "USD")), acc
    assert packages >= 5  # the brief's monthly and daily packages and AWS capacity blocks are in the catalog


def test_monthly_package_is_shown_per_month() -> None:
    """`catalog --prices` shows the brief's 18,000 USD/month for 160 RTX 4090 as 112.50 per device-month, and
    `--json` names each offer's billing unit."""
    runner = CliRunner()
    out = runner.invoke(app, ["catalog", "--prices"], env={"COLUMNS": "400"})
    assert out.exit_code == 0, out.output
    (row,) = [ln for ln in out.output.splitlines() if "scenario 2, monthly" in ln and "rtx-4090" in ln]
    assert re.search(r"│\s*112\.49\s*│.*│\s*month\s*│", row), row
    doc = json.loads(runner.invoke(app, ["catalog", "--json"]).output)
    units = {(o["provider"], o["accelerator"]): o["billing_unit"] for o in doc["offers"]}
    assert units[("product brief (scenario 2, monthly)", "rtx-4090")] == "month"
    assert units[("product brief (scenario 3)", "rtx-4090")] == "day"
    assert units[("GCP", "h100-80gb-sxm")] == "hour"
