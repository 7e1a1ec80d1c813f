"""``starverse plan JOB.yaml --pool POOL.yaml``: what to rent and how to run it (see ``docs/planner.md``)."""

from __future__ import annotations

import json
import math
import shlex
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from starverse.checks import check_output_file
from starverse.cli.options import at_line, finite_at_most, model_of
from starverse.config import MAX_GB_PER_S, MAX_SECONDS
from starverse.errors import ConfigError


def _headroom_gb(est: Any) -> float:
    """Smallest memory margin over the plan's devices (GB), from the estimate."""
    return float(est.margin_gb)


def _money(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:,.2f}"


def result_to_json(result: Any) -> dict[str, Any]:
    """The ``--json`` document: every ranked plan with its numbers and its plan, plus the search stats."""
    plans = []
    for i, rp in enumerate(result.plans, 1):
        est = rp.estimate
        plans.append({
            "rank": i, "kind": rp.kind, "mode": rp.mode, "alternative": rp.alternative,
            "devices": dict(rp.devices), "layout": rp.layout(),
            "tokens_per_s": rp.tokens_per_s, "effective_tokens_per_s": rp.effective_tokens_per_s,
            "spot_factor": rp.spot_factor, "spot_factor_formula": rp.spot_factor_formula,
            "spot_factor_simulated": rp.spot_factor_simulated, "mfu": float(est.mfu), "step_time_s": float(est.step_time_s),
            "cost_per_hour": rp.cost_per_hour, "hours": rp.hours, "total_cost": rp.total_cost,
            "power_kw": rp.power_kw, "headroom_gb": _headroom_gb(est), "bottleneck": str(est.bottleneck),
            "host_memory_gb_per_node": dict(rp.host_memory_gb_per_node), "price_sources": dict(rp.price_sources),
            "objective_value": rp.objective_value, "notes": list(rp.notes),
            "plan": rp.plan.model_dump(mode="json", exclude_none=True),
        })
    s = result.stats
    return {
        "model": result.model, "objective": str(result.objective), "currency": result.currency,
        "per_job": result.per_job, "notes": list(result.notes), "plans": plans,
        "stats": {**s.to_json(), "claim": optimality_claim(result)},
        "frontier": [{"hours": p.hours, "cost": p.cost, "label": p.label} for p in result.frontier],
    }


def _table(result: Any) -> Any:
    from rich.table import Table
    from rich.text import Text

    per = "" if result.per_job else " /1e9 tok"
    t = Table(title=f"{result.model} — objective: {result.objective} ({result.currency})", show_lines=True)
    for col in ("#", "devices", "layout", "tokens/s", "MFU", f"{result.currency}/h", f"total{per}",
                f"hours{per}", "kW", "headroom GB", "host GB/node", "bottleneck"):
        t.add_column(col, overflow="fold")
    for i, rp in enumerate(result.plans, 1):
        est = rp.estimate
        devs = "\n".join(f"{n}× {k}" for k, n in rp.devices.items())
        label = f"{i}" + ("\n" + rp.mode.upper() + " alt." if rp.alternative else "")
        tps = f"{rp.tokens_per_s:,.0f}" + (f"\n({rp.effective_tokens_per_s:,.0f} w/ spot)" if rp.spot_factor > 1
                                             else "")
        hours = rp.hours if rp.hours is not None else (1e9 / rp.effective_tokens_per_s / 3600)
        total = rp.total_cost if rp.total_cost is not None else hours * rp.cost_per_hour
        head = _headroom_gb(est)
        t.add_row(label, devs, Text(rp.layout().replace("; ", "\n").replace(" | ", "\n")), tps,
                  f"{float(est.mfu) * 100:.1f}%", _money(rp.cost_per_hour), _money(total), f"{hours:,.1f}",
                  f"{rp.power_kw:.1f}", f"{head:.1f}", _host(rp), str(est.bottleneck))
    return t


def _host(rp: Any) -> str:
    """Host RAM per node the offloaded state needs, per offer ('-' when nothing is offloaded)."""
    if not rp.host_memory_gb_per_node:
        return "-"
    return "\n".join(f"{v:,.0f} ({k})" for k, v in rp.host_memory_gb_per_node.items())


def optimality_claim(result: Any) -> str:
    """What the search can say about the chosen plan, and no more.

    Two branch-and-bound searches make the answer: single-accelerator plans and heterogeneous data
    parallelism (time tables), and heterogeneous pipelines (:mod:`starverse.planner.pipes`: offer blocks,
    TP, replicas, micro-batch, settings, exact layer split). "Proven optimal" needs both bounds closed; a
    screened first search is exact only over the options it kept, and a pipeline search stopped at its leaf
    cap is named as such, with the gap.
    """
    s = result.stats
    if not s.proven_optimal or not s.pipelines_proven:
        what = []
        if not s.proven_optimal:
            what.append("the evaluation cap of the single-kind / data-parallel search")
        if not s.pipelines_proven:
            what.append("the node/leaf caps of the heterogeneous-pipeline search (best-first branch and bound)")
        return f"NOT proven optimal: stopped at {' and '.join(what)}, bound gap {s.bound_gap:.1%}"
    scope = "over the options kept by screening" if s.screened else "over the searched space"
    claim = f"proven optimal: single-accelerator plans and heterogeneous data parallelism {scope}"
    if s.pipelines_searched:
        claim += "; heterogeneous pipelines (1F1B, exact layer split) over their whole space"
    return claim


