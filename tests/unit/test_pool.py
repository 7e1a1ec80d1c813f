"""pool.yaml and job.yaml: schemas, catalog checks, currency conversion, one-line errors."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from starverse.catalog import convert, load_catalog
from starverse.errors import ConfigError
from starverse.planner import Objective, Pricing, load_job, load_pool


@pytest.fixture(scope="module")
def catalog():
    return load_catalog(profile="")


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def test_pool_resolves_prices_and_defaults(tmp_path, catalog):
    p = write(tmp_path, "pool.yaml", """\
        currency: USD
        offers:
          - {accelerator: rtx-4090, count: 16, price_per_hour: 1.2, spot_price_per_hour: 0.5, currency: CNY,
             pricing: spot, interruptions_per_hour: 0.5}
          - {accelerator: a100-80gb-sxm, count: 8}
        cross_offer_gbps: 50
        """)
    pool = load_pool(p, catalog)
    spot, a100 = pool.offers
    assert spot.pricing == Pricing.SPOT
    # the spot price is the one paid, converted from CNY to the pool currency
    assert spot.price_per_hour == pytest.approx(convert(0.5, "CNY", "USD"))
    assert spot.interruptions_per_hour == 0.5
    assert spot.devices_per_node == catalog.accelerator("rtx-4090").devices_per_node
    # no price given: the catalog's cheapest on-demand offer rentable by the hour (in USD); the brief's
    # monthly package (110,000 USD/month over 128 devices = 1.18/h) is not an hourly price
    hourly = [o for o in catalog.offers if o.accelerator == "a100-80gb-sxm" and o.billing_granularity_s <= 3600]
    cheapest = min(hourly, key=lambda o: convert(o.price_per_hour, o.currency, "USD"))
    assert a100.price_per_hour == pytest.approx(convert(cheapest.price_per_hour, cheapest.currency, "USD"))
    assert any(o.accelerator == "a100-80gb-sxm" and o.price_per_hour < a100.price_per_hour
               for o in catalog.offers)  # a cheaper monthly figure exists and is not taken
    assert a100.price_source.startswith(f"catalog: {cheapest.provider}, {cheapest.as_of}")
    assert a100.billing_granularity_s == cheapest.billing_granularity_s
    assert a100.memory_gb == catalog.accelerator("a100-80gb-sxm").memory_gb
    assert pool.cross_offer_gbps == 50
    assert pool.num_devices == 24


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("offers:\n  - {accelerator: rtx-4090, count: 0, price_per_hour: 1}\n",
         "pool.yaml:2: offers[0].count: must be greater than 0 (got 0)"),
        ("offers: []\n", "pool.yaml:1: offers: List should have at least 1 item"),
        ("offers:\n  - {accelerator: rtx-4909, count: 2, price_per_hour: 1}\n",
         "pool.yaml:2: offers[0].accelerator: unknown accelerator 'rtx-4909'"),
        ("offers:\n  - {accelerator: rtx-4090, count: 2, price_per_hour: -1}\n",
         "pool.yaml:2: offers[0].price_per_hour: must be greater than or equal to 0 (got -1)"),
        ("offers:\n  - {accelerator: rtx-4090, count: 2, price_per_hour: 0}\n",
         "pool.yaml:2: offers[0]: price_per_hour is 0 but the offer is not owned; rented devices have a price. "
         "For devices you own, add owned: true"),
        ("offers:\n  - {accelerator: rtx-4090, count: 2, owned: true, pricing: spot, spot_price_per_hour: 1}\n",
         "pool.yaml:2: offers[0]: an owned offer cannot be priced as spot"),
        ("offers:\n  - {accelerator: rtx-4090, count: 2, price_per_hour: 1, interruptions_per_hour: 0.2}\n",
         "interruptions_per_hour is set but pricing is 'on-demand'"),
        ("offers:\n  - {accelerator: rtx-4090, count: 2, price_per_hour: 1, pricng: spot}\n",
         "pool.yaml:2: offers[0].pricng: unknown field; did you mean 'pricing'?"),
        ("currency: XYZ\noffers:\n  - {accelerator: rtx-4090, count: 2, price_per_hour: 1}\n",
         "pool.yaml:1: currency:"),
        ("offers:\n  - {accelerator: rtx-4090, count: 2, price_per_hour: 1}\n"
         "  - {accelerator: rtx-4090, count: 4, price_per_hour: 2}\n",
         "pool.yaml:3: offers[1].accelerator: two offers are called 'rtx-4090'. To fix: give each a distinct `name:`"),
        ("offers:\n  - {accelerator: rtx-4090, count: 2, price_per_hour: 1, currency: XXX}\n",
         "pool.yaml:2: offers[0].currency:"),
        ("offers:\n  - {accelerator: rtx-3090, count: 2, price_per_hour: 1, collective_gb_per_s: {2: 0}}\n",
         "pool.yaml:2: offers[0].collective_gb_per_s: 2: 0 GB/s; give the measured all-reduce bus bandwidth"),
        ("offers:\n  - {accelerator: tpu-v6e, count: 2, pricing: spot}\n",
         "no spot_price_per_hour given and the catalog has no spot price for 'tpu-v6e'"),
    ],
)
def test_pool_errors(tmp_path, catalog, body, message):
    p = write(tmp_path, "pool.yaml", body)
    with pytest.raises(ConfigError) as e:
        load_pool(p, catalog)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_unknown_accelerator_did_you_mean(tmp_path, catalog):
    p = write(tmp_path, "pool.yaml", "offers:\n  - {accelerator: rtx-4909, count: 2, price_per_hour: 1}\n")
    with pytest.raises(ConfigError, match="rtx-4090"):
        load_pool(p, catalog)


def test_job_defaults_and_tokens(tmp_path):
    p = write(tmp_path, "job.yaml", """\
        model: llama-2-7b
        train: {seq_len: 2048, global_batch: 64, steps: 100}
        """)
    job = load_job(p)
    assert job.objective == Objective.COST_PERFORMANCE
    assert job.train.total_tokens == 100 * 64 * 2048
    assert job.search.max_groups == 3


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("model: x\ntrain: {seq_len: 2048, global_batch: 64}\nobjective: time\n",
         "job.yaml:3: objective: objective 'time' needs the length of the job; add train.tokens"),
        ("model: x\ntrain: {seq_len: 2048, global_batch: 64}\nconstraints: {deadline_hours: 10}\n",
         "constraints.deadline_hours needs the length of the job"),
        ("model: x\ntrain: {seq_len: 2048, global_batch: 64, tokens: 1e9, steps: 10}\n",
         "give either tokens or steps, not both"),
        ("model: x\ntrain: {seq_len: 2048, global_batch: 64}\nobjective: cheapest\n",
         "job.yaml:3: objective: must be 'cost-performance', 'throughput', 'cost' or 'time'"),
        ("model: x\ntrain: {seq_len: 2048, global_batch: 0}\n",
         "job.yaml:2: train.global_batch: must be greater than 0 (got 0)"),
        ("model: x\ntrain: {seq_len: 2048, global_batch: 8}\nconstraints: {max_budget_per_hour: -5}\n",
         "job.yaml:3: constraints.max_budget_per_hour: must be greater than 0 (got -5)"),
        ("model: x\ntrain: {seq_len: 2048, global_batch: 8}\nconstraints: {max_budget: 5}\n",
         "job.yaml:3: constraints.max_budget: unknown field; did you mean 'max_budget_per_hour'?"),
    ],
)
def test_job_errors(tmp_path, body, message):
    p = write(tmp_path, "job.yaml", body)
    with pytest.raises(ConfigError) as e:
        load_job(p)
    assert message in str(e.value)
