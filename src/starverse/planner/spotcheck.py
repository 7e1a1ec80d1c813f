"""The planner's spot overhead checked against a trace-driven simulation of the plan.

:func:`~starverse.planner.policy.spot_factor` (Young/Daly, independent losses) ranks plans in the search.
For a plan whose spot offers carry a preemption trace, :func:`checked_factor` simulates the plan on those
traces (:mod:`~starverse.planner.simulate`: correlated losses, replacement delays) with the same checkpoint
cost, interval and restart time, and the simulated median is what the plan reports when the two differ by
more than :data:`TOLERANCE`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from starverse.elastic.interval import young_daly_interval_s
from starverse.errors import InfeasiblePlanError
from starverse.plan import Plan
from starverse.planner.pool import Offer
from starverse.planner.simulate import Policy, SimJob, SimResult, Trace, simulate

TOLERANCE = 0.10
"""Relative difference between the formula and the simulated median above which the simulation is used."""
CHECK_RUNS = 1000
"""Simulated jobs per check in the planner (the ``simulate`` command defaults to more)."""


@dataclass(frozen=True)
class CheckedFactor:
    """The spot factor a plan reports, and where it comes from."""

    factor: float
    """The figure used (the formula's, or the simulated median when they differ by more than 10 %)."""
    formula: float
    """Young/Daly's figure."""
    simulated: float | None
    """Simulated median (None when no trace was given)."""

    @property
    def source(self) -> str:
        """``young-daly`` or ``simulated``."""
        return "simulated" if self.simulated is not None and self.factor == self.simulated else "young-daly"


def sim_job(work_s: float, num_devices: int, interruptions_per_hour: float, checkpoint_s: float, restart_s: float,
            step_s: float, price_per_hour: float, interval_s: float | None = None) -> SimJob:
    """The simulation's view of a plan; the checkpoint interval defaults to the one the running job would use
    (Young/Daly at the plan's expected interruption rate), as the planner's formula assumes."""
    if interval_s is None:
        mtbf = 3600.0 / interruptions_per_hour if interruptions_per_hour > 0 else math.inf
        interval_s = float(young_daly_interval_s(checkpoint_s, mtbf)) if math.isfinite(mtbf) else work_s
    return SimJob(work_s=work_s, num_devices=num_devices, checkpoint_s=checkpoint_s,
                  interval_s=max(interval_s, 1e-3), restart_s=restart_s, step_s=step_s,
                  price_per_hour=price_per_hour)


def traced(offers: Sequence[Offer], devices: Mapping[str, int]) -> list[tuple[Trace, int]] | None:
    """(trace, devices) of a plan's spot offers when every one of them has a trace, else None."""
    spot = [o for o in offers if o.interruptions_per_hour > 0 and devices.get(o.name, 0) > 0]
    if not spot or any(o.trace is None for o in spot):
        return None
    return [(o.trace, devices[o.name]) for o in spot if o.trace is not None]


def checked_factor(formula: float, job: SimJob, traces: list[tuple[Trace, int]] | None,
                   policy: Policy = "restart", runs: int = CHECK_RUNS) -> tuple[CheckedFactor, SimResult | None]:
    """The formula's factor, replaced by the simulated median when they differ by more than 10 %; infinite
    when the simulated jobs never finish (``simulate`` raises :class:`InfeasiblePlanError`)."""
    if traces is None:
        return CheckedFactor(formula, formula, None), None
    try:
        result = simulate(job, traces, policy=policy, runs=runs, seed=0)
    except InfeasiblePlanError:
        # the trace's losses come faster than this plan checkpoints and restarts: it never finishes there
        return CheckedFactor(math.inf, formula, math.inf), None
    sim = result.factor_p50
    use = sim if not math.isfinite(formula) or abs(formula / sim - 1.0) > TOLERANCE else formula
    return CheckedFactor(use, formula, sim), result


@dataclass(frozen=True)
class PlanSimulation:
    """``starverse simulate``: a plan replayed on a trace, with the planner's own figure beside it."""

    result: SimResult
    """Per simulated job: wall time, cost, redone work."""
    job: SimJob
    """What was simulated (work, checkpoint cost and interval, restart)."""
    interruptions_per_hour: float
    """The plan's expected losses per hour at the trace's per-device rate (independent losses)."""
    formula: float
    """The planner's Young/Daly factor for the same plan and trace rate."""
    policy: str
    """restart | in-place."""
    trace: str
    """The trace file."""

    @property
    def ratio(self) -> float:
        """Planner / simulated median (1 = the formula agrees with the trace)."""
        return self.formula / self.result.factor_p50


def simulate_plan(plan: Plan, trace: Trace, *, catalog: Any = None, spec: Any = None, policy: Policy = "restart",
                  runs: int = 1000, hours: float = 24.0, restart_s: float = 300.0, checkpoint_gb_per_s: float = 2.0,
                  interval_s: float | None = None, seed: int = 0) -> PlanSimulation:
    """Replay ``plan`` on ``trace`` (every device spot, one trace node = one device). The job's length is the
    plan's ``train.tokens``/``steps``, else ``hours`` of compute; checkpoint cost and restart as the planner
    charges them (``search.checkpoint_gb_per_s``, ``search.restart_s``)."""
    from starverse.catalog import load_catalog
    from starverse.costmodel import estimate
    from starverse.models import load_model
    from starverse.planner.build import checkpoint_bytes, trainable_params
    from starverse.planner.policy import checkpoint_seconds, spot_factor

    catalog = catalog if catalog is not None else load_catalog()
    spec = spec if spec is not None else load_model(plan.model)
    est = estimate(plan, catalog, spec)
    n = plan.num_devices
    t = plan.train
    tokens = t.tokens if t.tokens is not None else (t.steps * t.global_batch * t.seq_len if t.steps else None)
    work_s = tokens / float(est.tokens_per_s) if tokens is not None else hours * 3600.0
    dpn = plan.network.devices_per_node if plan.network is not None else {}
    nodes = 0
    for acc in plan.accelerators():
        count = sum(s.tp * s.repeat * g.replicas for g in plan.groups for s in g.stages if s.accelerator == acc)
        nodes += math.ceil(count / dpn.get(acc, catalog.accelerator(acc).devices_per_node))
    ckpt = checkpoint_seconds(checkpoint_bytes(trainable_params(spec, t.mode, t.lora_rank), t.precision), nodes,
                              checkpoint_gb_per_s)
    lam = n * trace.removals_per_node_hour
    price = float(est.cost_per_hour) if est.cost_per_hour is not None else math.nan
    job = sim_job(work_s, n, lam, ckpt, restart_s, float(est.step_time_s), price, interval_s)
    result = simulate(job, [(trace, n)], policy=policy, runs=runs, seed=seed)
    return PlanSimulation(result, job, lam, float(spot_factor(lam, ckpt, restart_s)), policy, trace.source)