def plot_frontier(result: Any, path: Path) -> None:
    """Pareto frontier of time vs cost, the chosen plan marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    pts = result.frontier
    if pts:
        ax.plot([p.hours for p in pts], [p.cost for p in pts], "o-", color="tab:blue", label="Pareto frontier")
        for p in pts[:: max(1, len(pts) // 12)]:
            ax.annotate(p.label, (p.hours, p.cost), fontsize=7, xytext=(4, 4), textcoords="offset points")
    others = result.plans[1:]
    def cost_of(rp: Any) -> tuple[float, float]:
        h = rp.hours if rp.hours is not None else 1e9 / rp.effective_tokens_per_s / 3600
        return h, (rp.total_cost if rp.total_cost is not None else h * rp.cost_per_hour)
    if others:
        xs, ys = zip(*(cost_of(r) for r in others), strict=True)
        ax.scatter(xs, ys, marker="x", color="grey", label="other ranked plans")
    bx, by = cost_of(result.best)
    ax.scatter([bx], [by], marker="*", s=250, color="tab:red", zorder=5, label="chosen plan")
    per = "" if result.per_job else " per 1e9 tokens"
    ax.set_xlabel(f"hours{per}")
    ax.set_ylabel(f"cost ({result.currency}){per}")
    ax.set_title(f"{result.model}: time vs cost ({result.objective})")
    if all(p.hours > 0 for p in pts) and pts and max(p.hours for p in pts) / min(p.hours for p in pts) > 20:
        ax.set_xscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plan_cmd(
    job_file: Annotated[Path, typer.Argument(help="job.yaml: model, training settings, objective, constraints.")],
    pool: Annotated[str, typer.Option("--pool", help="pool.yaml: the offers that can be rented; or ray://HOST:PORT: "
                                      "the devices of a running Ray cluster (see docs/ray.md).")],
    top: Annotated[int, typer.Option("--top", min=1, help="How many ranked plans to show.")] = 5,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    out: Annotated[Path | None, typer.Option("--out", help="Write the chosen plan here (plan.yaml format).")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Draw the time-vs-cost Pareto frontier to this PNG.")
                    ] = None,
    catalog_file: Annotated[Path | None, typer.Option("--catalog", help="Catalog file extending the bundled one.")
                            ] = None,
) -> None:
    """Choose the devices to rent and the parallel plan that best meet the job's objective."""
    from rich.console import Console

    from starverse.catalog import load_catalog
    from starverse.plan import save_plan
    from starverse.planner import load_job, search
    from starverse.planner.policy import describe
    from starverse.providers.ray_pool import load_pool_ref

    for path, option in ((out, "--out"), (plot, "--plot")):
        if path is not None:
            check_output_file(path, option)
    if plot is not None and plot.suffix.lower() != ".png":
        raise ConfigError(f"--plot {plot}: the frontier is drawn as a PNG. To fix: give a file name ending in "
                          ".png")
    catalog = load_catalog(catalog_file)
    job = load_job(job_file)
    model_of(job_file, job.model)  # an unknown model is an error at the job's model: line, before the search
    pool_obj = load_pool_ref(pool, catalog)
    result = search(job, pool_obj, catalog, top=top)
    if out is not None:
        save_plan(result.best.plan, out)
    if plot is not None:
        plot_frontier(result, plot)
    if as_json:
        typer.echo(json.dumps(_finite(result_to_json(result)), indent=2, allow_nan=False, default=str))
        return
    # wide enough for the table when piped (rich falls back to 80 columns without a terminal)
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 170)
    for note in result.notes:
        console.print(f"[bold yellow]note:[/] {note}")
    console.print(_table(result))
    best = result.best
    for n in best.notes:
        console.print(f"  plan 1: {n}")
    console.print(f"chosen: plan 1, {describe(result.objective, best.objective_value, result.currency)}")
    s = result.stats
    console.print(f"searched {s.options:,} group options, {s.combinations:,} combinations, "
                  f"{s.exact_evaluations:,} exact splits in {s.seconds:.2f} s ({optimality_claim(result)})")
    if out is not None:
        console.print(f"wrote {out} (check it with: starverse estimate {shlex.quote(str(out))})", markup=False,
                      soft_wrap=True)
    if plot is not None:
        console.print(f"wrote {plot}")


