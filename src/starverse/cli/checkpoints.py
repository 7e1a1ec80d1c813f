"""``starverse checkpoints list RUN_DIR`` (snapshots) and ``starverse train JOB.yaml`` (supervised training).

torch is imported inside ``train`` only: listing checkpoints starts fast.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from starverse.jobs.ledger import JobBill

checkpoints_app = typer.Typer(
    name="checkpoints", help="Inspect a run's checkpoints (snapshots to resume or roll back to).",
    no_args_is_help=True, add_completion=False,
)


@checkpoints_app.command("list")
def list_checkpoints(
    run_dir: Annotated[Path, typer.Argument(help="Run directory (or its checkpoints/ folder).")],
    verify: Annotated[bool, typer.Option("--verify", help="Also check every file's size and CRC-32.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """List the complete checkpoints of a run; any listed step can be passed to `train --resume-from`."""
    from starverse.checkpoint.store import CheckpointStore, resolve_root
    from starverse.errors import CheckpointError

    store = CheckpointStore(resolve_root(run_dir))
    store.require_any("point at a run directory written by `starverse train` (it holds checkpoints/)")
    rows: list[dict[str, Any]] = []
    for info in store.list():
        status = "ok"
        if verify:
            try:
                store.verify(info)
            except CheckpointError as e:
                status = f"CORRUPTED: {e}"
        m = info.manifest.get("metrics") or {}
        rows.append({
            "step": info.step, "created_at": info.created_at, "reason": info.reason,
            "ranks": info.world_size, "devices": list(info.device_kinds), "size_mb": round(info.size_bytes / 1e6, 3),
            "loss": m.get("loss"), "status": status, "path": str(info.path),
            "interval": (info.manifest.get("interval") or {}).get("reason"),
        })
    torn = len(store.partials())
    aside = sorted(p.name for p in store.root.glob("rolled-back-*"))
    if as_json:
        typer.echo(json.dumps({"root": str(store.root), "checkpoints": rows, "torn_writes": torn,
                               "rolled_back": aside}, indent=2))
        return
    console = Console(highlight=False)
    table = Table(title=f"checkpoints in {store.root}")
    for col in ("step", "created (UTC)", "reason", "ranks", "size MB", "loss", "status"):
        table.add_column(col, justify="right" if col in ("step", "ranks", "size MB", "loss") else "left")
    for r in rows:
        kinds = ", ".join(sorted(set(r["devices"])))
        loss = f"{r['loss']:.4f}" if isinstance(r["loss"], float) and math.isfinite(r["loss"]) else "-"
        table.add_row(str(r["step"]), r["created_at"].replace("+00:00", ""), r["reason"], f"{r['ranks']} ({kinds})",
                      f"{r['size_mb']:.1f}", loss, r["status"])
    console.print(table)
    if rows and rows[-1]["interval"]:
        console.print(f"interval: {rows[-1]['interval']}", markup=False)
    if torn:
        console.print(f"{torn} torn write(s) (crashed mid-save) are ignored and never loaded.")
    if aside:
        console.print(f"rolled back (kept aside): {', '.join(aside)}")
    if any(r["status"] != "ok" for r in rows):
        raise typer.Exit(1)


def print_bill(console: Console, bill: JobBill) -> None:
    """The job's bill as the CLI shows it after training: one line per lease, the credits, the totals."""
    ccy = bill.currency
    console.print(f"[bold]bill[/bold] (job '{bill.job}', {ccy})")
    for x in bill.leases:
        dur = "open" if x.open else f"{x.seconds} s"
        console.print(f"  lease {x.lease}: {x.device} ({x.accelerator}, {x.mode} "
                      f"{x.price_per_hour} {x.price_currency}/h), {dur}: {x.charges}", markup=False)
    for c in bill.credits:
        console.print(f"  insurance credit ({c.kind}, lease {c.lease}, {c.seconds} s): -{c.amount}", markup=False)
    console.print(f"  charges {bill.charges} {ccy}, insurance credits {bill.credit} {ccy}, net "
                  f"{bill.net} {ccy}", markup=False)
    if bill.open_leases:
        console.print(f"  {bill.open_leases} lease(s) left open by a run that died: closed and credited "
                      "when the job is run again", markup=False)


def train(
    job_file: Annotated[Path, typer.Argument(help="Job file (model, dataset, run_dir, train, checkpoint, ...).")],
    resume_from: Annotated[
        int | None,
        typer.Option("--resume-from", help="Resume from this checkpoint step (rollback); default: the latest."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the outcome as JSON.")] = False,
    metrics_port: Annotated[
        int | None, typer.Option("--metrics-port", help="Serve Prometheus metrics on this 127.0.0.1 port "
                                 "(overrides metrics.port; 0: a free port).", min=0, max=65535),
    ] = None,
) -> None:
    """Run a training job under the supervisor: checkpoints, preemption notices, re-plan and resume on loss,
    a per-second ledger with budgets and insurance credits, and Prometheus metrics on 127.0.0.1.

    SIGTERM writes an emergency checkpoint and exits with code 3; run the same command again to resume.
    """
    from starverse.elastic.job import load_job

    # a bad job file is one line before the runtime (and torch, seconds) is imported
    job = load_job(job_file)
    from starverse.jobs import prepare_job
    from starverse.metrics.callbacks import ENDPOINT_FILE

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # accelerate's warnings are also in cluster.notes, printed with the summary: once is enough
    logging.getLogger("starverse.runtime.cluster").setLevel(logging.ERROR)
    console = Console(highlight=False, stderr=as_json, soft_wrap=True)
    prepared = prepare_job(job, resume_from=resume_from if resume_from is not None else "latest",
                           metrics_port=metrics_port, source=job_file)
    for line in prepared.summary_lines():
        console.print(f"  {line}", markup=False)
    result = prepared.run()
    if as_json:
        typer.echo(json.dumps(result.as_dict(), indent=2))
        return
    for a in result.attempts:
        resumed = f"from step {a.resumed_from}" if a.resumed_from is not None else "fresh"
        n = len(a.device_kinds)
        console.print(f"  attempt {a.number}: {n} rank{'' if n == 1 else 's'}, {resumed}, {a.outcome} at step "
                      f"{a.last_step} ({a.wall_s:.1f} s){': ' + a.detail if a.detail else ''}", markup=False)
    if result.checkpoint_interval:
        console.print(f"  checkpoint interval: {result.checkpoint_interval}", markup=False)
    if result.fit is not None:
        for line in result.fit.summary_lines():
            console.print(f"  {line}", markup=False)
    console.print(f"  steps redone after losses: {result.lost_steps}", markup=False)
    if result.bill is not None:
        print_bill(console, result.bill)
    run_dir = result.run_dir
    if result.metrics_url:
        console.print(f"  metrics were served at {result.metrics_url} (address in {run_dir / ENDPOINT_FILE})",
                      markup=False)
    console.print(f"  logs: {run_dir / 'metrics.jsonl'}, TensorBoard: tensorboard --logdir {run_dir}; "
                  f"`starverse runs {run_dir.parent}`, `starverse export {run_dir} --out DIR`", markup=False)
    console.print(f"run dir: {result.run_dir}  checkpoints: {result.checkpoints}"
                  + (f"  ledger: {result.bill.ledger} (`starverse bill {result.run_dir}`)" if result.bill else ""),
                  markup=False)
    sys.stdout.flush()


def register(app: typer.Typer) -> None:
    """Add ``checkpoints list`` and ``train``."""
    app.add_typer(checkpoints_app)
    app.command("train")(train)
