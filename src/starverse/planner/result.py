"""What the planner returns: ranked plans with their estimates, and the search's own statistics."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from starverse.plan import Plan
from starverse.planner.job import Objective


@dataclass(frozen=True)
class RankedPlan:
    """One proposed plan: the Plan, the cost model's Estimate of it, and what it costs to rent."""

    plan: Plan
    """The plan, ready for ``--out`` / ``starverse estimate`` / the runtime."""
    estimate: Any
    """``costmodel.Estimate`` of ``plan`` (the numbers shown come from it)."""
    kind: str
    """``single`` (one accelerator), ``hetero-dp`` (groups of different accelerators) or ``hetero-pipeline``."""
    mode: str
    """full | lora | qlora."""
    alternative: bool
    """True when this is a fine-tuning alternative proposed because full training cannot fit."""
    devices: Mapping[str, int]
    """Devices rented per offer name."""
    cost_per_hour: float
    """Price of the rented devices per hour, in the result's currency."""
    tokens_per_s: float
    """Throughput while running (the cost model's)."""
    effective_tokens_per_s: float
    """Throughput after the spot checkpoint/lost-work overhead (= tokens_per_s on on-demand devices)."""
    spot_factor: float
    """Wall-time multiplier of spot interruptions (1 on on-demand devices): Young/Daly, or the simulated
    median when the spot offers carry traces and the two differ by more than 10 %."""
    power_kw: float
    """Power drawn by the rented devices, kW."""
    hours: float | None
    """Hours to finish the job (None when the job gives no tokens/steps)."""
    total_cost: float | None
    """Cost of the whole job with billing granularity (None without tokens/steps)."""
    objective_value: float
    """The objective, as "higher is better" (see ``policy.score``)."""
    notes: tuple[str, ...] = ()
    """Warnings and labels worth showing."""
    spot_factor_formula: float = 1.0
    """Young/Daly's factor (what the search ranked by); ``spot_factor`` differs when a simulation on the spot
    offers' traces disagreed by more than 10 %."""
    spot_factor_simulated: float | None = None
    """Median factor of the trace-driven simulation (None when the spot offers carry no trace)."""
    price_sources: Mapping[str, str] = field(default_factory=dict)
    """Offer name -> where its price comes from (the pool file's field, or the catalog offer with its date)."""
    host_memory_gb_per_node: Mapping[str, float] = field(default_factory=dict)
    """Offer name -> host RAM one node needs for the offloaded state, GB (empty when nothing is offloaded)."""

    @property
    def num_devices(self) -> int:
        """Devices rented."""
        return sum(self.devices.values())

    def layout(self) -> str:
        """Compact layout, e.g. ``rtx-4090: 2×[tp4 pp2 40L] mb1 | ZeRO-1 rc:full``; a heterogeneous pipeline
        lists its stage runs: ``1×[rtx-4090 tp8 19+19 → tpu-v5e tp2 6] mb1``; the interleaved schedule is named
        with its chunks per device (``interleaved v2``)."""
        parts = []
        for g in self.plan.groups:
            stages = g.expanded_stages()
            if len({s.accelerator for s in stages}) == 1:
                layers = _layers([s.layers for s in stages])
                tp = stages[0].tp
                parts.append(f"{stages[0].accelerator}: {g.replicas}×[tp{tp} pp{len(stages)} {layers}] "
                             f"mb{g.micro_batch}")
                continue
            runs: list[tuple[str, int, list[int]]] = []
            for s in stages:
                if runs and runs[-1][0] == s.accelerator and runs[-1][1] == s.tp:
                    runs[-1][2].append(s.layers)
                else:
                    runs.append((s.accelerator, s.tp, [s.layers]))
            body = " → ".join(f"{a} tp{t} {_layers(ls)}" for a, t, ls in runs)
            parts.append(f"{g.replicas}×[{body}] mb{g.micro_batch}")
        t = self.plan.train
        tail = f"ZeRO-{t.zero_stage} rc:{t.recompute}" + (f" off:{t.offload}" if t.offload != "none" else "")
        tail += f" interleaved v{t.virtual_stages}" if t.schedule == "interleaved" else ""
        return "; ".join(parts) + " | " + tail


def _layers(counts: list[int]) -> str:
    """Layers per stage, runs folded: ``[10, 10, 10]`` -> ``10L``, ``[3, 3, 2]`` -> ``3+3+2``,
    ``[3]*24 + [2]*8`` -> ``3L×24+2L×8``."""
    if len(set(counts)) == 1:
        return f"{counts[0]}L"
    if len(counts) <= 6:
        return "+".join(str(c) for c in counts)
    runs: list[list[int]] = []
    for c in counts:
        if runs and runs[-1][0] == c:
            runs[-1][1] += 1
        else:
            runs.append([c, 1])
    return "+".join(f"{c}L×{n}" if n > 1 else f"{c}L" for c, n in runs)