def _finite(x: Any) -> Any:
    """JSON has no inf/NaN: non-finite floats become null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


MAX_SIM_RUNS = 100_000
"""Most jobs one ``starverse simulate`` replays (all of them are held in memory at once, ~7,000 a second)."""


def register(app: typer.Typer) -> None:
    """Add ``starverse plan`` and ``starverse simulate``."""
    app.command("plan")(plan_cmd)
    app.command("simulate")(simulate_cmd)


def simulate_cmd(
    plan_file: Annotated[Path, typer.Argument(help="plan.yaml (e.g. written by `starverse plan --out`).")],
    trace: Annotated[Path, typer.Option("--trace", help="Preemption trace: Bamboo CSV or node-count JSON "
                                        "(data/traces/).")],
    policy: Annotated[str, typer.Option("--policy", help="restart (roll back to the last checkpoint) or "
                                        "in-place (survivors go on).")] = "restart",
    runs: Annotated[int, typer.Option("--runs", min=1, max=MAX_SIM_RUNS, help="Simulated jobs (random starts in the trace).")] = 1000,
    hours: Annotated[float, typer.Option("--hours", callback=finite_at_most(MAX_SECONDS / 3600), min=0.001, help="Compute hours of the job when the plan gives "
                                         "no train.tokens or train.steps.")] = 24.0,
    restart_s: Annotated[float, typer.Option("--restart-s", callback=finite_at_most(MAX_SECONDS), min=0, help="Seconds to restart (or reconfigure) "
                                             "after a loss.")] = 300.0,
    checkpoint_gb_per_s: Annotated[float, typer.Option("--checkpoint-gb-per-s", callback=finite_at_most(MAX_GB_PER_S),
                                                       min=0.001,
                                                       help="Checkpoint write speed per node, GB/s.")] = 2.0,
    interval_s: Annotated[float | None, typer.Option("--interval-s", callback=finite_at_most(MAX_SECONDS), min=0.001, help="Work between checkpoints "
                                                     "(default: Young/Daly at the trace's loss rate).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    catalog_file: Annotated[Path | None, typer.Option("--catalog", help="Catalog file extending the bundled one.")
                            ] = None,
) -> None:
    """Replay a spot plan on a real preemption trace: wall time, cost and redone work (p50/p90)."""
    from rich.console import Console
    from rich.table import Table

    from starverse.catalog import load_catalog
    from starverse.plan import load_plan
    from starverse.planner.simulate import POLICIES, load_trace_events
    from starverse.planner.spotcheck import simulate_plan

    if policy not in POLICIES:
        raise ConfigError(f"--policy: unknown policy '{policy}'; use one of: {', '.join(POLICIES)}")
    plan = load_plan(plan_file)
    events = load_trace_events(trace)
    spec = model_of(plan_file, plan.model)
    with at_line(plan_file):
        sim = simulate_plan(plan, events, catalog=load_catalog(catalog_file), spec=spec,
                            policy=policy, runs=runs, hours=hours, restart_s=restart_s,  # type: ignore[arg-type]
                            checkpoint_gb_per_s=checkpoint_gb_per_s, interval_s=interval_s)
    p50, p90 = sim.result.p(50), sim.result.p(90)
    if as_json:
        doc = {"plan": str(plan_file), "trace": sim.trace, "policy": sim.policy, "runs": runs,
               "work_hours": sim.job.work_s / 3600, "checkpoint_s": sim.job.checkpoint_s,
               "interval_s": sim.job.interval_s, "restart_s": sim.job.restart_s,
               "interruptions_per_hour": sim.interruptions_per_hour, "p50": p50, "p90": p90,
               "planner_spot_factor": sim.formula, "spot_factor_vs_sim": sim.ratio}
        typer.echo(json.dumps(_finite(doc), indent=2, allow_nan=False))
        return
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 170)
    t = Table(title=f"{plan_file} on {sim.trace} ({sim.policy}, {runs:,} jobs, {sim.job.num_devices} spot devices)")
    for col in ("", "wall hours", "cost", "redone hours", "× compute time"):
        t.add_column(col)
    for name, q in (("p50", p50), ("p90", p90)):
        t.add_row(name, f"{q['wall_hours']:,.2f}", _money(q["cost"]), f"{q['redone_hours']:,.2f}", f"{q['factor']:.3f}")
    console.print(t)
    console.print(f"compute {sim.job.work_s / 3600:,.2f} h; checkpoint {sim.job.checkpoint_s:.1f} s every "
                  f"{sim.job.interval_s:,.0f} s of work; restart {sim.job.restart_s:.0f} s; "
                  f"{sim.interruptions_per_hour:.3g} losses/h at the trace's per-device rate")
    console.print(f"planner (Young/Daly, independent losses): ×{sim.formula:.3f} = {sim.ratio:.2f} × the simulated "
                  "median" + ("" if abs(sim.ratio - 1) <= 0.10 else " (differs by more than 10 %: the planner uses "
                                                                   "the simulated figure for pools with this trace)"))
