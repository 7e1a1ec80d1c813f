"""What ``Trainer.fit`` returns: :class:`FitResult` with a :class:`RankSummary` per rank, made from the ranks'
results (:func:`summarise`), and the peak TFLOPS each rank's MFU is measured against (:func:`peak_tflops`)."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from starverse.runtime.launch import RankSpec
from starverse.runtime.parallel.pipeline_report import PipelineReport
from starverse.runtime.rank_job import FitJob, RankResult
from starverse.runtime.runlog import EVAL_FILE

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankSummary:
    """What one rank did over the whole fit."""

    rank: int
    """The rank."""
    device_kind: str
    """Its accelerator id."""
    final_share: int
    """Micro-batches per step at the end."""
    tokens: int
    """Tokens this rank processed."""
    compute_s: float
    """Time spent in forward+backward."""
    tokens_per_s: float
    """Tokens per second of compute on this rank."""
    peak_tflops: float | None
    """The peak its MFU is measured against (probe profile, else datasheet); None if unknown."""
    mfu: float | None
    """Model FLOPs utilisation of its compute time (None without a peak)."""


@dataclass(frozen=True)
class FitResult:
    """The outcome of ``Trainer.fit``."""

    steps: int
    """Optimizer steps completed (including steps before a resume)."""
    final_loss: float
    """Mean loss of the last step over its global batch."""
    losses: tuple[float, ...]
    """Loss of every step of this fit, in order."""
    tokens_total: int
    """Tokens trained in total (including before a resume)."""
    wall_s: float
    """Wall time of the training loop (rank 0), without start-up."""
    tokens_per_s: float
    """Whole-job throughput over the steps of this fit, the first one excluded (start-up)."""
    mfu: float | None
    """Whole-job MFU: achieved model FLOP/s over the sum of the ranks' peaks (None if a peak is unknown)."""
    ranks: tuple[RankSummary, ...]
    """Per-rank summary."""
    shares_history: tuple[tuple[int, tuple[int, ...]], ...]
    """``(step, shares)`` at the start and at every change of shares."""
    micro_batch: int
    """Sequences per micro-batch."""
    global_batch: int
    """Sequences per optimizer step."""
    seq_len: int
    """Tokens per sequence."""
    stop_reason: str | None
    """Why training stopped early (None: reached max_steps)."""
    run_dir: Path
    """The run directory."""
    step_time_s: float
    """Median step time of this fit (first step excluded)."""
    step_times_s: tuple[float, ...] = ()
    """Wall time of every step of this fit (slowest rank), in order."""
    eval_loss: float | None = None
    """Mean token loss on the held-out split at the end (None: no held-out split, ``Trainer.eval_fraction``)."""
    eval_perplexity: float | None = None
    """``exp(eval_loss)``."""
    pipeline: PipelineReport | None = None
    """Per stage time per micro-batch, bubble and state bytes, beside the cost model's (None: no pipeline)."""

    def summary_lines(self) -> list[str]:
        """Human-readable summary (the CLI prints these)."""
        lines = [
            f"steps {self.steps}, final loss {self.final_loss:.4f}, {self.tokens_total:,} tokens, "
            f"{self.tokens_per_s:,.0f} tokens/s, step {self.step_time_s:.3f} s"
            + (f", MFU {self.mfu:.1%}" if self.mfu is not None else ", MFU n/a (no peak for a device kind)"),
        ]
        for r in self.ranks:
            mfu = f"{r.mfu:.1%} of {r.peak_tflops:.3g} TFLOPS" if r.mfu is not None and r.peak_tflops else "n/a"
            lines.append(
                f"  rank {r.rank} {r.device_kind}: share {r.final_share}/{self.global_batch // self.micro_batch} "
                f"micro-batches, {r.tokens_per_s:,.0f} tokens/s of compute, MFU {mfu}"
            )
        if len(self.shares_history) > 1:
            lines.append("  shares: " + " -> ".join(f"{list(s)}@{st}" for st, s in self.shares_history))
        if self.pipeline is not None:
            lines.extend(self.pipeline.summary_lines())
        if self.eval_loss is not None:
            lines.append(f"  held-out: loss {self.eval_loss:.4f}, perplexity {self.eval_perplexity:.2f}")
        if self.stop_reason:
            lines.append(f"  stopped early: {self.stop_reason}")
        return lines


def peak_tflops(kind: str, precision: str, device: str) -> float | None:
    """Peak dense TFLOPS of a device kind at ``precision`` (probe profile, else datasheet); None if unknown.

    CPU ranks compute in fp32 unless bf16 autocast was asked for, so their peak is the fp32 one.
    """
    try:
        from starverse.catalog import load_catalog

        acc = load_catalog().accelerator(kind)
    except Exception as e:  # a missing catalog entry only costs the MFU figure
        log.info("no peak TFLOPS for %s (%s): MFU not reported", kind, e)
        return None
    prec = "fp32" if device == "cpu" and precision != "bf16-cpu" else precision.replace("-cpu", "")
    try:
        value = float(acc.peak_tflops(prec))
    except Exception:
        return None
    return value if value > 0 and math.isfinite(value) else None


def summarise(
    results: list[RankResult], job: FitJob, ranks: list[RankSpec], pipeline: PipelineReport | None = None
) -> FitResult:
    """The fit's summary from the ranks' results (rank 0's losses, steps and shares; every rank's throughput)."""
    r0 = results[0]
    per_rank = []
    achieved = 0.0
    peaks = 0.0
    for res, spec, peak in zip(results, ranks, job.peaks_tflops, strict=True):
        tps = res.tokens / res.compute_s if res.compute_s > 0 else 0.0
        mfu = tps * job.flops_per_token / (peak * 1e12) if peak else None
        achieved += tps * job.flops_per_token
        peaks += peak or float("nan")
        per_rank.append(RankSummary(spec.rank, spec.device_kind, res.share, res.tokens, res.compute_s, tps, peak, mfu))
    ev = json.loads((job.run_dir / EVAL_FILE).read_text()) if (job.run_dir / EVAL_FILE).is_file() else None
    times = r0.step_times[1:] or r0.step_times
    step_s = float(np.median(times)) if times else float("nan")
    tokens_step = job.global_batch * job.seq_len
    tps_job = tokens_step * len(times) / sum(times) if times and sum(times) > 0 else 0.0
    mfu_job = tps_job * job.flops_per_token / (peaks * 1e12) if math.isfinite(peaks) and peaks > 0 else None
    return FitResult(
        steps=r0.step, final_loss=r0.losses[-1] if r0.losses else float("nan"), losses=r0.losses,
        tokens_total=r0.tokens_total, wall_s=r0.wall_s, tokens_per_s=tps_job, mfu=mfu_job,
        ranks=tuple(per_rank), shares_history=r0.shares_history,
        micro_batch=job.micro_batch, global_batch=job.global_batch, seq_len=job.seq_len,
        stop_reason=r0.stop_reason, run_dir=job.run_dir, step_time_s=step_s,
        step_times_s=r0.step_times, pipeline=pipeline,
        eval_loss=ev["loss"] if ev else None, eval_perplexity=ev["perplexity"] if ev else None,
    )
