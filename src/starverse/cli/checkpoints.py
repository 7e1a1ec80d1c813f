"""``starverse checkpoints list RUN_DIR`` (snapshots) and ``starverse train JOB.yaml`` (supervised training).

torch is imported inside ``train`` only: listing checkpoints starts fast.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

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
    store.require_any()
    rows = []
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


def job_bill(ledger_path: str | Path, job_name: str) -> dict[str, Any]:
    """The bill of one job of a ledger: charges per lease (device), insurance credits apart, exact ticks."""
    from starverse.billing import Ledger, ticks_to_decimal

    with Ledger.open(ledger_path, create=False) as ledger:
        job = ledger.job(job_name)
        leases = []
        for le in ledger.leases(job):
            rows = ledger.charges(le.id)
            ticks = sum(r.ticks for r in rows)
            leases.append({
                "lease": le.id, "device": le.device, "accelerator": le.accelerator, "mode": le.mode.value,
                "price_per_hour": f"{le.offer_price.normalize():f}", "price_currency": le.offer_currency,
                "seconds": sum(r.seconds for r in rows) if le.end_s is not None else None,
                "charges": str(ticks_to_decimal(ticks)), "charge_ticks": ticks, "open": le.end_s is None,
            })
        credits = [{"lease": c.lease_id, "kind": c.kind.value, "seconds": c.seconds, "amount": str(c.amount),
                    "ticks": c.ticks} for c in ledger.credits(job)]
        events = [{"kind": e.kind.value, "step": e.step} for e in ledger.events(job)]
    charge_ticks = sum(x["charge_ticks"] for x in leases)
    credit_ticks = sum(c["ticks"] for c in credits)
    return {
        "ledger": str(ledger_path), "job": job.name, "currency": job.currency, "leases": leases,
        "charges": str(ticks_to_decimal(charge_ticks)), "charge_ticks": charge_ticks, "credits": credits,
        "credit": str(ticks_to_decimal(credit_ticks)), "credit_ticks": credit_ticks,
        "net": str(ticks_to_decimal(charge_ticks - credit_ticks)), "events": events,
        "open_leases": sum(1 for x in leases if x["open"]),
    }


def check_ledger_job(ledger_path: Path, name: str, currency: str, budget_total: Any, source: str) -> None:
    """Before launching: a job already in the ledger must keep its currency and have budget left."""
    from starverse.billing import Ledger
    from starverse.errors import BillingError, BudgetExceededError

    if not ledger_path.is_file():
        return
    with Ledger.open(ledger_path, create=False) as ledger:
        try:
            job = ledger.job(name)
        except BillingError:
            return  # a new job in an existing ledger
        if job.currency != currency:
            raise BillingError(
                f"{source}: billing.currency: job '{name}' in {ledger_path} is billed in {job.currency}, not "
                f"{currency}. To fix: set billing.currency: {job.currency} (other prices are converted), or "
                "name another job (billing.job)."
            )
        budget = budget_total if budget_total is not None else job.budget_total
        if budget is None:
            return
        # leases a dead run left open are closed at their last heartbeat when the job starts: count them so
        open_leases = ledger.leases(job, open_only=True)
        spent = ledger.spent(job, at_s=max((le.last_seen_s for le in open_leases), default=None))
    if spent >= budget:
        raise BudgetExceededError(
            f"{source}: billing.budget_total: job '{name}' has spent {spent} {currency} of its total budget "
            f"{budget} {currency} ({ledger_path}). To fix: raise billing.budget_total to continue it, or name "
            "another job (billing.job)."
        )


def print_bill(console: Console, bill: dict[str, Any]) -> None:
    """The job's bill as the CLI shows it after training: one line per lease, the credits, the totals."""
    ccy = bill["currency"]
    console.print(f"[bold]bill[/bold] (job '{bill['job']}', {ccy})")
    for x in bill["leases"]:
        dur = "open" if x["open"] else f"{x['seconds']} s"
        console.print(f"  lease {x['lease']}: {x['device']} ({x['accelerator']}, {x['mode']} "
                      f"{x['price_per_hour']} {x['price_currency']}/h), {dur}: {x['charges']}", markup=False)
    for c in bill["credits"]:
        console.print(f"  insurance credit ({c['kind']}, lease {c['lease']}, {c['seconds']} s): "
                      f"-{c['amount']}", markup=False)
    console.print(f"  charges {bill['charges']} {ccy}, insurance credits {bill['credit']} {ccy}, net "
                  f"{bill['net']} {ccy}", markup=False)
    if bill["open_leases"]:
        console.print(f"  {bill['open_leases']} lease(s) left open by a run that died: closed and credited "
                      "when the job is run again", markup=False)


