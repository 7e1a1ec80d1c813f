"""``job.yaml``: what the user wants trained, the objective to optimise and the limits to respect."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from starverse.config import (
    MAX_BATCH,
    MAX_COUNT,
    MAX_GB_PER_S,
    MAX_SECONDS,
    MAX_SEQ_LEN,
    MAX_STEPS,
    MAX_TOKENS,
    FrozenModel,
    PathText,
    _line_of,
    format_loc,
    parse,
    read_yaml,
)
from starverse.errors import ConfigError


class Objective(StrEnum):
    """What the planner maximises (the named target, as in SkyPilot's optimizer)."""

    COST_PERFORMANCE = "cost-performance"
    """Most tokens per unit of money at steady state (tokens/s per $/h)."""
    THROUGHPUT = "throughput"
    """Most tokens per second, whatever it costs (within the constraints)."""
    COST = "cost"
    """Least total cost to finish the job (billing granularity included), optionally by a deadline."""
    TIME = "time"
    """Soonest finish of the job within the budget."""


class JobTrain(FrozenModel):
    """Training settings of a job; fields left out are chosen by the planner."""

    seq_len: int = Field(gt=0, le=MAX_SEQ_LEN)
    """Tokens per sequence."""
    global_batch: int = Field(gt=0, le=MAX_BATCH)
    """Sequences per optimizer step over all devices."""
    tokens: float | None = Field(default=None, gt=0, le=MAX_TOKENS)
    """Total tokens to train (for the job's time and cost); alternative to ``steps``."""
    steps: int | None = Field(default=None, gt=0, le=MAX_STEPS)
    """Total optimizer steps (alternative to ``tokens``)."""
    mode: Literal["full", "lora", "qlora"] = "full"
    """full: every parameter; lora/qlora: adapters on a frozen base (the planner also proposes them, labelled,
    when full training cannot fit)."""
    lora_rank: int = Field(default=16, gt=0, le=MAX_COUNT)
    """Rank of LoRA adapters."""
    precision: Literal["bf16", "fp16", "fp8", "fp32"] = "bf16"
    """Compute precision."""
    optimizer: Literal["adamw", "sgd"] = "adamw"
    """The optimizer (``TrainSpec.optimizer``): sgd holds one fp32 state per parameter instead of Adam's two."""
    zero_stage: int | None = Field(default=None, ge=0, le=3)
    """Fix the ZeRO stage (default: searched over 0-3)."""
    recompute: Literal["none", "selective", "matmuls", "full"] | None = None
    """Fix activation recomputation (default: searched)."""
    offload: Literal["none", "optimizer", "optimizer+params"] | None = None
    """Fix CPU offload (default: searched)."""
    micro_batch: int | None = Field(default=None, gt=0, le=MAX_BATCH)
    """Fix the micro-batch size (default: searched)."""

    @model_validator(mode="after")
    def _tokens_or_steps(self) -> JobTrain:
        if self.tokens is not None and self.steps is not None:
            raise ValueError("give either tokens or steps, not both (steps = tokens / (global_batch × seq_len))")
        return self

    @property
    def total_tokens(self) -> float | None:
        """Tokens of the whole job (from ``tokens`` or ``steps``), None if neither is given."""
        if self.tokens is not None:
            return self.tokens
        if self.steps is not None:
            return float(self.steps) * self.global_batch * self.seq_len
        return None


class Constraints(FrozenModel):
    """Hard limits; a plan that breaks one is never proposed."""

    max_budget_per_hour: float | None = Field(default=None, gt=0)
    """Most the rented devices may cost per hour (in ``currency``)."""
    max_power_kw: float | None = Field(default=None, gt=0)
    """Most power the rented devices may draw (TDP), kW."""
    deadline_hours: float | None = Field(default=None, gt=0)
    """The job must finish within this many hours (needs ``train.tokens`` or ``train.steps``)."""
    max_total_cost: float | None = Field(default=None, gt=0)
    """Most the whole job may cost (in ``currency``; needs ``train.tokens`` or ``train.steps``)."""
    currency: str | None = None
    """Currency of the budgets (default: the pool's)."""


class SearchOptions(FrozenModel):
    """Knobs of the search space (defaults suit most jobs)."""

    max_groups: int = Field(default=3, ge=1, le=4)
    """Most device groups (different offers) combined by heterogeneous data parallelism."""
    hetero_pipelines: bool = True
    """Also try pipelines whose stages run on different accelerators (when one kind alone lacks memory)."""
    alternatives: bool = True
    """When full training cannot fit, also plan LoRA and QLoRA (labelled as alternatives)."""
    checkpoint_gb_per_s: float = Field(default=2.0, gt=0, le=MAX_GB_PER_S)
    """Checkpoint write bandwidth per node, GB/s (for the spot overhead); at most 12,500 (``config.MAX_GB_PER_S``)."""
    restart_s: float = Field(default=300.0, ge=0, le=MAX_SECONDS)
    """Time to get going again after a spot loss (re-acquire, relaunch, load), seconds."""
    max_tp: int | None = Field(default=None, gt=0, le=MAX_COUNT)
    """Largest tensor-parallel degree tried (1: no tensor parallelism, for a runtime that does not run it)."""
    max_pipeline_stages: int | None = Field(default=None, gt=0, le=MAX_COUNT)
    """Deepest pipeline tried, heterogeneous pipelines included (1: no pipeline parallelism)."""
    max_virtual_stages: int = Field(default=2, ge=1, le=MAX_COUNT)
    """Most model chunks per device tried with the interleaved 1F1B schedule, in single-kind and heterogeneous
    pipelines alike (1: interleaving off). Each more chunk shrinks the bubble less and adds sends; a larger cap loosens the
    search's bound (the smallest bubble of any schedule) and slows it."""
    use_all_devices: bool = False
    """Use every device of every offer, one group per offer (a fixed set of ranks such as this machine's):
    the planner then chooses only the layout, not what to rent."""


class Job(FrozenModel):
    """``job.yaml``: model, training settings, objective and constraints."""

    model: PathText
    """Registry id, Hugging Face id, or path to a config.json (relative to the job file)."""
    train: JobTrain
    """Training settings."""
    objective: Objective = Objective.COST_PERFORMANCE
    """cost-performance | throughput | cost | time."""
    constraints: Constraints = Field(default_factory=Constraints)
    """Budget, power and deadline limits."""
    search: SearchOptions = Field(default_factory=SearchOptions)
    """Search-space options."""



def check_job(job: Job, source: str = "<job>", node: Any = None) -> Job:
    """Checks across fields (contradictory settings), as one-line errors pointing at the field."""
    needs_length: list[tuple[tuple[str, ...], str]] = []
    if job.objective in (Objective.COST, Objective.TIME):
        needs_length.append((("objective",), f"objective '{job.objective}'"))
    if job.constraints.deadline_hours is not None:
        needs_length.append((("constraints", "deadline_hours"), "constraints.deadline_hours"))
    if job.constraints.max_total_cost is not None:
        needs_length.append((("constraints", "max_total_cost"), "constraints.max_total_cost"))
    if needs_length and job.train.total_tokens is None:
        loc, _ = needs_length[0]
        line = _line_of(node, loc) if node is not None else None
        where = f"{source}:{line}" if line is not None else source
        what = " and ".join(w for _, w in needs_length)
        raise ConfigError(f"{where}: {format_loc(loc)}: {what} needs the length of the job; add train.tokens "
                          "(e.g. 1.0e9) or train.steps")
    return job


def load_job(path: str | Path) -> Job:
    """Read and validate ``job.yaml``; a relative model path is made relative to the job file."""
    data, node = read_yaml(path)
    job = check_job(parse(Job, data, str(path), node), str(path), node)
    candidate = Path(path).parent / job.model
    if candidate.is_file():
        job = job.model_copy(update={"model": str(candidate.resolve())})
    return job


def job_from_dict(data: Any, source: str = "<job>") -> Job:
    """Build a job from a mapping (the Python API)."""
    return check_job(parse(Job, data, source), source)
