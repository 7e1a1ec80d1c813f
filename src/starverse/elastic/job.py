"""``starverse train JOB.yaml``: the job file of a supervised training run.

```yaml
model: meta-llama/Llama-2-7b-hf   # registry id | HF id | config.json path (scaled down if it cannot fit here)
                                  # | a Hugging Face model folder: its safetensors weights and tokenizer are used
dataset: corpus/                  # text file, folder of text files or .jsonl (text, prompt/response or messages)
run_dir: runs/llama               # checkpoints, ledger, logs, metrics.jsonl, tensorboard/ (relative to this file)
train: {steps: 200, seq_len: 128, global_batch: 16, micro_batch: 2, mode: lora, lora_rank: 8, eval_fraction: 0.1}
devices: {cpu_ranks: 2}
checkpoint:
  interval_steps: null            # null: Young/Daly from the measured save cost and the interruption rate
  trace: ../data/traces/bamboo/p3-trace.csv   # or interruptions_per_hour: 0.6, or the pool's offers
  keep_last: 3
  grace_s: 30
pool: pool.yaml                   # prices the leases (devices it does not offer are free: your own machine)
billing: {budget_total: 5.0, max_budget_per_hour: 1.0}   # ledger at RUN_DIR/ledger.sqlite
metrics: {port: 0}                # Prometheus on 127.0.0.1 (0: a free port, see RUN_DIR/metrics.json)
```
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from starverse.config import (
    MAX_BATCH,
    MAX_COUNT,
    MAX_INTERRUPTIONS_PER_HOUR,
    MAX_MONEY,
    MAX_SECONDS,
    MAX_SEED,
    MAX_SEQ_LEN,
    MAX_STEPS,
    FrozenModel,
    PathText,
    _line_of,
    did_you_mean,
    parse,
    read_yaml,
    where,
)
from starverse.errors import BillingError, BudgetExceededError, ConfigError

DEFAULT_MODEL = "llama"
"""The model of a job file that names none: a small Llama the runtime builds (no registry id)."""


class TrainSettings(FrozenModel):
    """How long and with which batch to train."""

    steps: int = Field(default=100, gt=0, le=MAX_STEPS)
    """Optimizer steps of the whole job (a resume continues to this step)."""
    seq_len: int = Field(default=128, gt=0, le=MAX_SEQ_LEN)
    """Tokens per sequence."""
    global_batch: int = Field(default=16, gt=0, le=MAX_BATCH)
    """Sequences per optimizer step over all ranks; kept when devices are lost, so the trajectory continues."""
    micro_batch: int = Field(default=2, gt=0, le=MAX_BATCH)
    """Sequences per micro-batch (must divide ``global_batch``)."""
    lr: float = Field(default=1e-3, gt=0)
    """Peak learning rate."""
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    """Seed of data order and initial weights."""
    max_params: int | None = Field(default=3_000_000, gt=0, le=10**13)
    """Largest model trained on these devices (a bigger ``model`` is trained as a scaled-down copy)."""
    rebalance_every: int = Field(default=10, ge=0, le=MAX_STEPS)
    """Re-split the batch by measured speed every this many steps (0: never)."""
    mode: Literal["full", "lora", "qlora"] = "full"
    """full: train every weight; lora: frozen base plus low-rank adapters (peft); qlora: 4-bit base (CUDA only)."""
    lora_rank: int = Field(default=16, gt=0)
    """Rank of the LoRA adapters (mode lora/qlora)."""
    eval_fraction: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Hold out this fraction of the data (its end) and report loss/perplexity on it (0: no evaluation)."""
    eval_every: int = Field(default=0, ge=0)
    """Evaluate every this many steps (0: only at the end)."""
    tokenizer: str = "auto"
    """auto (the model folder's own tokenizer, else a BPE trained on the corpus), bpe, bytes, or a model folder /
    tokenizer.json (relative to this file)."""


