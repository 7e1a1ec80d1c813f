"""Objectives, constraints and the spot-interruption overhead (Young/Daly).

Spot overhead
-------------
Synchronous training stops whenever any of its spot devices is taken back. With ``n_i`` devices of offer
``i`` each lost at ``λ_i`` per device-hour, the job is interrupted at ``Λ = Σ n_i λ_i`` per hour
(mean time between failures ``M = 3600 / Λ`` seconds). Treating losses as independent is deliberately
conservative: real traces show correlated losses (Bamboo p3: 167 node removals at only 79 distinct times), so
fewer, bigger events; since one event costs a synchronous job the same whatever its size, counting every loss
as an event over-charges rather than under-charges (see :mod:`starverse.planner.traces`).

With a checkpoint costing ``C`` seconds and a restart costing ``R`` seconds, the interval ``τ`` is the one
the running job uses, Young/Daly (``τ ≈ sqrt(2 C M)``; ``starverse.elastic.interval.young_daly_interval_s``,
written once for the planner and the supervisor). Per unit of useful work the job then spends ``C / τ``
writing checkpoints, loses on average half an interval ``τ / 2`` plus ``R`` per failure, i.e.
``(τ/2 + R) / M`` (``interval.waste_fraction``). The wall-time multiplier is

    f = 1 + C/τ + (τ/2 + R)/M  (≈ 1 + sqrt(2 C / M) + R / M to first order)

which also multiplies the bill (lost device-hours are still paid). When ``C/τ`` alone exceeds one half
(``τ < 2C``: the job spends more time checkpointing than working) the offer is too unstable and ``f`` is
infinite. On-demand offers have ``Λ = 0`` and ``f = 1``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from starverse.elastic.interval import waste_fraction, young_daly_interval_s
from starverse.errors import ConfigError
from starverse.planner.job import Job, Objective
from starverse.planner.pool import Pool


@dataclass(frozen=True)
class SpotOverhead:
    """Young/Daly overhead of a set of rented devices."""

    interruptions_per_hour: float
    """Expected job interruptions per hour (Λ)."""
    checkpoint_s: float
    """Time to write one checkpoint (C)."""
    interval_s: float
    """Young's optimal checkpoint interval τ (inf when never interrupted)."""
    factor: float
    """Wall-time (and cost) multiplier f ≥ 1; inf when the devices are too unstable to make progress."""