@dataclass
class SearchStats:
    """How much the search looked at (for benchmarks, ``--json`` and honesty about optimality).

    Filled in while the search runs (one instance per search, shared by its modes); the result keeps it.
    """

    options: int = 0
    """Group options enumerated."""
    evaluated_rows: int = 0
    """Rows sent through the batch cost model."""
    combinations: int = 0
    """Group combinations bounded."""
    exact_evaluations: int = 0
    """Combinations evaluated exactly (integer batch split)."""
    screened: bool = False
    """True when options were thinned before exact evaluation (large pools); the result is then exact
    only over the options kept."""
    proven_optimal: bool = True
    """False when the evaluation cap stopped branch and bound before the bound closed. Covers the exact
    space of single-accelerator plans and heterogeneous data parallelism; heterogeneous pipelines have
    their own flag (``pipelines_proven``)."""
    bound_gap: float = 0.0
    """Relative gap between the best bound left and the best plan (0 when proven optimal)."""
    hetero_pipelines: int = 0
    """Heterogeneous-pipeline plans found that beat the best single-kind / data-parallel plan (0 or 1 per
    training mode searched; :mod:`~starverse.planner.pipes`)."""
    pipeline_families: int = 0
    """(replicas, micro-batch, setting) families of heterogeneous pipelines bounded."""
    pipeline_nodes: int = 0
    """Branch-and-bound nodes (offer blocks) bounded in the heterogeneous-pipeline search."""
    pipeline_leaves: int = 0
    """Ordered pipelines whose layer split was solved exactly."""
    pipelines_proven: bool = True
    """False when the heterogeneous-pipeline search stopped at its leaf cap before its bound closed (the
    gap is then part of ``bound_gap``)."""
    pipelines_searched: bool = False
    """True when heterogeneous pipelines were part of the search (the pool has two kinds or more and the job
    allows pipelines)."""
    seconds: float = 0.0
    """Wall time of the search."""
    layout_refused: dict[str, int] = field(default_factory=dict)
    """Plans left out by the runtime layout rule (``policy.runtime_layout_rule``), by reason."""
    frontier_points: list[tuple[float, float, str]] = field(default_factory=list, repr=False, compare=False)
    """(hours, cost, label) of every plan evaluated exactly (the Pareto frontier is drawn from them)."""

    def to_json(self) -> dict[str, float | int | bool]:
        """The counters (not the frontier points) as a JSON-ready dict."""
        return {k: v for k, v in asdict(self).items() if k != "frontier_points"}


@dataclass(frozen=True)
class FrontierPoint:
    """A point of the time-vs-cost Pareto frontier (per job, or per 1e9 tokens without a job length)."""

    hours: float
    """Hours for the job (or per 1e9 tokens)."""
    cost: float
    """Cost for the job (or per 1e9 tokens)."""
    label: str
    """Short description of the devices."""


@dataclass(frozen=True)
class PlanResult:
    """Ranked plans, best first, with the search's statistics and Pareto frontier."""

    plans: tuple[RankedPlan, ...]
    """Best first by the objective."""
    objective: Objective
    """The objective used."""
    currency: str
    """Currency of every cost in the result."""
    model: str
    """Model id."""
    stats: SearchStats = field(default_factory=SearchStats)
    """Search statistics."""
    frontier: tuple[FrontierPoint, ...] = ()
    """Time-vs-cost Pareto frontier over the plans evaluated (ascending hours)."""
    per_job: bool = True
    """True when frontier/hours/costs are for the whole job (else per 1e9 tokens)."""
    notes: tuple[str, ...] = ()
    """Search-level remarks (e.g. "full training cannot fit; showing LoRA/QLoRA alternatives")."""

    @property
    def best(self) -> RankedPlan:
        """The chosen plan."""
        return self.plans[0]


def pareto_frontier(points: Sequence[tuple[float, float, str]]) -> tuple[FrontierPoint, ...]:
    """Time-vs-cost Pareto front (both minimised)."""
    out: list[FrontierPoint] = []
    best_cost = math.inf
    for h, cost, label in sorted(points):
        if cost < best_cost * (1 - 1e-9):
            out.append(FrontierPoint(h, cost, label))
            best_cost = cost
    return tuple(out)
