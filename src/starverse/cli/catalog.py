"""``starverse catalog``: the accelerators (datasheet or measured figures) and the offers to rent them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table


def _console() -> Console:
    # piped output (tests, `| less`) would otherwise be squeezed to 80 columns and wrap the ids
    console = Console(highlight=False, soft_wrap=False)
    if not console.is_terminal:
        console = Console(highlight=False, width=200)
    return console


def _price(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def catalog(
    catalog_file: Annotated[
        Path | None,
        typer.Option(
            "--catalog",
            help="A catalog YAML file that extends or overrides the bundled one (also $STARVERSE_CATALOG).",
            show_default=False,
        ),
    ] = None,
    profile: Annotated[
        Path | None,
        typer.Option(
            "--profile",
            help="Probe profile JSON with measured figures (default: $STARVERSE_PROFILE, else "
            "~/.cache/starverse/profile.json if present).",
            show_default=False,
        ),
    ] = None,
    prices: Annotated[bool, typer.Option("--prices", help="List every offer instead of the accelerators.")] = False,
    currency: Annotated[
        str, typer.Option("--currency", help="Currency of the cheapest-price columns (ISO code).")
    ] = "USD",
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object: accelerators, offers and currencies.")
    ] = False,
) -> None:
    """Accelerators with their dense peaks, memory, links and power, and the cheapest offer of each."""
    from starverse.catalog import load_catalog

    cat = load_catalog(catalog_file, profile)
    currency = currency.upper()
    cat.convert(1.0, currency, currency)  # unknown --currency: fail before printing anything

    def cheapest(acc_id: str, spot: bool) -> tuple[float | None, Any]:
        offer = cat.cheapest_offer(acc_id, spot=spot, currency=currency)
        if offer is None:
            return None, None
        price = offer.spot_price_per_hour if spot else offer.price_per_hour
        if price is None:
            return None, None
        return cat.convert(price, offer.currency, currency), offer

    if as_json:
        accs = []
        for acc in cat.accelerators.values():
            d = acc.to_dict()
            for spot in (False, True):
                value, offer = cheapest(acc.id, spot)
                key = "cheapest_spot" if spot else "cheapest_on_demand"
                d[key] = None if offer is None else {
                    "price_per_hour": value, "currency": currency, "provider": offer.provider,
                }
            accs.append(d)
        out = {
            "accelerators": accs,
            "offers": [{**dataclasses.asdict(o), "billing_unit": o.billing_unit,
                        "price_per_unit": o.price_per_unit()} for o in cat.offers],
            "currencies": {c.code: dataclasses.asdict(c) for c in cat.currencies.values()},
        }
        typer.echo(json.dumps(out, indent=1))
        return

    console = _console()
    if prices:
        table = Table(title="Offers (per device and billing unit: packages billed by the day or month are shown "
                      "per day or month, never as hourly prices)", title_justify="left")
        for col, just in (
            ("accelerator", "left"), ("provider", "left"), ("on-demand", "right"), ("spot", "right"),
            ("currency", "left"), ("per", "left"), ("billed per", "right"), ("as of", "left"), ("source", "left"),
        ):
            table.add_column(col, justify=just, overflow="fold")  # type: ignore[arg-type]
        for o in sorted(cat.offers, key=lambda o: (o.accelerator, o.provider)):
            table.add_row(
                o.accelerator, o.provider + (f" ({o.region})" if o.region else ""),
                _price(o.price_per_unit(), 4 if o.hourly else 2), _price(o.price_per_unit(spot=True), 4),
                o.currency, o.billing_unit, f"{o.billing_granularity_s} s", o.as_of, o.source,
            )
        console.print(table)
        return

    table = Table(title=f"Accelerators (dense peaks; cheapest offer rentable by the hour, per device-hour in "
                        f"{currency})",
                  title_justify="left")
    for col, just in (
        ("id", "left"), ("vendor", "left"), ("bf16 TF", "right"), ("mem GB", "right"), ("mem GB/s", "right"),
        ("link", "left"), ("link GB/s", "right"), ("TDP W", "right"), ("stack", "left"),
        ("on-demand", "right"), ("spot", "right"),
    ):
        table.add_column(col, justify=just, no_wrap=True)  # type: ignore[arg-type]
    for acc in cat.accelerators.values():
        od, _ = cheapest(acc.id, False)
        sp, _ = cheapest(acc.id, True)
        measured = any(s.startswith("measured") for s in acc.sources.values())
        table.add_row(
            acc.id + (" *" if measured else ""), acc.vendor, f"{acc.bf16_tflops:g}", f"{acc.memory_gb:g}",
            f"{acc.memory_bw_gb_per_s:g}", acc.intra_node_link, f"{acc.intra_node_gb_per_s:g}", f"{acc.tdp_w:g}",
            acc.stack, _price(od), _price(sp),
        )
    console.print(table)
    if any(s.startswith("measured") for a in cat.accelerators.values() for s in a.sources.values()):
        console.print("* figures measured by `starverse probe` (profile applied)")
    console.print("Sources of every figure: `starverse catalog --json`; offers: `starverse catalog --prices`.")


def register(app: typer.Typer) -> None:
    """Add this area's commands to ``app``."""
    app.command("catalog")(catalog)
