"""Built-in callbacks of every fit: held-out evaluation, the run's logs, and progress on the terminal.

- :class:`EvalCallback`: every ``every`` steps and at the end, every rank scores its slice of the held-out
  sequences; the token-loss sums and target counts are summed over all ranks, so the eval loss is the exact
  mean token loss of the whole held-out split (perplexity = exp of it). Published as ``ctx.extra["eval"]``;
  rank 0 writes the last one to ``RUN_DIR/eval.json`` (``FitResult.eval_loss`` reads it).
- :class:`RunLogCallback` (rank 0): ``RUN_DIR/metrics.jsonl``, one JSON line per step (``"type": "step"``)
  and per event (``"type": "event"``: start, eval, checkpoint, stop, end), and TensorBoard event files under
  ``RUN_DIR/tensorboard`` (``tensorboard --logdir RUN_DIR``).
- :class:`ProgressCallback` (rank 0): a rich progress bar (step, loss, tokens/s, shares, ETA) when stderr is a
  terminal, else one plain log line every ``every`` steps.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from starverse.runtime.callbacks import Callback, TrainContext
from starverse.runtime.data import IGNORE_INDEX, PackedDataset
from starverse.runtime.steps import autocast_dtype, batch_loss

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
"""One JSON object per line: steps and events of the run (appended across resumes)."""
EVAL_FILE = "eval.json"
"""The last evaluation of the run (rank 0)."""
TENSORBOARD_DIR = "tensorboard"
"""TensorBoard event files of the run."""


class EvalCallback(Callback):
    """Held-out loss and perplexity every ``every`` steps (0: only at the end) and at the end."""

    def __init__(self, tokens_path: Path, seq_len: int, *, every: int = 0, micro_batch: int = 1,
                 labels_path: Path | None = None, precision: str = "fp32"):
        self.tokens_path, self.labels_path = tokens_path, labels_path
        self.seq_len, self.every, self.micro_batch, self.precision = seq_len, every, micro_batch, precision
        self.data: PackedDataset | None = None
        self.last: dict[str, Any] | None = None

    def on_fit_start(self, ctx: TrainContext) -> None:
        """Open the held-out split."""
        labels = np.load(self.labels_path, mmap_mode="r") if self.labels_path else None
        self.data = PackedDataset(np.load(self.tokens_path, mmap_mode="r"), self.seq_len, labels)

    def evaluate(self, ctx: TrainContext) -> dict[str, Any]:
        """Mean token loss over the held-out split, all ranks together (sequences split round-robin)."""
        import torch.distributed as dist

        assert self.data is not None
        total = ctx.held_out_scorer(self.data) if ctx.held_out_scorer is not None else self._score_slice(ctx)
        if ctx.world_size > 1:
            dist.all_reduce(total, group=ctx.group)
        loss = float(total[0] / total[1]) if total[1] > 0 else float("nan")
        out = {"step": ctx.step, "loss": loss, "perplexity": math.exp(min(loss, 700.0)),
               "tokens": int(total[1]), "sequences": len(self.data)}
        ctx.extra["eval"] = out
        self.last = out
        return out

    def _score_slice(self, ctx: TrainContext) -> torch.Tensor:
        """``[loss sum, labelled tokens]`` of this rank's round-robin slice, scored by ``ctx.model``."""
        assert self.data is not None
        model = ctx.model
        was_training = model.training
        model.eval()
        amp = autocast_dtype(self.precision, ctx.device)
        mine = np.arange(ctx.rank, len(self.data), ctx.world_size)
        total = torch.zeros(2, dtype=torch.float64)
        with torch.no_grad():
            for i in range(0, len(mine), self.micro_batch):
                idx = mine[i : i + self.micro_batch]
                x = torch.from_numpy(self.data.batch(idx)).to(ctx.device)
                lab = self.data.batch_labels(idx)
                y = x if lab is None else torch.from_numpy(lab).to(ctx.device)
                with torch.autocast(ctx.device.type, dtype=amp, enabled=amp is not None):
                    s = batch_loss(model, x, labels=y, num_targets=1)
                total += torch.tensor([float(s), float((y[:, 1:] != IGNORE_INDEX).sum())], dtype=torch.float64)
        model.train(was_training)
        return total

    def on_step_end(self, ctx: TrainContext) -> None:
        """Evaluate every ``every`` steps (not at the last step: ``on_fit_end`` does)."""
        if self.every and ctx.step % self.every == 0 and ctx.step < ctx.max_steps:
            self.evaluate(ctx)

    def on_fit_end(self, ctx: TrainContext) -> None:
        """The final evaluation, also written to ``RUN_DIR/eval.json`` by rank 0."""
        out = self.evaluate(ctx)
        if ctx.rank == 0:
            (ctx.run_dir / EVAL_FILE).write_text(json.dumps(out))