def spot_factor(interruptions_per_hour: np.ndarray | float, checkpoint_s: np.ndarray | float,
                restart_s: float) -> np.ndarray:
    """Vectorised ``f = 1 + C/τ + (τ/2 + R)/M`` at the Young/Daly ``τ`` (inf where ``τ < 2C``); see the
    module docstring."""
    lam = np.asarray(interruptions_per_hour, dtype=float)
    c = np.asarray(checkpoint_s, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        mtbf_s = np.where(lam > 0, 3600.0 / np.maximum(lam, 1e-300), np.inf)
    f = 1.0 + waste_fraction(young_daly_interval_s(c, mtbf_s), c, mtbf_s, restart_s)
    return np.where(lam > 0, f, 1.0)


def spot_overhead(interruptions_per_hour: float, checkpoint_s: float, restart_s: float) -> SpotOverhead:
    """Scalar :func:`spot_factor` with its parts, for reports."""
    f = float(spot_factor(interruptions_per_hour, checkpoint_s, restart_s))
    tau = young_daly_interval_s(checkpoint_s, 3600.0 / interruptions_per_hour) if interruptions_per_hour > 0 else math.inf
    return SpotOverhead(interruptions_per_hour, checkpoint_s, tau, f)


def checkpoint_seconds(state_bytes: float, num_nodes: int, gb_per_s_per_node: float) -> float:
    """Time to write ``state_bytes`` of model+optimizer state, every node writing its shard in parallel."""
    return state_bytes / (max(num_nodes, 1) * gb_per_s_per_node * 1e9)


@dataclass(frozen=True)
class Limits:
    """A job's constraints in the pool's currency (None = no limit); :func:`within` is the one check."""

    budget_per_hour: float | None = None
    """Most the rented devices may cost per hour."""
    max_power_kw: float | None = None
    """Most power the devices may draw, kW."""
    deadline_hours: float | None = None
    """Latest finish, hours."""
    max_total_cost: float | None = None
    """Most the whole job may cost."""


@dataclass(frozen=True)
class Layout:
    """A plan's shape as :func:`runtime_layout_rule` reads it."""

    groups: tuple[tuple[tuple[int, int, str], ...], ...]
    """Per group, its pipeline stages in order as ``(layers, tp, collective backend)`` (``repeat`` unrolled)."""
    zero_stage: int
    """The plan's ZeRO stage."""
    offload: bool
    """Some state is offloaded to the host (FSDP2's offload policy)."""
    mode: str = "full"
    """The training mode (``full``, ``lora``, ``qlora``)."""


_TORCH_DEVICE = {"nccl": "cuda", "rccl": "cuda"}  # ROCm runs as torch's cuda device


def runtime_layout_rule(layout: Layout) -> str | None:
    """RUNTIME LAYOUT RULE: why ``starverse.runtime`` refuses a plan of this shape (None: it runs it); the planner
    keeps such plans out through :func:`within`. It mirrors the runtime's checks (``runtime.parallel``:
    ``check_pipeline_plan``, ``check_pipeline_parallel``, ``check_parallel_plan``, ``check_tensor_parallel_plan``):

    - tensor parallelism inside pipeline stages needs one ``tp`` in every stage of every group; without
      pipeline stages, TP runs in a plan of one group;
    - ZeRO over several groups without pipeline stages shares one mesh: one torch device type (CUDA kinds
      together, CPU ranks together);
    - FSDP2 (ZeRO-2/3, or ZeRO-1 with offload) over several pipelined groups needs every group to split the
      layers the same way, each stage's replicas of one device type (one mesh per stage spans the groups);
    - QLoRA (bitsandbytes' 4-bit base, ``runtime.lora``) runs on CUDA devices, one stage per group, TP 1, ZeRO 0-1
      without offload (``check_mode``, ``check_parallel_plan``, ``Trainer.fit``'s pipeline check).
    """
    groups = layout.groups
    pipelined = any(len(g) > 1 for g in groups)
    tps = {t for g in groups for _, t, _ in g}
    if layout.mode == "qlora":
        why = _qlora_rule(layout, pipelined, tps)
        if why is not None:
            return why
    if pipelined and len(tps) > 1:
        return "pipeline stages of different tp (the runtime needs one tp in a pipeline)"
    if not pipelined and len(groups) > 1 and tps != {1}:
        return "tensor parallelism over several data-parallel groups"
    if len(groups) < 2 or layout.zero_stage == 0:
        return None
    types = [tuple(_TORCH_DEVICE.get(b, b) for _, _, b in g) for g in groups]
    if not pipelined:
        if len({t for g in types for t in g}) > 1:
            return "ZeRO over groups of several device types"
        return None
    if layout.zero_stage >= 2 or layout.offload:
        if len({tuple(n for n, _, _ in g) for g in groups}) > 1:
            return "ZeRO-2/3 or offload over groups whose pipelines split the layers differently"
        if any(len(set(stage)) > 1 for stage in zip(*types, strict=True)):
            return "ZeRO-2/3 or offload over pipeline stages of several device types"
    return None


def _qlora_rule(layout: Layout, pipelined: bool, tps: set[int]) -> str | None:
    """The part of :func:`runtime_layout_rule` for QLoRA."""
    if any(_TORCH_DEVICE.get(b, b) != "cuda" for g in layout.groups for _, _, b in g):
        return "QLoRA on devices without CUDA (bitsandbytes' 4-bit weights)"
    if pipelined:
        return "QLoRA with pipeline stages"
    if tps != {1}:
        return "QLoRA with tensor parallelism"
    if layout.zero_stage >= 2 or layout.offload:
        return "QLoRA with ZeRO-2/3 or offload"
    return None


def note_layout_refusal(refused: dict[str, int], layout: Layout) -> None:
    """Count a plan :func:`within` left out by the runtime layout rule under its reason (for the explanation)."""
    why = runtime_layout_rule(layout)
    if why is not None:
        refused[why] = refused.get(why, 0) + 1


def within(limits: Limits, cost_per_hour: np.ndarray | float, power_kw: np.ndarray | float,
           hours: np.ndarray | float, total_cost: np.ndarray | float, layout: Layout | None = None) -> np.ndarray:
    """True where a plan (or, given lower bounds, every plan a bound stands for) keeps every limit.

    The single place the constraints are checked: the search's bounds (with lower bounds of hours and
    cost), its exact evaluation, the single-group frontier and the scalar re-estimate all call it. Budget
    and power get a relative tolerance of 1e-9 (a plan that spends exactly the budget is within it).
    ``layout``: the exact evaluation's plan shape, held to :func:`runtime_layout_rule` (what the runtime runs).
    """
    ok = np.ones(np.broadcast(np.asarray(cost_per_hour), np.asarray(power_kw), np.asarray(hours),
                              np.asarray(total_cost)).shape, dtype=bool)
    if layout is not None and runtime_layout_rule(layout) is not None:
        ok &= False
    if limits.budget_per_hour is not None:
        ok &= np.asarray(cost_per_hour) <= limits.budget_per_hour * (1 + 1e-9)
    if limits.max_power_kw is not None:
        ok &= np.asarray(power_kw) <= limits.max_power_kw * (1 + 1e-9)
    if limits.deadline_hours is not None:
        ok &= np.asarray(hours) <= limits.deadline_hours
    if limits.max_total_cost is not None:
        ok &= np.asarray(total_cost) <= limits.max_total_cost
    return ok


def score(objective: Objective, tokens_per_s: np.ndarray, cost_per_hour: np.ndarray,
          total_cost: np.ndarray, hours: np.ndarray) -> np.ndarray:
    """Objective value to MAXIMISE (vectorised): every objective is turned into "higher is better".

    - cost-performance: tokens per unit of money, ``tokens/s × 3600 / cost_per_hour``;
    - throughput: tokens/s;
    - cost: ``-total_cost`` of the job (billing granularity and spot overhead included);
    - time: ``-hours`` to finish the job.
    """
    tps = np.asarray(tokens_per_s, dtype=float)
    if objective == Objective.COST_PERFORMANCE:
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(tps > 0, tps * 3600.0 / np.asarray(cost_per_hour, dtype=float), 0.0)
    if objective == Objective.THROUGHPUT:
        return tps
    if objective == Objective.COST:
        return -np.asarray(total_cost, dtype=float)
    return -np.asarray(hours, dtype=float)


def describe(objective: Objective, value: float, currency: str) -> str:
    """Human form of an objective value, e.g. '1.2M tokens per USD'."""
    if objective == Objective.COST_PERFORMANCE:
        return f"{value / 1e6:.3g}M tokens per {currency}"
    if objective == Objective.THROUGHPUT:
        return f"{value:,.0f} tokens/s"
    if objective == Objective.COST:
        return f"{-value:,.0f} {currency} for the job"
    return f"{-value:,.1f} h to finish"


def billed_hours(hours: np.ndarray, granularity_s: int) -> np.ndarray:
    """Hours rounded up to the billing granularity (per-second billing leaves them as they are)."""
    h = np.asarray(hours, dtype=float)
    if granularity_s <= 1:
        return h
    g = granularity_s / 3600.0
    return np.ceil(h / g - 1e-9) * g


def paid_cost(price: np.ndarray, hours: np.ndarray) -> np.ndarray:
    """``price × hours``, where free (owned) devices cost 0 even for unbounded hours (no 0 × inf = nan)."""
    with np.errstate(invalid="ignore"):
        return np.where(price > 0, price * hours, 0.0)


def billed_hours_per_row(hours: np.ndarray, granularity_s: np.ndarray) -> np.ndarray:
    """``billed_hours`` with a per-row granularity."""
    g = np.maximum(granularity_s, 1) / 3600.0
    return np.where(granularity_s <= 1, hours, np.ceil(hours / g - 1e-9) * g)


def resolve_objective(job: Job, pool: Pool) -> tuple[Job, str | None]:
    """The objective the search really ranks by, and why when it differs from the job's.

    On a pool where every device is owned (price 0), tokens per unit of money is unbounded for every plan,
    so ``cost-performance`` ranks by throughput, and every plan costs nothing, so ``cost`` ranks by time.
    ``cost-performance`` on a pool that mixes free and priced offers is refused when a plan could use the
    free offers alone (that plan would be infinitely cost-effective, whatever its speed).
    """
    if not any(o.price_per_hour == 0 for o in pool.offers):
        return job, None
    objective = job.objective
    if pool.free and objective in (Objective.COST_PERFORMANCE, Objective.COST):
        new = Objective.THROUGHPUT if objective == Objective.COST_PERFORMANCE else Objective.TIME
        why = "tokens per unit of money is unbounded" if new == Objective.THROUGHPUT else "every plan costs nothing"
        note = (f"every device is owned (price 0): {why}, so objective '{objective}' ranks plans by "
                f"{'throughput' if new == Objective.THROUGHPUT else 'time'}")
        return job.model_copy(update={"objective": new}), note
    if objective == Objective.COST_PERFORMANCE and not job.search.use_all_devices:
        free = ", ".join(o.name for o in pool.offers if o.price_per_hour == 0)
        raise ConfigError(
            f"{pool.source}: objective 'cost-performance' is undefined when some offers are free ({free}) and "
            "others are not: a plan on the free devices alone would win whatever its speed. To fix: use objective "
            "throughput, time or cost, or give the owned offers an amortised price_per_hour"
        )
    return job, None
