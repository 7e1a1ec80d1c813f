"""Runs as their logs describe them: ``starverse runs [DIR]`` and ``starverse runs compare A B``.

A run directory is one with a ``metrics.jsonl`` (written by every fit: a line per step and per event, see
:mod:`starverse.runtime.runlog`). :func:`read_run` summarises one: status (finished, stopped and why, or
incomplete: no end event, so still running or died), steps, last loss, last held-out loss, median tokens/s, and
its cost when the run has a ledger. :func:`plot_loss_curves` draws the loss curves of several runs to a PNG.
No torch: listing runs starts fast.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starverse.errors import ConfigError

METRICS_FILE = "metrics.jsonl"
"""The log every run writes (also :data:`starverse.runtime.runlog.METRICS_FILE`)."""


@dataclass(frozen=True)
class RunSummary:
    """One run, from its ``metrics.jsonl`` (and its ledger, for the cost)."""

    path: Path
    """The run directory."""
    status: str
    """``finished``, ``stopped: <reason>`` or ``incomplete`` (no end event: running, or died)."""
    steps: int
    """Last step logged."""
    max_steps: int | None
    """The step the run was asked to reach."""
    loss: float | None
    """Training loss of the last step."""
    eval_loss: float | None
    """Held-out loss of the last evaluation (None: no held-out split)."""
    eval_perplexity: float | None
    """``exp(eval_loss)``."""
    tokens_per_s: float | None
    """Median whole-job tokens/s over the steps (the first of each start excluded)."""
    mode: str | None
    """Training mode (full, lora, qlora)."""
    trainable_params: int | None
    """Trainable parameters at the start."""
    cost: str | None
    """Net cost from the run's ledger, with its currency (None: no ledger)."""
    curve: tuple[tuple[int, float], ...] = field(default=(), repr=False)
    """``(step, loss)`` of every step logged."""
    eval_curve: tuple[tuple[int, float], ...] = field(default=(), repr=False)
    """``(step, eval loss)`` of every evaluation."""


def _lines(path: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    # bytes that are not UTF-8 (a torn write, a disk error) spoil their line only, as a malformed line does
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (json.JSONDecodeError, RecursionError):
                continue  # a line cut by a crash mid-write: the rest of the log still counts
            if isinstance(row, dict):
                rows.append(row)
    return rows


def read_run(run_dir: str | Path) -> RunSummary:
    """Summarise one run directory (see the module docstring); ConfigError when it has no ``metrics.jsonl``."""
    path = Path(run_dir).resolve()
    log = path / METRICS_FILE
    if not log.is_file():
        raise ConfigError(f"{path}: no {METRICS_FILE}, so not a run directory. To fix: pass the run_dir of a "
                          "`starverse train` or Trainer.fit run.")
    rows = _lines(log)
    steps = [r for r in rows if r.get("type") == "step"]
    events = [r for r in rows if r.get("type") == "event"]
    starts = [e for e in events if e.get("event") == "start"]
    ends = [e for e in events if e.get("event") == "end"]
    evals = [e for e in events if e.get("event") == "eval"]
    start = starts[-1] if starts else {}
    max_steps = start.get("max_steps")
    last_step = int(steps[-1]["step"]) if steps else 0
    if ends and ends[-1]["time"] >= start.get("time", 0):
        reason = ends[-1].get("stop_reason")
        status = f"stopped: {reason}" if reason else "finished"
    else:
        status = "incomplete"
    first_steps = {int(s["step"]) + 1 for s in starts}
    tps = [float(s["tokens_per_s"]) for s in steps if s.get("tokens_per_s") and int(s["step"]) not in first_steps]
    return RunSummary(
        path=path, status=status, steps=last_step, max_steps=max_steps,
        loss=steps[-1].get("loss") if steps else None,
        eval_loss=evals[-1].get("loss") if evals else None,
        eval_perplexity=evals[-1].get("perplexity") if evals else None,
        tokens_per_s=statistics.median(tps) if tps else None,
        mode=start.get("mode"), trainable_params=start.get("trainable_params"), cost=_cost(path),
        curve=tuple((int(s["step"]), float(s["loss"])) for s in steps if s.get("loss") is not None),
        eval_curve=tuple((int(e["step"]), float(e["loss"])) for e in evals),
    )


def _cost(run_dir: Path) -> str | None:
    """Net cost of the run's job in its ledger (the job is named after the run directory by default)."""
    from starverse.billing import Ledger, ticks_to_decimal
    from starverse.billing.ledger import LEDGER_FILE
    from starverse.errors import BillingError

    ledger_path = run_dir / LEDGER_FILE
    if not ledger_path.is_file():
        return None
    try:
        with Ledger.open(ledger_path, create=False) as ledger:
            job = ledger.job(run_dir.name)
            ticks = sum(r.ticks for le in ledger.leases(job) for r in ledger.charges(le.id))
            ticks -= sum(c.ticks for c in ledger.credits(job))
            return f"{ticks_to_decimal(ticks).normalize():f} {job.currency}"
    except BillingError:
        return None


def find_runs(root: str | Path) -> list[RunSummary]:
    """Every run directory at or below ``root`` (newest log first); ConfigError when there is none."""
    base = Path(root).resolve()
    if not base.is_dir():
        raise ConfigError(f"{base}: not a folder. To fix: pass the folder your runs are in (default: runs).")
    logs = sorted(base.rglob(METRICS_FILE), key=lambda p: p.stat().st_mtime, reverse=True)
    if not logs:
        raise ConfigError(f"{base}: no runs (no {METRICS_FILE} at or below it). To fix: pass the folder of your "
                          "run directories.")
    return [read_run(p.parent) for p in logs]


def plot_loss_curves(runs: Sequence[RunSummary], out: str | Path) -> Path:
    """A PNG of the runs' training loss (lines) and held-out loss (markers) against steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for run in runs:
        if run.curve:
            line = ax.plot(*zip(*run.curve, strict=True), label=f"{run.path.name} (train)")[0]
            if run.eval_curve:
                ax.plot(*zip(*run.eval_curve, strict=True), "o--", color=line.get_color(),
                        label=f"{run.path.name} (held-out)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("loss: " + " vs ".join(r.path.name for r in runs))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(out)
    fig.savefig(path)
    plt.close(fig)
    return path