class RunLogCallback(Callback):
    """``metrics.jsonl`` and TensorBoard event files of the run (rank 0; see the module docstring)."""

    def __init__(self, tensorboard: bool = True):
        self.tensorboard = tensorboard
        self._file: Any = None
        self._tb: Any = None
        self._eval_step: int | None = None
        self._ckpt_step: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__ | {"_file": None, "_tb": None}

    def event(self, ctx: TrainContext, name: str, **fields: Any) -> None:
        """Append one event line."""
        if self._file is not None:
            self._write({"type": "event", "event": name, "step": ctx.step, "time": time.time(), **fields})

    def _write(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps(row, default=_jsonable) + "\n")
        self._file.flush()

    def on_fit_start(self, ctx: TrainContext) -> None:
        """Open the files (appending: a resumed run continues its log)."""
        if ctx.rank != 0:
            return
        self._file = (ctx.run_dir / METRICS_FILE).open("a", encoding="utf-8")
        if self.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # the tensorboard package is an optional extra
                log.warning("no TensorBoard logs (%s); metrics.jsonl is still written", e)
            else:
                self._tb = SummaryWriter(str(ctx.run_dir / TENSORBOARD_DIR))
        trainable = sum(p.numel() for p in ctx.model.parameters() if p.requires_grad)
        self.event(ctx, "start", world_size=ctx.world_size, device_kinds=ctx.rank_kinds, max_steps=ctx.max_steps,
                   mode=ctx.plan.train.mode, trainable_params=trainable,
                   params=sum(p.numel() for p in ctx.model.parameters()))

    def on_step_end(self, ctx: TrainContext) -> None:
        """One step line, and events for an evaluation or a checkpoint published this step."""
        if self._file is None:
            return
        m = ctx.metrics
        self._write({"type": "step", "step": ctx.step, "time": time.time(), "loss": m.loss, "lr": m.lr,
                     "grad_norm": m.grad_norm, "tokens_per_s": m.tokens_per_s, "step_time_s": m.step_time_s,
                     "tokens_total": m.tokens_total, "shares": m.shares, "mfu": m.mfu})
        scalars = {"train/loss": m.loss, "train/lr": m.lr, "train/grad_norm": m.grad_norm,
                   "perf/tokens_per_s": m.tokens_per_s, "perf/step_time_s": m.step_time_s}
        self._eval_and_checkpoint(ctx, scalars)
        if self._tb is not None:
            for k, v in scalars.items():
                if v is not None and math.isfinite(v):
                    self._tb.add_scalar(k, v, ctx.step)

    def _eval_and_checkpoint(self, ctx: TrainContext, scalars: dict[str, float]) -> None:
        ev = ctx.extra.get("eval")
        if isinstance(ev, dict) and ev.get("step") != self._eval_step:
            self._eval_step = ev["step"]
            self.event(ctx, "eval", **{k: v for k, v in ev.items() if k != "step"})
            scalars.update({"eval/loss": ev["loss"], "eval/perplexity": ev["perplexity"]})
        ck = ctx.committed
        if ck is not None and ck.step != self._ckpt_step:
            self._ckpt_step = ck.step
            self.event(ctx, "checkpoint", at_s=ck.at_s, seconds=ck.seconds, path=ck.path, reason=ck.reason)

    def on_fit_end(self, ctx: TrainContext) -> None:
        """The final evaluation (if any), the end event; close the files."""
        if self._file is None:
            return
        scalars: dict[str, float] = {}
        self._eval_and_checkpoint(ctx, scalars)
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, ctx.step)
            self._tb.close()
        self.event(ctx, "end", stop_reason=ctx.stop_reason, loss=ctx.metrics.loss,
                   tokens_total=ctx.metrics.tokens_total)
        self._file.close()
        self._file = None