class DeviceSettings(FrozenModel):
    """Which local devices to use."""

    cpu_ranks: int | None = Field(default=None, gt=0, le=MAX_COUNT)
    """CPU ranks when there is no GPU (default: $STARVERSE_CPU_RANKS, else 2)."""
    use_gpus: bool | None = None
    """Use CUDA devices when present (default: yes)."""
    launcher: Literal["local", "ray"] = "local"
    """How ranks are started: ``local`` processes on this machine, or ``ray`` actors (joins ``$RAY_ADDRESS`` when
    set, else a private one-node Ray; needs the ``ray`` extra; see docs/ray.md)."""


class CheckpointSettings(FrozenModel):
    """Checkpoint insurance of the job."""

    dir: PathText | None = None
    """Checkpoint folder (default ``RUN_DIR/checkpoints``; relative to the job file)."""
    interval_steps: int | None = Field(default=None, gt=0, le=MAX_STEPS)
    """Steps between checkpoints; null: Young/Daly from the measured save cost and the interruption rate."""
    interruptions_per_hour: float | None = Field(default=None, ge=0, le=MAX_INTERRUPTIONS_PER_HOUR)
    """Expected losses per device-hour (spot; at most 3600); overrides ``trace`` and the pool."""
    trace: PathText | None = None
    """A spot trace (``data/traces/``) to measure the interruption rate from, correlation included."""
    max_interval_s: float = Field(default=1800.0, gt=0, le=MAX_SECONDS)
    """Longest time between checkpoints whatever the rate (rollback snapshots, on-demand failures)."""
    keep_last: int | None = Field(default=3, ge=1, le=MAX_STEPS)
    """Newest checkpoints kept (null: all)."""
    keep_every: int | None = Field(default=None, ge=1, le=MAX_STEPS)
    """Also keep every checkpoint whose step is a multiple of this (snapshots for rollback)."""
    async_save: bool = True
    """Write checkpoints in the background while training continues."""
    grace_s: float = Field(default=30.0, gt=0, le=MAX_SECONDS)
    """Seconds between a preemption notice and the loss of the device (AWS: 120, GCP: 30)."""
    notice_file: PathText | None = None
    """Also treat this file appearing as a preemption notice (for a sidecar that talks to the provider)."""
    notice_url: str | None = None
    """Also poll a metadata endpoint: ``aws``, ``gcp``, or a URL that answers 200 when preempted."""
    notice_poll_s: float = Field(default=5.0, gt=0, le=3600)
    """Seconds between two polls of ``notice_url`` (each rank polls in a background thread)."""


class BillingSettings(FrozenModel):
    """The job's per-second ledger and budgets (leases are priced from ``pool``; see :func:`job_prices`)."""

    enabled: bool = True
    """Keep a ledger of the run (leases, checkpoint/preemption/resume events, insurance credits)."""
    ledger: PathText | None = None
    """Ledger file (default ``RUN_DIR/ledger.sqlite``; relative to this file). Several jobs may share one."""
    job: str | None = None
    """The job's name in the ledger (default: the run directory's folder name); a rerun continues it."""
    currency: str | None = None
    """Currency the job is billed in (default: the pool's, else USD); other prices are converted."""
    budget_total: Decimal | None = Field(default=None, gt=0, le=MAX_MONEY)
    """Total budget of the job (all runs of it): before the next interval would exceed it, the job writes a
    checkpoint and stops cleanly (overshoot: at most one billing interval)."""
    max_budget_per_hour: Decimal | None = Field(default=None, gt=0, le=MAX_MONEY)
    """Most the job's devices may cost per hour together; a job above it is refused before it starts."""

    @model_validator(mode="after")
    def _budgets_need_the_ledger(self) -> BillingSettings:
        if not self.enabled and (self.budget_total is not None or self.max_budget_per_hour is not None):
            raise ValueError("budgets are enforced from the ledger, which enabled: false turns off; "
                             "remove budget_total/max_budget_per_hour or set enabled: true")
        return self


