"""``starverse train JOB.yaml``: the job file of a supervised training run.

```yaml
model: meta-llama/Llama-2-7b-hf   # registry id | HF id | config.json path (scaled down if it cannot fit here)
dataset: corpus/                  # text file, folder of text files or .jsonl (relative to this file)
run_dir: runs/llama               # checkpoints, ledger, logs (relative to this file)
train: {steps: 200, seq_len: 128, global_batch: 16, micro_batch: 2}
devices: {cpu_ranks: 2}
checkpoint:
  interval_steps: null            # null: Young/Daly from the measured save cost and the interruption rate
  trace: ../data/traces/bamboo/p3-trace.csv   # or interruptions_per_hour: 0.6, or the pool's offers
  keep_last: 3
  grace_s: 30
```
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pydantic import Field

from starverse.config import FrozenModel, load_file
from starverse.errors import ConfigError


class TrainSettings(FrozenModel):
    """How long and with which batch to train."""

    steps: int = Field(default=100, gt=0)
    """Optimizer steps of the whole job (a resume continues to this step)."""
    seq_len: int = Field(default=128, gt=0)
    """Tokens per sequence."""
    global_batch: int = Field(default=16, gt=0)
    """Sequences per optimizer step over all ranks; kept when devices are lost, so the trajectory continues."""
    micro_batch: int = Field(default=2, gt=0)
    """Sequences per micro-batch (must divide ``global_batch``)."""
    lr: float = Field(default=1e-3, gt=0)
    """Peak learning rate."""
    seed: int = 0
    """Seed of data order and initial weights."""
    max_params: int | None = Field(default=3_000_000, gt=0)
    """Largest model trained on these devices (a bigger ``model`` is trained as a scaled-down copy)."""
    rebalance_every: int = Field(default=10, ge=0)
    """Re-split the batch by measured speed every this many steps (0: never)."""


class DeviceSettings(FrozenModel):
    """Which local devices to use."""

    cpu_ranks: int | None = Field(default=None, gt=0)
    """CPU ranks when there is no GPU (default: $STARVERSE_CPU_RANKS, else 2)."""
    use_gpus: bool | None = None
    """Use CUDA devices when present (default: yes)."""


class CheckpointSettings(FrozenModel):
    """Checkpoint insurance of the job."""

    dir: str | None = None
    """Checkpoint folder (default ``RUN_DIR/checkpoints``; relative to the job file)."""
    interval_steps: int | None = Field(default=None, gt=0)
    """Steps between checkpoints; null: Young/Daly from the measured save cost and the interruption rate."""
    interruptions_per_hour: float | None = Field(default=None, ge=0)
    """Expected losses per device-hour (spot); overrides ``trace`` and the pool."""
    trace: str | None = None
    """A spot trace (``data/traces/``) to measure the interruption rate from, correlation included."""
    max_interval_s: float = Field(default=1800.0, gt=0)
    """Longest time between checkpoints whatever the rate (rollback snapshots, on-demand failures)."""
    keep_last: int | None = Field(default=3, ge=1)
    """Newest checkpoints kept (null: all)."""
    keep_every: int | None = Field(default=None, ge=1)
    """Also keep every checkpoint whose step is a multiple of this (snapshots for rollback)."""
    async_save: bool = True
    """Write checkpoints in the background while training continues."""
    grace_s: float = Field(default=30.0, gt=0)
    """Seconds between a preemption notice and the loss of the device (AWS: 120, GCP: 30)."""
    notice_file: str | None = None
    """Also treat this file appearing as a preemption notice (for a sidecar that talks to the provider)."""
    notice_url: str | None = None
    """Also poll a metadata endpoint: ``aws``, ``gcp``, or a URL that answers 200 when preempted."""


class TrainJob(FrozenModel):
    """A training job run by ``starverse train`` under the supervisor."""

    model: str = "llama"
    """Registry id, Hugging Face id or config.json path (relative to this file); ``llama``: a small Llama."""
    dataset: str
    """Text file, folder of text files or .jsonl file (relative to this file)."""
    run_dir: str = "runs/job"
    """Run directory (relative to this file)."""
    plan: str | None = None
    """A plan file for these devices (default: planned on the local devices)."""
    pool: str | None = None
    """A pool file: the interruption rates of its offers set the checkpoint interval."""
    train: TrainSettings = Field(default_factory=TrainSettings)
    """Steps, batch and optimiser settings."""
    devices: DeviceSettings = Field(default_factory=DeviceSettings)
    """Local devices to use."""
    checkpoint: CheckpointSettings = Field(default_factory=CheckpointSettings)
    """Checkpoint insurance."""
    max_restarts: int = Field(default=5, ge=0)
    """Relaunches allowed after losses before giving up."""


def _rel(base: Path, value: str | None) -> str | None:
    if value is None:
        return None
    p = Path(value).expanduser()
    return str(p if p.is_absolute() else (base / p).resolve())


def load_job(path: str | Path) -> TrainJob:
    """Load and validate a job file; relative paths become absolute (relative to the file)."""
    job = load_file(TrainJob, path)
    base = Path(path).resolve().parent
    model = job.model
    if model.endswith(".json") or (base / model).is_file():
        model = _rel(base, model) or model
    if job.train.global_batch % job.train.micro_batch:
        raise ConfigError(
            f"{path}: train.global_batch: {job.train.global_batch} is not a multiple of train.micro_batch "
            f"{job.train.micro_batch}. To fix: make micro_batch divide global_batch."
        )
    ck = job.checkpoint.model_copy(update={
        "dir": _rel(base, job.checkpoint.dir),
        "trace": _rel(base, job.checkpoint.trace),
        "notice_file": _rel(base, job.checkpoint.notice_file),
    })
    return job.model_copy(update={
        "model": model, "dataset": _rel(base, job.dataset), "run_dir": _rel(base, job.run_dir),
        "plan": _rel(base, job.plan), "pool": _rel(base, job.pool), "checkpoint": ck,
    })


def job_mtbf(job: TrainJob, device_kinds: list[str]) -> tuple[float, str]:
    """Mean time between interruptions of this job and where the figure comes from."""
    from starverse.elastic.interval import job_mtbf_s

    n = len(device_kinds)
    ck = job.checkpoint
    if ck.interruptions_per_hour is not None:
        return job_mtbf_s([ck.interruptions_per_hour] * n), f"{ck.interruptions_per_hour}/device-h × {n} devices"
    if ck.trace is not None:
        from starverse.elastic.traces import load_trace

        stats = load_trace(ck.trace)
        return stats.job_mtbf_s(n), (
            f"trace {Path(ck.trace).name}: {stats.events_per_hour:.3g} interruption events/h over "
            f"{stats.mean_nodes:.3g} nodes ({stats.mean_nodes_per_event:.2g} nodes each), scaled to {n}"
        )
    if job.pool is not None:
        rates = _pool_rates(job.pool)
        per = [rates.get(k, 0.0) for k in device_kinds]
        if any(per):
            return job_mtbf_s(per), f"pool {Path(job.pool).name}: {sum(per):.3g} interruptions/h over {n} devices"
    return math.inf, "no interruption rate given"


def _pool_rates(path: str) -> dict[str, float]:
    """Spot interruption rate per accelerator id from a pool file (the highest if offered twice)."""
    from starverse.config import read_yaml

    data, _ = read_yaml(path)
    out: dict[str, float] = {}
    offers: Any = (data or {}).get("offers") if isinstance(data, dict) else None
    for i, o in enumerate(offers or []):
        if not isinstance(o, dict) or "accelerator" not in o:
            raise ConfigError(f"{path}: offers[{i}]: expected a mapping with 'accelerator'")
        rate = float(o.get("interruptions_per_hour") or 0.0)
        acc = str(o["accelerator"])
        out[acc] = max(out.get(acc, 0.0), rate)
    return out