def _jsonable(v: Any) -> Any:
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, Path):
        return str(v)
    return repr(v)


class ProgressCallback(Callback):
    """Progress of the fit on rank 0: a rich bar on a terminal, else a plain line every ``every`` steps."""

    def __init__(self, every: int = 10, tty: bool | None = None):
        self.every = every
        self.tty = tty
        self._bar: Any = None
        self._task: Any = None
        self._t0 = 0.0
        self._start_step = 0

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__ | {"_bar": None, "_task": None}

    def on_fit_start(self, ctx: TrainContext) -> None:
        """Start the bar (or the plain logger) on rank 0."""
        if ctx.rank != 0:
            return
        self._t0, self._start_step = time.perf_counter(), ctx.step
        tty = sys.stderr.isatty() if self.tty is None else self.tty
        if tty:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                                 TimeRemainingColumn(), console=Console(stderr=True), transient=False)
            self._task = self._bar.add_task("train", total=ctx.max_steps, completed=ctx.step, info="")
            self._bar.start()
        elif not _plain_log.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(message)s"))
            _plain_log.addHandler(handler)
            _plain_log.setLevel(logging.INFO)
            _plain_log.propagate = False

    def line(self, ctx: TrainContext) -> str:
        """``step 10/100 loss 3.2104 tokens/s 1,234 shares [3, 1] eta 12s`` (+ the last eval)."""
        m = ctx.metrics
        done = ctx.step - self._start_step
        rate = done / (time.perf_counter() - self._t0) if done else 0.0
        eta = (ctx.max_steps - ctx.step) / rate if rate > 0 else float("nan")
        ev = ctx.extra.get("eval")
        text = f"loss {m.loss:.4f} tokens/s {m.tokens_per_s:,.0f} shares {m.shares}"
        if isinstance(ev, dict):
            text += f" eval {ev['loss']:.4f} (ppl {ev['perplexity']:.2f} @{ev['step']})"
        return text if self._bar is not None else (
            f"step {ctx.step}/{ctx.max_steps} {text} eta {eta:.0f}s" if math.isfinite(eta) else f"step {ctx.step} {text}")

    def on_step_end(self, ctx: TrainContext) -> None:
        """Advance the bar, or log a plain line every ``every`` steps (and the first and last)."""
        if ctx.rank != 0:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=ctx.step, info=self.line(ctx))
        elif ctx.step == self._start_step + 1 or ctx.step % max(1, self.every) == 0 or ctx.step == ctx.max_steps:
            _plain_log.info("%s", self.line(ctx))

    def on_fit_end(self, ctx: TrainContext) -> None:
        """Stop the bar; log the final evaluation."""
        if ctx.rank != 0:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=ctx.step, info=self.line(ctx))
            self._bar.stop()
        ev = ctx.extra.get("eval")
        if isinstance(ev, dict) and self._bar is None:
            _plain_log.info("eval at step %d: loss %.4f, perplexity %.2f", ev["step"], ev["loss"], ev["perplexity"])


_plain_log = logging.getLogger("starverse.progress")