class MetricsSettings(FrozenModel):
    """The Prometheus exporter of the run (served by rank 0, bound to 127.0.0.1 only)."""

    enabled: bool = True
    """Serve ``/metrics`` while the job trains (on by default: it binds to 127.0.0.1 only)."""
    port: int = Field(default=0, ge=0, le=65535)
    """Port on 127.0.0.1; 0 picks a free one (written to ``RUN_DIR/metrics.json``). Fix it for a scrape config."""
    linger_s: float = Field(default=0.0, ge=0, le=MAX_SECONDS)
    """Keep serving this long after training ends (a last scrape)."""


class RayPoolSettings(FrozenModel):
    """``pool: {ray: auto}``: the job runs on the devices of a running Ray cluster (``docs/ray.md``)."""

    ray: str = Field(min_length=1)
    """``auto`` (``$RAY_ADDRESS``) or the cluster's ``HOST:PORT``; its nodes' accelerator resources are the devices,
    re-read at each re-plan."""
    prices: PathText | None = None
    """The operator's price list (a pool file, relative to this file); default: the catalog's prices."""


class TrainJob(FrozenModel):
    """A training job run by ``starverse train`` under the supervisor."""

    model: PathText = DEFAULT_MODEL
    """Registry id, Hugging Face id or config.json path (relative to this file); ``llama``: a small Llama."""
    dataset: PathText
    """Text file, folder of text files or .jsonl file (relative to this file)."""
    run_dir: PathText = "runs/job"
    """Run directory (relative to this file)."""
    plan: PathText | None = None
    """A plan file for these devices (default: planned on the local devices)."""
    pool: PathText | RayPoolSettings | None = None
    """A pool file: its offers price the leases of the job's devices (by accelerator id; a device it does not
    offer is free: your own machine) and their interruption rates set the checkpoint interval. Or a Ray
    cluster, ``{ray: auto | HOST:PORT, prices: FILE}``: the job runs on its devices with the Ray launcher."""
    train: TrainSettings = Field(default_factory=TrainSettings)
    """Steps, batch and optimiser settings."""
    devices: DeviceSettings = Field(default_factory=DeviceSettings)
    """Local devices to use."""
    checkpoint: CheckpointSettings = Field(default_factory=CheckpointSettings)
    """Checkpoint insurance."""
    max_restarts: int = Field(default=5, ge=0, le=MAX_COUNT)
    """Relaunches allowed after losses before giving up."""
    recovery: Literal["restart", "in-place"] = "restart"
    """What a lost device costs: ``restart`` (re-plan, relaunch, resume from the last checkpoint) or
    ``in-place`` (torchft: the other data-parallel replicas finish the step in flight and go on; a job whose
    replicas are not one rank or one pipeline each, or that loses every replica, falls back to restart). See
    docs/insurance.md."""
    replace_after_s: float | None = Field(default=None, ge=0)
    """``recovery: in-place``: start a replacement for a lost replica (same device) after this many seconds; it
    joins at a step boundary with the live state of a peer (null: the survivors go on alone)."""
    warm_spares: bool | None = None
    """``recovery: in-place`` with ``replace_after_s``: keep a warm spare (a started replica process or Ray actor that
    loaded the model) per device kind, activated on a loss (null: on with the local launcher, off on Ray, where a
    spare holds a bundle of the cluster for the whole run). See docs/ray.md."""
    heartbeat_s: float = Field(default=1.0, gt=0, le=MAX_SECONDS)
    """How often each rank (process or Ray actor) stamps its heartbeat."""
    heartbeat_timeout_s: float = Field(default=60.0, gt=0, le=MAX_SECONDS)
    """A rank that lives but whose heartbeat stood still this long is lost (cause ``heartbeat timeout``: a hung
    process or host) and is killed; then the job recovers as ``recovery`` says. Must be above ``heartbeat_s``;
    keep it above the longest pause of a healthy rank (a checkpoint write, the first step's start-up)."""
    billing: BillingSettings = Field(default_factory=BillingSettings)
    """Ledger and budgets."""
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)
    """Prometheus exporter."""

    @model_validator(mode="after")
    def _heartbeat_below_its_timeout(self) -> TrainJob:
        if not self.heartbeat_s < self.heartbeat_timeout_s:
            raise ValueError(f"heartbeat_timeout_s ({self.heartbeat_timeout_s:g}) must be above heartbeat_s "
                             f"({self.heartbeat_s:g}); raise heartbeat_timeout_s (default 60) or lower heartbeat_s")
        return self

    @field_validator("pool", mode="before")
    @classmethod
    def _ray_pool(cls, value: Any) -> Any:
        """A mapping is a Ray pool: name an unknown key plainly (the union would list both shapes' errors)."""
        if isinstance(value, dict):
            unknown = sorted(set(value) - {"ray", "prices"})
            if unknown:
                raise ValueError(f"unknown field '{unknown[0]}' of a Ray pool.{did_you_mean(unknown[0], ['ray', 'prices'])}"
                                 " To fix: write {ray: auto | HOST:PORT, prices: PRICE_LIST.yaml}")
            if not isinstance(value.get("ray"), str) or not value["ray"]:
                raise ValueError(f"ray: must be 'auto' or HOST:PORT (got {value.get('ray')!r})")
        return value


