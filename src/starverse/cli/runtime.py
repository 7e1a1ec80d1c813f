"""``starverse probe`` (measure this machine) and ``starverse demo`` (the whole job end to end, locally).

torch is imported inside the commands only: the CLI starts fast without it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from starverse.checks import check_output_file, check_port_free, check_run_dir
from starverse.cli.options import finite

DEMO_MODEL = "meta-llama/Llama-2-7b-hf"
"""The model the demo asks for (scaled down to what the local devices can train)."""


class RichProgress:
    """A rich progress bar on rank 0 (loss, tokens/s, ETA); the CLI installs it, library code never prints.

    It implements the :class:`starverse.runtime.callbacks.Callback` hooks without subclassing it: importing
    the runtime would import torch when the CLI starts.
    """

    def __init__(self, every: int = 1):
        self.every = every
        self._progress: Any = None
        self._task: Any = None

    def on_resume(self, ctx: Any, path: Path) -> bool:
        """Resuming is not this callback's business."""
        return False

    def on_micro_batch_end(self, ctx: Any, compute_s: float) -> None:
        """Nothing per micro-batch."""

    def on_fit_start(self, ctx: Any) -> None:
        """Open the bar on rank 0."""
        if ctx.rank != 0:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(), console=Console(highlight=False), transient=False,
        )
        self._progress.start()
        self._task = self._progress.add_task("train", total=ctx.max_steps, completed=ctx.step, info="")

    def on_step_end(self, ctx: Any) -> None:
        """Advance the bar with the step's loss, throughput and shares."""
        if self._progress is None or ctx.step % self.every:
            return
        m = ctx.metrics
        info = f"loss {m.loss:.3f}  {m.tokens_per_s:,.0f} tok/s  shares {m.shares}"
        self._progress.update(self._task, completed=ctx.step, info=info)

    def on_fit_end(self, ctx: Any) -> None:
        """Close the bar."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __getstate__(self) -> dict[str, Any]:
        return {"every": self.every, "_progress": None, "_task": None}


def probe(
    out: Annotated[
        Path | None, typer.Option("--out", help="Profile path (default ~/.cache/starverse/profile.json; with "
                                  "--plan: <accelerator>-model-profile.json).")
    ] = None,
    ranks: Annotated[
        int | None, typer.Option("--ranks", help="CPU ranks to measure when there is no GPU (default 2).")
    ] = None,
    quick: Annotated[bool, typer.Option("--quick", help="Short measurements (a few seconds; less precise).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the profile as JSON.")] = False,
    plan_file: Annotated[
        Path | None, typer.Option("--plan", help="Measure this plan's model per layer at its micro-batch, sequence "
                                  "length, TP and precision (a model profile for estimate/validate/plan).",
                                  show_default=False)
    ] = None,
    model: Annotated[
        str | None, typer.Option("--model", help="Model of the profile (default: the plan's).", show_default=False)
    ] = None,
) -> None:
    """Measure local devices (matmul TFLOPS per precision, memory and all-reduce bandwidth); write the profile.
    With --plan: per-layer forward/backward times of the plan's model (a model profile, docs/costmodel.md)."""
    from starverse.catalog import default_profile_path
    from starverse.providers.local import local_ranks
    from starverse.runtime.probe import probe as run_probe

    if out is not None:
        check_output_file(out, "--out")  # before measuring for seconds
    if ranks is not None:
        _check_demo_args({"--ranks": ranks}, 1, 1, 1)
    if plan_file is not None or model is not None:
        _probe_model(plan_file, model, out, ranks, quick, as_json)
        return
    result = run_probe(local_ranks(ranks), quick=quick)
    path = result.write(out or default_profile_path())
    if as_json:
        typer.echo(json.dumps(result.profile(), indent=2))
        return
    console = Console(highlight=False)
    for kind, figs in result.accelerators.items():
        console.print(f"[bold]{kind}[/bold] ({result.num_ranks} ranks, figures per rank)")
        for k, v in figs.items():
            console.print(f"  {k:22s} {v:10.3f}")
    console.print(f"profile written to {path}")


