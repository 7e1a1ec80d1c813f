"""``starverse bill``: what a job cost, from its per-second ledger, with insurance credits shown apart."""

from __future__ import annotations

import json
import sqlite3
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table


def _when(t: int) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S")


def _line_json(line: Any) -> dict[str, Any]:
    return {"key": line.key, "currency": line.currency, "seconds": line.seconds, "charges": str(line.charges),
            "credits": str(line.credits), "net": str(line.net), "charge_ticks": line.charge_ticks,
            "credit_ticks": line.credit_ticks}


def bill(
    run_dir: Annotated[Path | None, typer.Argument(
        help="Run directory of a job (its ledger.sqlite is read); default: the user ledger "
             "($STARVERSE_LEDGER or ~/.local/share/starverse/ledger.sqlite).", show_default=False)] = None,
    db: Annotated[Path | None, typer.Option("--db", help="Ledger file to read instead of a run directory's.")] = None,
    by: Annotated[str, typer.Option("--by", help="Lines per: job, device, mode (pricing mode) or day (UTC).")] = "job",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
    check: Annotated[bool, typer.Option("--check", help="Verify the ledger's integrity instead of billing "
                                                       "(exit 1 if a charge or lease is inconsistent, 2 if the "
                                                       "file is damaged).")] = False,
    currency: Annotated[str | None, typer.Option("--currency", help="Convert every amount to this currency "
                                                                    "(rounded to 6 places).")] = None,
) -> None:
    """Totals of the per-second charges of a ledger, insurance credits itemised separately.

    The ledger is opened read-only after SQLite's page checks (all of them with --check): a damaged file is one
    error line (exit 2), and nothing is written or removed."""
    from starverse.billing import resolve_ledger_path
    from starverse.errors import BillingError

    if run_dir is not None and db is not None:
        raise BillingError("give either RUN_DIR or --db FILE, not both")
    path = resolve_ledger_path(run_dir, db)
    if path.exists() and not path.is_file():  # a FIFO or a device: SQLite would block on it, or read it forever
        raise BillingError(f"{path}: not a ledger file (a folder, device, FIFO or socket). To fix: pass a run "
                           "directory or --db FILE (a ledger.sqlite)")
    try:
        _bill(path, by, as_json, check, currency)
    except sqlite3.DatabaseError as e:  # damage the page checks did not see, met while reading rows
        raise BillingError(f"{path}: ledger is damaged ({e}); left untouched. To fix: restore it from a backup"
                           ) from None


def _bill(path: Path, by: str, as_json: bool, check: bool, currency: str | None) -> None:
    from starverse.billing import Ledger, check_ledger, make_bill

    with Ledger.open(path, create=False, read_only=True, check="full" if check else "quick") as ledger:
        if check:
            res = check_ledger(ledger)
            if as_json:
                typer.echo(json.dumps({"ledger": str(path), "ok": res.ok, "problems": res.problems,
                                       "jobs": res.num_jobs, "leases": res.num_leases,
                                       "charge_rows": res.num_charges, "payments": res.num_payments}))
            elif res.ok:
                typer.echo(f"{path}: OK ({res.num_jobs} jobs, {res.num_leases} leases, "
                           f"{res.num_charges} charge rows, {res.num_payments} payments; no overlaps, every "
                           "charge matches its lease)")
            else:
                for p in res.problems:
                    typer.echo(f"{path}: {p}", err=True)
            if not res.ok:
                raise typer.Exit(1)
            return
        b = make_bill(ledger, by, currency=currency)
        jobs = {j.id: j.name for j in ledger.jobs()}
    if as_json:
        typer.echo(json.dumps({
            "ledger": str(path), "by": b.by.value,
            "tick": "amounts *_ticks are in 1/3,600,000,000 of the currency unit (exact)",
            "lines": [_line_json(x) for x in b.lines], "totals": [_line_json(x) for x in b.totals],
            "credits": [{"job": jobs.get(c.job_id, str(c.job_id)), "lease": c.lease_id, "kind": c.kind.value,
                         "preemption_event": c.preemption_event, "start": _when(c.start_s), "end": _when(c.end_s),
                         "seconds": c.seconds, "amount": str(c.amount), "ticks": c.ticks} for c in b.credits],
            "open_leases": b.open_leases, "accrued": [_line_json(x) for x in b.accrued],
            "payments": [{"kind": pay.kind, "amount": str(pay.amount), "currency": pay.currency,
                          "at": _when(pay.at_s), "note": pay.note} for pay in b.payments],
        }))
        return
    console = Console(highlight=False, soft_wrap=True)
    table = Table(title=f"Bill by {b.by.value} ({path})", title_justify="left")
    for col, just in ((b.by.value, "left"), ("hours", "right"), ("charges", "right"), ("credits", "right"),
                      ("net", "right"), ("currency", "left")):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    for x in [*b.lines, *b.totals]:
        table.add_row(x.key, f"{x.seconds / 3600:.3f}", str(x.charges), str(x.credits), str(x.net), x.currency,
                      style="bold" if x.key == "total" else None)
    console.print(table)
    if b.credits:
        ct = Table(title="Insurance credits (not netted into charges above)", title_justify="left")
        for col in ("job", "lease", "kind", "from", "to", "seconds", "amount"):
            ct.add_column(col)
        for c in b.credits:
            ct.add_row(jobs.get(c.job_id, str(c.job_id)), str(c.lease_id), c.kind.value, _when(c.start_s),
                       _when(c.end_s), str(c.seconds), str(c.amount))
        console.print(ct)
    if b.payments:
        pt = Table(title="Payments: prepaid credit paid in (not netted into charges above)", title_justify="left")
        for col in ("at", "kind", "amount", "currency", "note"):
            pt.add_column(col)
        for pay in b.payments:
            pt.add_row(_when(pay.at_s), pay.kind, str(pay.amount), pay.currency, pay.note)
        console.print(pt)
    if b.open_leases:
        accrued = ", ".join(f"{x.charges} {x.currency}" for x in b.accrued)
        console.print(f"{b.open_leases} lease(s) still open, accrued {accrued} by their last heartbeat "
                      "(not in the totals until closed)")


def register(app: typer.Typer) -> None:
    """Add this area's commands to ``app``."""
    app.command("bill")(bill)