def _rel(base: Path, value: str | None) -> str | None:
    if value is None:
        return None
    p = Path(value).expanduser()
    return str(p if p.is_absolute() else (base / p).resolve())


def check_job_inputs(job: TrainJob, source: str) -> None:
    """What ``starverse train`` (and the service, at submit) checks of a job's inputs before anything is written,
    each error at the job file's line (``source``): a dataset of text, and a model that exists. A pretrained
    folder's files are checked when it is loaded; :data:`DEFAULT_MODEL` is no registry id."""
    from starverse.checks import check_dataset, check_model
    from starverse.models import estimate_only
    from starverse.runtime.devices import max_cpu_ranks

    check_dataset(job.dataset, source)
    if not Path(job.model).is_dir() and job.model != DEFAULT_MODEL:
        spec = check_model(job.model, source)
        reason = estimate_only(spec.family)
        if reason:
            raise ConfigError(f"{where(source, ('model',))}: model: {job.model}: {reason}", ("model",))
        limit = getattr(spec, "max_seq_len", None)
        # the positions of the model as given (a scaled-down copy for small devices has no more of them)
        if isinstance(limit, int) and job.train.seq_len > limit:
            raise ConfigError(f"{where(source, ('train', 'seq_len'))}: train.seq_len: {job.train.seq_len} exceeds the "
                              f"{limit} positions of model {job.model}. To fix: set seq_len to at most {limit}")
    ranks, most = job.devices.cpu_ranks, max_cpu_ranks()
    if ranks is not None and ranks > most:
        raise ConfigError(f"{where(source, ('devices', 'cpu_ranks'))}: devices.cpu_ranks: {ranks:,} is more than the "
                          f"{most} CPU ranks this machine starts (one process each). To fix: ask for at most {most}")


def load_job(path: str | Path) -> TrainJob:
    """Load and validate a job file; relative paths become absolute (relative to the file)."""
    data, node = read_yaml(path)
    job = parse(TrainJob, data, str(path), node)
    base = Path(path).resolve().parent
    model = job.model
    if model.endswith(".json") or (base / model).exists():
        model = _rel(base, model) or model
    train = job.train
    if train.tokenizer not in ("auto", "bpe", "bytes"):
        train = train.model_copy(update={"tokenizer": _rel(base, train.tokenizer)})
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
    billing = job.billing
    if billing.currency is not None:
        from starverse.billing.money import normalize_currency

        try:
            billing = billing.model_copy(update={"currency": normalize_currency(billing.currency)})
        except BillingError as e:
            line = _line_of(node, ("billing", "currency"))
            raise ConfigError(f"{path}:{line}: billing.currency: {e}") from None
    billing = billing.model_copy(update={"ledger": _rel(base, billing.ledger)})
    pool: str | RayPoolSettings | None = _rel(base, job.pool) if not isinstance(job.pool, RayPoolSettings) else (
        job.pool.model_copy(update={"prices": _rel(base, job.pool.prices)}))
    return job.model_copy(update={
        "model": model, "train": train, "dataset": _rel(base, job.dataset), "run_dir": _rel(base, job.run_dir),
        "plan": _rel(base, job.plan), "pool": pool, "checkpoint": ck, "billing": billing,
    })