def _probe_model(plan_file: Path | None, model: str | None, out: Path | None, ranks: int | None, quick: bool,
                 as_json: bool) -> None:
    """``probe --plan P [--model M]``: write a model profile of this machine's device kind."""
    from starverse.costmodel.validate import load_plan_or_case
    from starverse.errors import ConfigError
    from starverse.models import load_model
    from starverse.providers.local import local_ranks
    from starverse.runtime.probe import probe as run_probe
    from starverse.runtime.probe import probe_model, write_json

    if plan_file is None:
        raise ConfigError("probe --model: also pass --plan PLAN.yaml (its micro-batch, sequence length, TP and "
                          "precision are what gets measured)")
    plan = load_plan_or_case(plan_file)
    spec = load_model(model or plan.model, base_dir=plan_file.parent)
    local = local_ranks(ranks)
    links: dict[str, float] = {}
    if len(local) > 1:
        figures = run_probe(local, quick=True).accelerators.get(local[0].device_kind, {})
        if "intra_node_gb_per_s" in figures:
            links["intra_node"] = figures["intra_node_gb_per_s"]
    doc = probe_model(plan, spec, local[0].device_kind, local[0].device, repeats=2 if quick else 5,
                      links_gb_per_s=links)
    path = write_json(doc, out or Path(f"{local[0].device_kind}-model-profile.json"))
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
        return
    console = Console(highlight=False)
    for e in doc["entries"]:
        console.print(f"micro-batch {e['micro_batch']} x {e['seq_len']} tokens, tp {e['tp']}, {e['precision']}: "
                      f"layer {e['layer_forward_s'] * 1e3:.2f} + {e['layer_backward_s'] * 1e3:.2f} ms, "
                      f"head {e['head_forward_s'] * 1e3:.2f} + {e['head_backward_s'] * 1e3:.2f} ms")
    console.print(f"model profile of {doc['accelerator']} written to {path}; name it in a plan as "
                  f"network.profiles.{doc['accelerator']}")


def _ensure_profile(console: Console, run_dir: Path, ranks: int) -> str:
    """Plan on measured figures: when no probe profile is in force, measure this machine quickly (a few
    seconds) into the run dir and use that profile for this run only. Returns what the estimate rests on."""
    from starverse.catalog import PROFILE_ENV, default_profile_path
    from starverse.providers.local import local_ranks
    from starverse.runtime.probe import probe as run_probe

    given = os.environ.get(PROFILE_ENV)
    if given == "":
        return "datasheet defaults (no probe profile)"
    if given or default_profile_path().is_file():
        return f"probe profile {given or default_profile_path()}"
    console.print("probe: no profile of this machine yet; measuring it (starverse probe --quick)", markup=False)
    path = run_probe(local_ranks(ranks), quick=True).write(run_dir / "profile.json")
    os.environ[PROFILE_ENV] = str(path)
    return f"probe profile {path} (quick; `starverse probe` for a precise one)"


def _demo_corpus(run_dir: Path, max_bytes: int) -> Path:
    """A .jsonl of the Python standard library's own top-level modules (text every machine has)."""
    stdlib = Path(os.__file__).parent
    out = run_dir / "stdlib-corpus.jsonl"
    total = 0
    with out.open("w") as fh:
        for f in sorted(stdlib.glob("*.py")):
            text = f.read_text(encoding="utf-8", errors="replace")
            fh.write(json.dumps({"text": text}) + "\n")
            total += len(text)
            if total >= max_bytes:
                break
    return out


MAX_CORPUS_MB = 100_000
"""Largest ``--corpus-mb`` (the standard library's sources are far smaller: the corpus is all of them)."""


