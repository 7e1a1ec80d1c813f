"""Metrics: a Prometheus exporter of training and money figures, and a provisionable Grafana dashboard.

``starverse.metrics.exporter`` needs only ``prometheus_client``; the training callbacks
(:class:`MetricsCallback`, :class:`BillingCallback`) live in ``starverse.metrics.callbacks`` (they import
torch through the runtime) and are re-exported lazily.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from starverse.metrics.exporter import METRICS, JobState, MetricDef, MetricsExporter, RankState

__all__ = ["METRICS", "JobState", "MetricDef", "MetricsExporter", "RankState", "dashboard_path"]


def dashboard_path() -> Path:
    """The bundled Grafana dashboard (JSON model; provision it from a folder or import it in the UI)."""
    return Path(__file__).with_name("grafana") / "starverse.json"


def __getattr__(name: str) -> Any:
    if name in ("MetricsCallback", "BillingCallback"):
        from starverse.metrics import callbacks

        return getattr(callbacks, name)
    raise AttributeError(f"module 'starverse.metrics' has no attribute {name!r}")
