"""``starverse estimate`` (what a plan costs) and ``starverse validate`` (the cost model vs published runs)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table


def _console() -> Console:
    console = Console(highlight=False, soft_wrap=False)
    if not console.is_terminal:
        console = Console(highlight=False, width=160)
    return console


def _num(x: float | None, fmt: str = ".3g") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def estimate(
    plan_file: Annotated[Path, typer.Argument(help="Plan YAML (DESIGN.md plan.yaml format).", show_default=False)],
    catalog_file: Annotated[
        Path | None,
        typer.Option("--catalog", help="Catalog YAML extending/overriding the bundled one.", show_default=False),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the Estimate as one JSON object.")] = False,
) -> None:
    """Step time, tokens/s, MFU, memory per device, cost and power of a plan, with its breakdown."""
    from starverse.catalog import load_catalog
    from starverse.cli.options import at_line, model_of
    from starverse.costmodel import estimate as run_estimate
    from starverse.costmodel.validate import load_plan_or_case

    plan = load_plan_or_case(plan_file)
    catalog = load_catalog(catalog_file)
    spec = model_of(plan_file, plan.model)
    with at_line(plan_file):  # checks of the plan against its model and the catalog name the field
        est = run_estimate(plan, catalog, spec)
    if as_json:
        typer.echo(json.dumps(est.to_dict(), indent=2))
        return
    con = _console()
    con.print(f"[bold]{plan_file}[/bold]: {spec.name}, {plan.num_devices} devices, "
              f"seq {plan.train.seq_len}, global batch {plan.train.global_batch}")
    summary = Table(show_header=False, box=None)
    rows = [
        ("step time", f"{est.step_time_s:.3f} s"),
        ("throughput", f"{est.tokens_per_s:,.0f} tokens/s"),
        ("MFU", f"{est.mfu:.1%}  ({est.model_tflops_per_device:.1f} model TFLOP/s per device)"),
        ("memory", f"{est.memory_gb:.1f} of {est.capacity_gb:.1f} GB usable on the fullest device"
                   f" ({'fits' if est.fits else 'DOES NOT FIT'}, margin {est.margin_gb:.1f} GB)"),
        ("cost", "-" if est.cost_per_hour is None else
         f"{est.cost_per_hour:,.2f} {est.currency}/h, {_num(est.cost_per_million_tokens, ',.3f')} "
         f"{est.currency} per million tokens"),
        ("power", f"{est.power_kw:.1f} kW (device TDP)"),
        ("bottleneck", est.bottleneck),
    ]
    if est.job_hours is not None:
        rows.append(("whole job", f"{est.job_hours:,.1f} h" + (
            "" if est.job_cost is None else f", {est.job_cost:,.0f} {est.currency}")))
    for k, v in rows:
        summary.add_row(k, v)
    con.print(summary)
    parts = Table(title="step time breakdown (slowest group)")
    parts.add_column("part")
    parts.add_column("seconds", justify="right")
    parts.add_column("share", justify="right")
    for part, secs in est.breakdown.items():
        parts.add_row(part, f"{secs:.4f}", f"{secs / est.step_time_s:.1%}")
    con.print(parts)
    mem = Table(title="memory per device (GB)")
    for col in ("group", "stage", "accelerator", "tp", "layers", "micro-batch", "weights", "grads", "optimizer",
                "activations", "total", "usable", "margin"):
        mem.add_column(col, justify="right" if col not in ("accelerator",) else "left")
    for g in est.groups:
        for si, s in enumerate(g.stages):
            mem.add_row(str(g.index), str(si), s.accelerator, str(s.tp), str(s.layers),
                        f"{g.micro_batch} x {g.num_micro_batches}", f"{s.weights_gb:.1f}", f"{s.grads_gb:.1f}",
                        f"{s.optimizer_gb:.1f}", f"{s.activations_gb:.1f}", f"{s.total_gb:.1f}",
                        f"{s.capacity_gb:.1f}", f"{s.margin_gb:.1f}")
    con.print(mem)
    for g in est.groups:
        sched = g.schedule + (f" (v={g.virtual_stages})" if g.schedule == "interleaved" else "")
        con.print(f"group {g.index}: {g.num_devices} devices, {g.sequences_per_step} sequences per step "
                  f"({g.batch_share:.1%}), micro-batch {g.micro_batch} x {g.num_micro_batches}, {sched}, "
                  f"{g.step_time_s:.3f} s")
    for w in est.warnings:
        con.print(f"[yellow]warning:[/yellow] {w}")


def validate(
    paths: Annotated[list[Path], typer.Argument(help="Validation case files or folders of *.yaml.",
                                                show_default=False)],
    catalog_file: Annotated[
        Path | None,
        typer.Option("--catalog", help="Catalog YAML extending/overriding the bundled one.", show_default=False),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print {cases, summary, sources} as one JSON object.")] = False,
) -> None:
    """Predicted vs measured tokens/s (and peak memory) for published runs, per source and overall; exit 1
    if any case failed (reason on stderr), 2 if a case file is malformed or there are no cases."""
    from starverse.catalog import load_catalog
    from starverse.costmodel.validate import find_cases, load_case, report, score_case
    from starverse.errors import ConfigError

    catalog = load_catalog(catalog_file)
    files = find_cases([str(p) for p in paths])
    if not files:
        raise ConfigError(f"{', '.join(map(str, paths))}: no validation cases (*.yaml) here; pass case files or "
                          "folders of them (data/validation holds the bundled ones)")
    # a malformed file (or an unknown model) is bad input, exit 2; a case the estimator gets wrong fails, exit 1
    cases = [load_case(p) for p in files]
    results = [score_case(c, catalog) for c in cases]
    doc = report(results)
    failed = [r for r in results if not r.ok]
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    if as_json:
        typer.echo(json.dumps(doc))
    else:
        con = _console()
        table = Table(title="cost model vs published runs (tokens/s)")
        for col in ("case", "predicted", "measured", "error"):
            table.add_column(col, justify="left" if col == "case" else "right")
        for r in results:
            table.add_row(r.name, _num(r.predicted, ",.0f"), _num(r.measured, ",.0f"),
                          "-" if r.error is None else f"{r.error:+.1%}")
        con.print(table)
        for name, s in [*doc["sources"].items(), ("all", doc["summary"])]:
            mem = (f"  peak memory median {_num(s['memory_median_abs_error'], '.1%')} (n={s['memory_n']})"
                   if s["memory_n"] else "")
            con.print(f"{name}: n={s['n']}  median |error| {_num(s['median_abs_error'], '.1%')}  "
                      f"p90 {_num(s['p90_abs_error'], '.1%')}  max {_num(s['max_abs_error'], '.1%')}  "
                      f"Spearman {_num(s['spearman'], '.3f')}{mem}")
    for r in failed:
        err.print(f"case {r.name} failed: {r.reason}", markup=False)
    if failed:
        sys.stdout.flush()
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add ``estimate`` and ``validate`` to ``app``."""
    app.command("estimate")(estimate)
    app.command("validate")(validate)