def _check_demo_args(counts: dict[str, int], corpus_mb: float, batch: int, global_batch: int) -> None:
    """Refuse bad demo (and probe) options before anything runs (the machine probe takes seconds, and a run folder
    is made): one line naming the option. ``--ranks`` is at most ``max_cpu_ranks()`` (one process each)."""
    from starverse.config import MAX_BATCH, MAX_SEQ_LEN, MAX_STEPS
    from starverse.errors import ConfigError
    from starverse.runtime.devices import max_cpu_ranks

    most = {"--steps": MAX_STEPS, "--ranks": max_cpu_ranks(), "--seq-len": MAX_SEQ_LEN, "--batch": MAX_BATCH,
            "--global-batch": MAX_BATCH}
    for name, value in counts.items():
        if value < 1:
            raise ConfigError(f"{name}: must be at least 1 (got {value}). To fix: pass {name} 1 or more")
        if value > most.get(name, value):
            raise ConfigError(f"{name}: must be at most {most[name]:,} (got {value:,}). To fix: pass a smaller {name}")
    if not 0 < corpus_mb <= MAX_CORPUS_MB:
        raise ConfigError(f"--corpus-mb: must be > 0 and at most {MAX_CORPUS_MB:,} (got {corpus_mb}). To fix: pass "
                          "a size such as 0.3")
    if global_batch % batch:
        raise ConfigError(f"--global-batch {global_batch} is not a multiple of --batch {batch}. "
                          "To fix: choose a --batch that divides --global-batch")


