"""Prometheus exporter: a collector over the job's latest state, served on 127.0.0.1.

The exporter owns its ``CollectorRegistry`` (never the process-global one, so two jobs or tests in one
process do not collide) and serves it with ``prometheus_client``'s HTTP server, bound to 127.0.0.1 by
default; port 0 picks a free port (read it back from :attr:`MetricsExporter.port`). Values come from a
:class:`JobState` snapshot the training callback replaces after each step, so a scrape never sees a
half-updated step. Names follow Prometheus conventions: base units (seconds, ratios), ``_total`` for
counters. :data:`METRICS` is the list the Grafana dashboard is checked against.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)


JOB_LABEL = "starverse_job"
"""The label naming the training job on every series. Not ``job``: Prometheus sets ``job`` on every scraped
series itself (the scrape config's job name), and under the default ``honor_labels: false`` ours would be renamed
``exported_job`` and the dashboard's job selector would list scrape jobs instead of training jobs."""


@dataclass(frozen=True)
class MetricDef:
    """One exported metric family."""

    name: str
    """Family name (a counter's samples carry ``_total``, which is part of this name)."""
    kind: str
    """``counter`` or ``gauge``."""
    help: str
    labels: tuple[str, ...] = ()
    """Labels besides :data:`JOB_LABEL`."""


METRICS: tuple[MetricDef, ...] = (
    MetricDef("starverse_steps_total", "counter", "Optimizer steps completed (including before a resume)."),
    MetricDef("starverse_tokens_total", "counter", "Tokens trained (including before a resume)."),
    MetricDef("starverse_tokens_per_second", "gauge", "Whole-job throughput of the last step."),
    MetricDef("starverse_mfu_ratio", "gauge", "Model FLOPs utilisation of the last step (0..1)."),
    MetricDef("starverse_loss", "gauge", "Training loss of the last step."),
    MetricDef("starverse_step_seconds", "gauge", "Wall time of the last step on each rank.",
              ("rank", "accelerator")),
    MetricDef("starverse_compute_seconds", "gauge", "Forward+backward time of the last step on each rank.",
              ("rank", "accelerator")),
    MetricDef("starverse_batch_share_ratio", "gauge", "Share of the global batch computed by each rank (0..1).",
              ("rank", "accelerator")),
    MetricDef("starverse_micro_batches", "gauge", "Micro-batches computed by each rank in the last step.",
              ("rank", "accelerator")),
    MetricDef("starverse_world_size", "gauge", "Ranks in the job."),
    MetricDef("starverse_cost_total", "counter",
              "Money spent: charges of closed leases plus what open leases have accrued.", ("currency",)),
    MetricDef("starverse_credit_total", "counter", "Insurance credits (redone work and restart time).",
              ("currency",)),
    MetricDef("starverse_cost_per_hour", "gauge", "What the job's open leases cost per hour.", ("currency",)),
    MetricDef("starverse_cost_per_million_tokens", "gauge", "Money spent per million tokens trained.",
              ("currency",)),
    MetricDef("starverse_budget_remaining", "gauge", "Total budget minus money spent (absent without a budget).",
              ("currency",)),
    MetricDef("starverse_preemptions_total", "counter", "Preemptions recorded for the job."),
    MetricDef("starverse_checkpoints_total", "counter", "Checkpoints written by this run."),
    MetricDef("starverse_last_checkpoint_seconds", "gauge", "Start-to-commit seconds of the last checkpoint."),
    MetricDef("starverse_checkpoint_seconds_total", "counter",
              "Seconds training waited for checkpoints in this run (asynchronous saves overlap training)."),
)
"""Every family the exporter defines (the dashboard may use only these)."""


@dataclass(frozen=True)
class RankState:
    """Per-rank figures of the last step."""

    rank: int
    accelerator: str
    step_s: float
    compute_s: float | None
    micro_batches: int
    share: float


@dataclass(frozen=True)
class JobState:
    """A consistent snapshot of everything exported (replaced whole after each step)."""

    steps: int = 0
    tokens: int = 0
    tokens_per_s: float = 0.0
    mfu: float | None = None
    loss: float | None = None
    ranks: Sequence[RankState] = ()
    world_size: int = 0
    currency: str | None = None
    cost: float | None = None
    credits: float | None = None
    cost_per_hour: float | None = None
    budget_remaining: float | None = None
    preemptions: int = 0
    checkpoints: int = 0
    checkpoint_s: float | None = None
    checkpoint_s_total: float = 0.0
    extra: Mapping[str, Any] = field(default_factory=dict)


class JobCollector(Collector):
    """Yields :data:`METRICS` from the current :class:`JobState`."""

    def __init__(self, job: str):
        self.job = job
        self._state = JobState()
        self._lock = threading.Lock()

    def update(self, state: JobState) -> None:
        """Replace the snapshot (thread-safe against a concurrent scrape)."""
        with self._lock:
            self._state = state

    @property
    def state(self) -> JobState:
        """The current snapshot."""
        with self._lock:
            return self._state

    def collect(self) -> Iterator[Metric]:
        """Prometheus' collection hook."""
        s = self.state
        fams: dict[str, Any] = {}
        for m in METRICS:
            cls = CounterMetricFamily if m.kind == "counter" else GaugeMetricFamily
            # CounterMetricFamily appends `_total` to sample names itself; it wants the bare name
            name = m.name.removesuffix("_total") if m.kind == "counter" else m.name
            fams[m.name] = cls(name, m.help, labels=[JOB_LABEL, *m.labels])

        def put(name: str, value: float | None, *labels: str) -> None:
            if value is not None:
                fams[name].add_metric([self.job, *labels], float(value))

        put("starverse_steps_total", s.steps)
        put("starverse_tokens_total", s.tokens)
        put("starverse_tokens_per_second", s.tokens_per_s)
        put("starverse_mfu_ratio", s.mfu)
        put("starverse_loss", s.loss)
        put("starverse_world_size", s.world_size)
        for r in s.ranks:
            lab = (str(r.rank), r.accelerator)
            put("starverse_step_seconds", r.step_s, *lab)
            put("starverse_compute_seconds", r.compute_s, *lab)
            put("starverse_batch_share_ratio", r.share, *lab)
            put("starverse_micro_batches", r.micro_batches, *lab)
        if s.currency is not None:
            put("starverse_cost_total", s.cost, s.currency)
            put("starverse_credit_total", s.credits, s.currency)
            put("starverse_cost_per_hour", s.cost_per_hour, s.currency)
            if s.cost is not None and s.tokens > 0:
                put("starverse_cost_per_million_tokens", s.cost / s.tokens * 1e6, s.currency)
            put("starverse_budget_remaining", s.budget_remaining, s.currency)
        put("starverse_preemptions_total", s.preemptions)
        put("starverse_checkpoints_total", s.checkpoints)
        put("starverse_last_checkpoint_seconds", s.checkpoint_s)
        put("starverse_checkpoint_seconds_total", s.checkpoint_s_total)
        yield from fams.values()


class MetricsExporter:
    """An HTTP endpoint serving one job's metrics from its own registry."""

    def __init__(self, job: str, host: str = "127.0.0.1", port: int = 0):
        self.collector = JobCollector(job)
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(self.collector)
        self.host = host
        self._requested_port = port
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def start(self) -> MetricsExporter:
        """Start serving (a daemon thread); returns self."""
        if self._server is None:
            self._server, self._thread = start_http_server(self._requested_port, addr=self.host,
                                                           registry=self.registry)
            log.info("metrics at %s", self.url)
        return self

    @property
    def port(self) -> int:
        """The bound port (the free one chosen when asked for 0)."""
        if self._server is None:
            raise RuntimeError("exporter not started")
        return int(self._server.server_port)

    @property
    def url(self) -> str:
        """Scrape URL."""
        return f"http://{self.host}:{self.port}/metrics"

    def update(self, state: JobState) -> None:
        """Publish a new snapshot."""
        self.collector.update(state)

    def stop(self) -> None:
        """Stop serving and free the port."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