@dataclass(frozen=True)
class JobPrices:
    """What the job's devices cost: the lease pricing per accelerator id and how it was found."""

    currency: str
    """The job's billing currency."""
    prices: dict[str, Any]
    """Accelerator id -> ``starverse.billing.LeasePricing`` (free for a device the pool does not offer)."""
    cost_per_hour: Decimal
    """All the job's devices together, per hour, in ``currency``."""
    lines: tuple[str, ...]
    """One line per accelerator: count, price, mode and source (for the CLI)."""


def job_prices(job: TrainJob, device_kinds: list[str], source: str = "job", pool: Any = None) -> JobPrices:
    """The leases of ``job`` on these devices: :func:`lease_prices` with the job's pool (``pool``: a resolved
    :class:`~starverse.planner.pool.Pool` instead, e.g. a Ray cluster's) and billing settings."""
    if pool is None and isinstance(job.pool, RayPoolSettings):
        raise ConfigError(f"{source}: pool: a Ray pool is priced from the cluster's pool; pass it as pool=")
    return lease_prices(device_kinds, pool=pool if pool is not None else job.pool, currency=job.billing.currency,
                        max_budget_per_hour=job.billing.max_budget_per_hour, source=source)


def lease_prices(device_kinds: list[str], *, pool: Any = None, currency: str | None = None,
                 max_budget_per_hour: Decimal | None = None, source: str = "job") -> JobPrices:
    """Price one lease per rank from a pool file or a resolved ``Pool`` (the first offer of each accelerator id: its pricing mode,
    price and billing granularity); an accelerator the pool does not offer, or no pool at all, is the
    user's own machine and free. ``currency``: the job's (default: the pool's, else USD). Raises
    :class:`BudgetExceededError` when the devices together cost more than ``max_budget_per_hour`` (checked
    before anything is launched)."""
    from collections import Counter

    from starverse.billing import LeasePricing, PricingMode
    from starverse.billing.money import convert

    offers: dict[str, Any] = {}
    pool_currency = "USD"
    label = ""
    if pool is not None:
        from starverse.planner.pool import load_pool

        loaded = load_pool(pool) if isinstance(pool, (str, Path)) else pool
        label = loaded.source if loaded.source.startswith("ray://") else Path(loaded.source).name
        pool_currency = loaded.currency
        for offer in loaded.offers:
            offers.setdefault(offer.accelerator, offer)
    currency = currency or pool_currency
    prices: dict[str, Any] = {}
    lines: list[str] = []
    total = Decimal(0)
    for acc, n in Counter(device_kinds).items():
        o = offers.get(acc)
        if o is None:
            prices[acc] = LeasePricing.free()
            where = f"not offered by {label}" if pool is not None else "no pool"
            lines.append(f"{n} x {acc}: free ({where}: your own device)")
            continue
        # the pool resolves prices to floats in its currency; the ledger keeps micro-units
        price = Decimal(repr(o.price_per_hour)).quantize(Decimal("0.000001"))
        mode = PricingMode.SPOT if str(o.pricing) == "spot" else PricingMode.ON_DEMAND
        prices[acc] = LeasePricing(mode, price, pool_currency, o.billing_granularity_s)
        total += n * convert(price, pool_currency, currency)
        lines.append(f"{n} x {acc}: {price.normalize():f} {pool_currency}/h each, {mode.value} (offer '{o.name}' "
                     f"of {label})")
    cap = max_budget_per_hour
    if cap is not None and total > cap:
        raise BudgetExceededError(
            f"{source}: billing.max_budget_per_hour: the job's devices cost {total.normalize():f} {currency}/h "
            f"({'; '.join(lines)}), above the cap of {cap} {currency}/h. To fix: raise max_budget_per_hour, run "
            "fewer ranks (devices.cpu_ranks) or use cheaper offers in the pool."
        )
    return JobPrices(currency, prices, total, tuple(lines))


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
    if isinstance(job.pool, str):
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