def train(
    job_file: Annotated[Path, typer.Argument(help="Job file (model, dataset, run_dir, train, checkpoint, ...).")],
    resume_from: Annotated[
        int | None,
        typer.Option("--resume-from", help="Resume from this checkpoint step (rollback); default: the latest."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the outcome as JSON.")] = False,
) -> None:
    """Run a training job under the supervisor: checkpoints, preemption notices, re-plan and resume on loss,
    a per-second ledger with budgets and insurance credits, and Prometheus metrics on 127.0.0.1.

    SIGTERM writes an emergency checkpoint and exits with code 3; run the same command again to resume.
    """
    import starverse
    from starverse.billing.ledger import LEDGER_FILE
    from starverse.checkpoint.callback import CheckpointCallback
    from starverse.elastic.job import job_mtbf, job_prices, load_job
    from starverse.elastic.notice import (
        FileNotice,
        HttpNotice,
        SignalNotice,
        aws_spot_notice,
        gcp_preemption_notice,
    )
    from starverse.elastic.preemption import PreemptionCallback
    from starverse.elastic.supervisor import Supervisor
    from starverse.metrics.callbacks import ENDPOINT_FILE, BillingCallback, MetricsCallback

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # accelerate's warnings are also in cluster.notes, printed with the summary: once is enough
    logging.getLogger("starverse.runtime.cluster").setLevel(logging.ERROR)
    job = load_job(job_file)
    console = Console(highlight=False, stderr=as_json, soft_wrap=True)
    cluster = starverse.accelerate(
        model_id=job.model, plan=job.plan, num_cpu_ranks=job.devices.cpu_ranks, use_gpus=job.devices.use_gpus,
        seq_len=job.train.seq_len, global_batch=job.train.global_batch, max_params=job.train.max_params,
    )
    kinds = [r.device_kind for r in cluster.ranks]
    mtbf_s, mtbf_why = job_mtbf(job, kinds)
    run_dir = Path(job.run_dir)
    bill_cfg = job.billing
    billing: BillingCallback | None = None
    prices = None
    if bill_cfg.enabled:
        prices = job_prices(job, kinds, str(job_file))  # refuses a job above max_budget_per_hour before launch
        ledger_path = Path(bill_cfg.ledger or run_dir / LEDGER_FILE)
        check_ledger_job(ledger_path, bill_cfg.job or run_dir.name, prices.currency, bill_cfg.budget_total,
                         str(job_file))
        billing = BillingCallback(
            job=bill_cfg.job or run_dir.name, ledger_path=ledger_path,
            currency=prices.currency, budget_total=bill_cfg.budget_total,
            max_budget_per_hour=bill_cfg.max_budget_per_hour, prices=prices.prices,
        )
    ck = job.checkpoint
    sources: list[Any] = [SignalNotice()]
    if ck.notice_file:
        sources.append(FileNotice(ck.notice_file))
    if ck.notice_url == "aws":
        sources.append(aws_spot_notice())
    elif ck.notice_url == "gcp":
        sources.append(gcp_preemption_notice())
    elif ck.notice_url:
        sources.append(HttpNotice(ck.notice_url, lambda status, body: status == 200))
    checkpoint = CheckpointCallback(
        ck.dir, interval_steps=ck.interval_steps, mtbf_s=mtbf_s, max_interval_s=ck.max_interval_s,
        keep_last=ck.keep_last, keep_every=ck.keep_every, async_save=ck.async_save,
        billing_cursor=billing.checkpoint_cursor if billing is not None else None,
    )
    # billing after the checkpoint callback (it records the checkpoint taken in the same step), metrics last
    accounting: list[Any] = [billing] if billing is not None else []
    if job.metrics.enabled:
        accounting.append(MetricsCallback(job=billing.job_name if billing else None, port=job.metrics.port,
                                          linger_s=job.metrics.linger_s, checkpoints=checkpoint))
    sup = Supervisor(
        cluster, run_dir,
        checkpoint=checkpoint,
        preemption=PreemptionCallback(sources, grace_s=ck.grace_s),
        callbacks=accounting,
        trainer_options={"lr": job.train.lr, "seed": job.train.seed, "rebalance_every": job.train.rebalance_every,
                         "launcher": job.devices.launcher},
        max_restarts=job.max_restarts,
    )
    resume = resume_from if resume_from is not None else "latest"
    resume_path = sup.resume_path(resume)  # checked before anything is launched or written
    for line in cluster.summary_lines():
        console.print(f"  {line}", markup=False)
    console.print(
        f"  checkpoints: {sup.store.root}; interval "
        + (f"{ck.interval_steps} steps (job file)" if ck.interval_steps else f"Young/Daly, MTBF from {mtbf_why}")
        + (f"; resuming from {resume_path.name}" if resume_path else "; fresh start"),
        markup=False,
    )
    if billing is not None and prices is not None:
        budget = ", ".join(f"{k} {v} {prices.currency}" for k, v in (
            ("total budget", bill_cfg.budget_total), ("max per hour", bill_cfg.max_budget_per_hour)) if v)
        console.print(f"  ledger: {billing.ledger_path} (job '{billing.job_name}'); devices cost "
                      f"{prices.cost_per_hour.normalize():f} {prices.currency}/h" + (f"; {budget}" if budget else ""),
                      markup=False)
        for line in prices.lines:
            console.print(f"    {line}", markup=False)
    if job.metrics.enabled:
        console.print(f"  metrics: Prometheus on 127.0.0.1:{job.metrics.port or '<free port>'} while training "
                      f"(URL in {run_dir / ENDPOINT_FILE})", markup=False)

    def model_factory(c: Any) -> Any:
        with c.mixed_mesh():
            return starverse.build_model(c.model_config, seed=job.train.seed)

    out = sup.run(
        model_factory, job.dataset, resume_from=resume,
        per_device_batch_size=job.train.micro_batch, max_steps=job.train.steps, seq_len=job.train.seq_len,
        global_batch=job.train.global_batch,
    )
    latest = sup.store.latest()
    interval = (latest.manifest.get("interval") or {}).get("reason") if latest else None
    bill = job_bill(billing.ledger_path, billing.job_name) if billing is not None and billing.ledger_path else None
    endpoint = run_dir / ENDPOINT_FILE
    metrics_url = json.loads(endpoint.read_text()).get("url") if job.metrics.enabled and endpoint.is_file() else None
    stop = out.fit.stop_reason if out.fit else None
    if as_json:
        typer.echo(json.dumps({
            "final_step": out.final_step, "lost_steps": out.lost_steps,
            "final_loss": out.fit.final_loss if out.fit else None, "stop_reason": stop,
            "attempts": [a.__dict__ | {"device_kinds": list(a.device_kinds)} for a in out.attempts],
            "checkpoint_interval": interval, "run_dir": str(run_dir), "checkpoints": str(sup.store.root),
            "metrics_url": metrics_url, "bill": bill,
            "pipeline": out.fit.pipeline.as_dict() if out.fit and out.fit.pipeline else None,
        }, indent=2))
        return
    for a in out.attempts:
        resumed = f"from step {a.resumed_from}" if a.resumed_from is not None else "fresh"
        n = len(a.device_kinds)
        console.print(f"  attempt {a.number}: {n} rank{'' if n == 1 else 's'}, {resumed}, {a.outcome} at step "
                      f"{a.last_step} ({a.wall_s:.1f} s){': ' + a.detail if a.detail else ''}", markup=False)
    if interval:
        console.print(f"  checkpoint interval: {interval}", markup=False)
    if out.fit is not None:
        for line in out.fit.summary_lines():
            console.print(f"  {line}", markup=False)
    console.print(f"  steps redone after losses: {out.lost_steps}", markup=False)
    if bill is not None:
        print_bill(console, bill)
    console.print(f"run dir: {run_dir}  checkpoints: {sup.store.root}"
                  + (f"  ledger: {bill['ledger']} (`starverse bill {run_dir}`)" if bill else ""), markup=False)
    sys.stdout.flush()


def register(app: typer.Typer) -> None:
    """Add ``checkpoints list`` and ``train``."""
    app.add_typer(checkpoints_app)
    app.command("train")(train)
