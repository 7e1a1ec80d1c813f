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


def train(
    job_file: Annotated[Path, typer.Argument(help="Job file (model, dataset, run_dir, train, checkpoint, ...).")],
    resume_from: Annotated[
        int | None,
        typer.Option("--resume-from", help="Resume from this checkpoint step (rollback); default: the latest."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the outcome as JSON.")] = False,
) -> None:
    """Run a training job under the supervisor: checkpoints, preemption notices, re-plan and resume on loss.

    SIGTERM writes an emergency checkpoint and exits with code 3; run the same command again to resume.
    """
    import starverse
    from starverse.checkpoint.callback import CheckpointCallback
    from starverse.elastic.job import job_mtbf, load_job
    from starverse.elastic.notice import (
        FileNotice,
        HttpNotice,
        SignalNotice,
        aws_spot_notice,
        gcp_preemption_notice,
    )
    from starverse.elastic.preemption import PreemptionCallback
    from starverse.elastic.supervisor import Supervisor

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    job = load_job(job_file)
    console = Console(highlight=False, stderr=as_json, soft_wrap=True)
    cluster = starverse.accelerate(
        model_id=job.model, plan=job.plan, num_cpu_ranks=job.devices.cpu_ranks, use_gpus=job.devices.use_gpus,
        seq_len=job.train.seq_len, global_batch=job.train.global_batch, max_params=job.train.max_params,
    )
    kinds = [r.device_kind for r in cluster.ranks]
    mtbf_s, mtbf_why = job_mtbf(job, kinds)
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
    run_dir = Path(job.run_dir)
    sup = Supervisor(
        cluster, run_dir,
        checkpoint=CheckpointCallback(
            ck.dir, interval_steps=ck.interval_steps, mtbf_s=mtbf_s, max_interval_s=ck.max_interval_s,
            keep_last=ck.keep_last, keep_every=ck.keep_every, async_save=ck.async_save,
        ),
        preemption=PreemptionCallback(sources, grace_s=ck.grace_s),
        trainer_options={"lr": job.train.lr, "seed": job.train.seed, "rebalance_every": job.train.rebalance_every},
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
    if as_json:
        typer.echo(json.dumps({
            "final_step": out.final_step, "lost_steps": out.lost_steps,
            "final_loss": out.fit.final_loss if out.fit else None,
            "attempts": [a.__dict__ | {"device_kinds": list(a.device_kinds)} for a in out.attempts],
            "checkpoint_interval": interval,
        }, indent=2))
        return
    for a in out.attempts:
        resumed = f"from step {a.resumed_from}" if a.resumed_from is not None else "fresh"
        console.print(f"  attempt {a.number}: {len(a.device_kinds)} ranks, {resumed}, {a.outcome} at step "
                      f"{a.last_step} ({a.wall_s:.1f} s){': ' + a.detail if a.detail else ''}", markup=False)
    if interval:
        console.print(f"  checkpoint interval: {interval}", markup=False)
    if out.fit is not None:
        for line in out.fit.summary_lines():
            console.print(f"  {line}", markup=False)
    console.print(f"  steps redone after losses: {out.lost_steps}", markup=False)
    sys.stdout.flush()


def register(app: typer.Typer) -> None:
    """Add ``checkpoints list`` and ``train``."""
    app.add_typer(checkpoints_app)
    app.command("train")(train)
