"""Measured next to predicted: per stage time per micro-batch, the pipeline bubble, state bytes per rank.

The measured bubble is defined as the cost model defines its own: a pipeline step of ``m`` micro-batches takes
``m × t_stage`` on its busiest stage plus the bubble, so the bubble fraction is ``1 - busiest stage's compute /
step wall time`` (the step wall time of the slowest rank of the replica): everything but the busiest stage's own
work, so the waits for point-to-point transfers count as bubble. The prediction is defined the same way on the
cost model's estimate of the same group: ``1 - (compute + memory) / step time`` (the slowest stage's own work;
its fill/drain bubble and its p2p time are the rest). The time per micro-batch is the estimate's compute + memory
over its micro-batch count; state bytes are its weights + gradients + optimizer state per device.
Predictions are None where the cost model cannot estimate the plan (a device kind it does not know).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from starverse.runtime.parallel.pipeline_layout import PipelineLayout


@dataclass(frozen=True)
class StageReport:
    """One pipeline stage of one replica, measured, beside the cost model's prediction."""

    group: int
    """Group index in the plan."""
    replica: int
    """Replica index (over all groups)."""
    stage: int
    """Stage index in the pipeline."""
    rank: int
    """The rank that ran it."""
    device_kind: str
    """Its accelerator id."""
    layers: int
    """Layers it held."""
    time_per_micro_batch_s: float
    """Measured forward + backward compute per micro-batch (mean over steps)."""
    state_bytes: int
    """Measured bytes of parameters, gradients and optimizer state on the rank."""
    peak_activation_bytes: int
    """Measured peak device memory above the state (0 where the device has no counter, e.g. CPU)."""
    predicted_time_per_micro_batch_s: float | None
    """The cost model's time per micro-batch of the group's slowest stage (None: no estimate)."""
    predicted_state_bytes: float | None
    """The cost model's weights + gradients + optimizer bytes per device of this stage (None: no estimate)."""
    loaded_tensors: int = 0
    """Tensors the rank read from the model folder for this stage (per-stage loading; 0: whole model cut)."""


@dataclass(frozen=True)
class PipelineReport:
    """The pipeline part of a fit's summary."""

    stages: tuple[StageReport, ...]
    """Every stage of every replica."""
    bubble: float
    """Measured bubble fraction (mean over replicas; see the module docstring)."""
    predicted_bubble: float | None
    """The cost model's bubble fraction, defined as the measured one (step-weighted over groups; None: no
    estimate)."""

    def summary_lines(self) -> list[str]:
        """Human-readable lines for the CLI."""
        pred = f"{self.predicted_bubble:.1%}" if self.predicted_bubble is not None else "n/a"
        lines = [f"  pipeline bubble: measured {self.bubble:.1%}, predicted {pred}"]
        for s in self.stages:
            pt = s.predicted_time_per_micro_batch_s
            ps = s.predicted_state_bytes
            lines.append(
                f"  group {s.group} replica {s.replica} stage {s.stage} (rank {s.rank} {s.device_kind}, "
                f"{s.layers} layers): {s.time_per_micro_batch_s * 1e3:.2f} ms/micro-batch"
                + (f" (predicted {pt * 1e3:.2f})" if pt is not None else "")
                + f", state {s.state_bytes / 2**20:.2f} MiB"
                + (f" (predicted {ps / 2**20:.2f})" if ps is not None else "")
            )
        return lines

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly copy (``train --json``)."""
        return {"bubble": self.bubble, "predicted_bubble": self.predicted_bubble,
                "stages": [dict(s.__dict__) for s in self.stages]}


def pipeline_report(layout: PipelineLayout, results: Sequence[Any], kinds: Sequence[str], estimate: Any) -> PipelineReport:
    """The report from every rank's :class:`~starverse.runtime.rank_loop.RankResult` and the plan's estimate."""
    groups = list(getattr(estimate, "groups", None) or [])
    stages: list[StageReport] = []
    bubbles: list[float] = []
    for replica, ranks in enumerate(layout.replica_ranks):
        g = layout.replica_group[replica]
        ge = groups[g] if g < len(groups) else None
        step = max(results[r].pipeline_step_s for r in ranks)
        busiest = max(results[r].pipeline_busy_s for r in ranks)
        bubbles.append(max(0.0, 1.0 - busiest / step) if step > 0 else 0.0)
        for r in ranks:
            res, place = results[r], layout.places[r]
            micro = res.num_chunk_runs // max(1, layout.virtual_stages)
            stages.append(StageReport(
                group=g, replica=replica, stage=place.stage, rank=r, device_kind=kinds[r],
                layers=layout.stage_layers[g][place.stage],
                time_per_micro_batch_s=res.pipeline_busy_s / micro if micro else 0.0,
                state_bytes=res.state_bytes, peak_activation_bytes=res.peak_activation_bytes,
                predicted_time_per_micro_batch_s=_per_micro(ge),
                predicted_state_bytes=_state_bytes(ge, place.stage),
                loaded_tensors=getattr(res, "loaded_tensors", 0),
            ))
    predicted = None
    if groups:
        total = sum(ge.step_time_s for ge in groups)
        if total > 0:
            own = sum(ge.breakdown.get("compute", 0.0) + ge.breakdown.get("memory", 0.0) for ge in groups)
            predicted = max(0.0, 1.0 - own / total)
    return PipelineReport(tuple(stages), sum(bubbles) / len(bubbles) if bubbles else 0.0, predicted)


def _per_micro(ge: Any) -> float | None:
    if ge is None or not ge.num_micro_batches:
        return None
    parts = ge.breakdown
    return float(parts.get("compute", 0.0) + parts.get("memory", 0.0)) / ge.num_micro_batches


def _state_bytes(ge: Any, stage: int) -> float | None:
    if ge is None or stage >= len(ge.stages):
        return None
    s = ge.stages[stage]
    return float(s.weights_gb + s.grads_gb + s.optimizer_gb) * 1e9