def demo(
    steps: Annotated[int, typer.Option("--steps", help="Optimizer steps.")] = 200,
    ranks: Annotated[int, typer.Option("--ranks", help="CPU ranks (when there is no GPU).")] = 2,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens per sequence.")] = 128,
    batch: Annotated[int, typer.Option("--batch", help="Sequences per micro-batch.")] = 2,
    global_batch: Annotated[int, typer.Option("--global-batch", help="Sequences per step.")] = 16,
    max_params: Annotated[int, typer.Option("--max-params", help="Largest model to train here.")] = 3_000_000,
    run_dir: Annotated[Path | None, typer.Option(
        "--run-dir", help="Where the run writes its files (default: a new runs/demo/<UTC time>).",
        show_default=False)] = None,
    corpus_mb: Annotated[float, typer.Option("--corpus-mb", callback=finite, help="MB of stdlib source to train on.")] = 2.0,
    checkpoint_every: Annotated[int, typer.Option("--checkpoint-every", min=1,
                                                  help="Steps between checkpoints.")] = 50,
    pool: Annotated[Path | None, typer.Option(
        "--pool", help="Price the local devices from this pool file (e.g. examples/train/pool.yaml); "
                       "default: free (your own machine).", show_default=False)] = None,
    metrics_port: Annotated[int, typer.Option("--metrics-port", min=0, max=65535,
                                              help="Prometheus on 127.0.0.1 (0: a free port).")] = 0,
) -> None:
    """The main job end to end on this machine: plan on the local devices, train a small Llama-style model with
    hetero DP (checkpoints, per-second ledger, Prometheus metrics), print the summary and the bill."""
    from datetime import UTC, datetime

    import starverse
    from starverse.billing.ledger import LEDGER_FILE
    from starverse.checkpoint.callback import CheckpointCallback
    from starverse.cli.checkpoints import print_bill
    from starverse.elastic.job import lease_prices
    from starverse.errors import ConfigError
    from starverse.jobs.ledger import job_bill
    from starverse.metrics.callbacks import ENDPOINT_FILE, BillingCallback, MetricsCallback
    from starverse.runtime.trainer import Trainer

    _check_demo_args({"--steps": steps, "--ranks": ranks, "--seq-len": seq_len, "--batch": batch,
                      "--global-batch": global_batch, "--max-params": max_params}, corpus_mb, batch, global_batch)
    console = Console(highlight=False, soft_wrap=True)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    run_dir = (run_dir or Path("runs") / "demo" / stamp).resolve()
    check_run_dir(run_dir, "", option="--run-dir")
    check_port_free(metrics_port, "--metrics-port")
    if any((run_dir / "checkpoints").glob("step-*")):
        raise ConfigError(
            f"{run_dir}: already holds the checkpoints of an earlier run; the demo trains from scratch. "
            "To fix: pass another --run-dir, or omit it (each demo then gets its own runs/demo/<UTC time>)."
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    basis = _ensure_profile(console, run_dir, ranks)
    cluster = starverse.accelerate(
        model_id=DEMO_MODEL, num_cpu_ranks=ranks, seq_len=seq_len, global_batch=global_batch, max_params=max_params
    )
    prices = lease_prices([r.device_kind for r in cluster.ranks], pool=str(pool) if pool else None,
                          source="--pool")
    console.print("[bold]cluster[/bold]")
    for line in cluster.summary_lines():
        console.print(f"  {line}", markup=False)
    est = cluster.estimate
    if est is not None:
        console.print(
            f"  estimate: step {est.step_time_s:.3f} s, {est.tokens_per_s:,.0f} tokens/s, bottleneck {est.bottleneck}",
            markup=False,
        )
    console.print(f"  leases: {prices.cost_per_hour.normalize():f} {prices.currency}/h; "
                  + "; ".join(prices.lines), markup=False)
    with cluster.mixed_mesh():
        model = starverse.build_model(cluster.model_config)
    corpus = _demo_corpus(run_dir, int(corpus_mb * 1e6))
    job_name = f"demo-{stamp}"
    billing = BillingCallback(job=job_name, ledger_path=run_dir / LEDGER_FILE, currency=prices.currency,
                              prices=prices.prices)
    ckpt = CheckpointCallback(run_dir / "checkpoints", interval_steps=checkpoint_every, keep_last=2,
                              billing_cursor=billing.checkpoint_cursor)
    metrics = MetricsCallback(job=billing.job_name, port=metrics_port, checkpoints=ckpt, billing=billing)
    console.print(f"  metrics: Prometheus on 127.0.0.1:{metrics_port or '<free port>'} while training "
                  f"(URL in {run_dir / ENDPOINT_FILE})", markup=False)
    # billing after the checkpoint callback (it records the checkpoint of the same step), metrics after billing
    callbacks: list[Any] = [ckpt, billing, metrics, RichProgress()]  # RichProgress: a Callback by its hooks
    trainer = Trainer(cluster, callbacks=callbacks, run_dir=run_dir, lr=1e-3,
                      rebalance_every=20)
    result = trainer.fit(model, dataset=corpus, per_device_batch_size=batch, max_steps=steps, seq_len=seq_len)
    console.print("[bold]summary[/bold]")
    for line in result.summary_lines():
        console.print(f"  {line}", markup=False)
    if est is not None and result.step_time_s > 0:
        console.print(
            f"  cost model: predicted step {est.step_time_s:.3f} s vs measured {result.step_time_s:.3f} s "
            f"({est.step_time_s / result.step_time_s - 1:+.0%}; {basis})",
            markup=False,
        )
    print_bill(console, job_bill(run_dir / LEDGER_FILE, job_name))
    if pool is None:
        console.print("  (your own devices are free; `starverse demo --pool examples/train/pool.yaml` prices them "
                      "as rented spot CPUs)", markup=False)
    console.print("[bold]files[/bold]")
    console.print(f"  run dir:     {run_dir}", markup=False)
    console.print(f"  checkpoints: {run_dir / 'checkpoints'}  (starverse checkpoints list {run_dir})", markup=False)
    console.print(f"  ledger:      {run_dir / LEDGER_FILE}  (starverse bill {run_dir})", markup=False)
    console.print(f"  model:       {run_dir / 'final_model.pt'}", markup=False)
    sys.stdout.flush()


def register(app: typer.Typer) -> None:
    """Add ``probe`` and ``demo``."""
    app.command()(probe)
    app.command()(demo)
