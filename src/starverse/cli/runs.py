"""``starverse runs [DIR]``, ``starverse runs compare A B`` and ``starverse export RUN_DIR --out DIR``.

Plain functions over :mod:`starverse.metrics.runs` and :mod:`starverse.runtime.export`; torch is imported by
``export`` only.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from starverse.errors import ConfigError


def _fmt(v: Any, spec: str = ".4f") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return format(v, spec) if isinstance(v, int | float) else str(v)


def _row(r: Any) -> dict[str, Any]:
    return {"run": str(r.path), "status": r.status, "steps": r.steps, "max_steps": r.max_steps, "loss": r.loss,
            "eval_loss": r.eval_loss, "eval_perplexity": r.eval_perplexity, "tokens_per_s": r.tokens_per_s,
            "mode": r.mode, "trainable_params": r.trainable_params, "cost": r.cost}


def runs(
    args: Annotated[list[str] | None, typer.Argument(
        help="DIR (default: runs) to list the runs below it, or: compare RUN_A RUN_B.", show_default=False)] = None,
    png: Annotated[Path | None, typer.Option(
        "--png", help="compare: where to write the loss curves (default: RUN_A-vs-RUN_B.png here).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """List runs (status, steps, loss, held-out loss, tokens/s, cost), or compare two side by side with a PNG of
    their loss curves."""
    from starverse.metrics.runs import find_runs, plot_loss_curves, read_run

    args = list(args or [])
    console = Console(highlight=False, soft_wrap=True)
    if args and args[0] == "compare":
        if len(args) != 3:
            raise ConfigError("runs compare: needs two run directories. To fix: starverse runs compare RUN_A RUN_B.")
        a, b = read_run(args[1]), read_run(args[2])
        out = plot_loss_curves([a, b], png or Path(f"{a.path.name}-vs-{b.path.name}.png"))
        if as_json:
            typer.echo(json.dumps({"runs": [_row(a), _row(b)], "png": str(out.resolve())}, indent=2))
            return
        table = Table(title="runs compared")
        table.add_column("")
        for r in (a, b):
            table.add_column(r.path.name, justify="right")
        for label, key, spec in (("status", "status", ""), ("steps", "steps", "d"), ("loss", "loss", ".4f"),
                                 ("held-out loss", "eval_loss", ".4f"), ("perplexity", "eval_perplexity", ".2f"),
                                 ("tokens/s", "tokens_per_s", ",.0f"), ("mode", "mode", ""),
                                 ("trainable params", "trainable_params", ","), ("cost", "cost", "")):
            table.add_row(label, *(_fmt(getattr(r, key), spec) for r in (a, b)))
        console.print(table)
        console.print(f"loss curves: {out.resolve()}", markup=False)
        return
    if len(args) > 1:
        raise ConfigError(f"runs: one folder at most (got {len(args)}). To fix: starverse runs [DIR] or "
                          "starverse runs compare RUN_A RUN_B.")
    found = find_runs(args[0] if args else "runs")
    if as_json:
        typer.echo(json.dumps([_row(r) for r in found], indent=2))
        return
    table = Table(title=f"runs in {Path(args[0] if args else 'runs').resolve()}")
    for col in ("run", "status", "steps", "loss", "held-out", "tokens/s", "mode", "cost"):
        table.add_column(col, justify="right" if col in ("steps", "loss", "held-out", "tokens/s") else "left")
    for r in found:
        steps = f"{r.steps}/{r.max_steps}" if r.max_steps else str(r.steps)
        table.add_row(r.path.name, r.status, steps, _fmt(r.loss), _fmt(r.eval_loss), _fmt(r.tokens_per_s, ",.0f"),
                      r.mode or "-", r.cost or "-")
    console.print(table)


def export(
    run_dir: Annotated[Path, typer.Argument(help="A finished run directory (of a Hugging Face model).")],
    out: Annotated[Path, typer.Option("--out", help="New folder to write the Hugging Face model to.")],
    merge_lora: Annotated[bool, typer.Option(
        "--merge-lora", help="Fold LoRA adapters into the weights (a plain model); default: a peft adapter folder.",
    )] = False,
) -> None:
    """Write a run's trained model as a Hugging Face folder (config, safetensors, tokenizer) that
    AutoModelForCausalLM.from_pretrained loads."""
    from starverse.runtime.export import export_run

    res = export_run(run_dir, out, merge_lora=merge_lora)
    what = ("peft adapter over " + str(res.base)) if res.adapter_only else (
        "full weights" + (" (LoRA merged)" if res.merged and res.base else ""))
    Console(highlight=False, soft_wrap=True).print(
        f"exported {run_dir} -> {res.out}: {what}, {res.num_params:,} parameters, "
        + ("tokenizer included" if res.has_tokenizer else "no tokenizer (the run used raw bytes or token ids)"),
        markup=False)


def register(app: typer.Typer) -> None:
    """Add ``runs`` and ``export``."""
    app.command("runs")(runs)
    app.command("export")(export)
