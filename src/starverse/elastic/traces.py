"""Interruption rates measured from real spot traces (``data/traces/``), for checkpoint intervals.

Two formats are read: Bamboo's CSV (``milliseconds,add|remove,nodeN``) and the "Can't Be Late" JSON
(``{"metadata": {"gap_seconds": N}, "data": [count, ...]}``, nodes alive at each tick). Both become a
:class:`TraceStats`: removals per node-hour (the rate a pool file's ``interruptions_per_hour`` means) and,
separately, the rate of *distinct* interruption events and how many nodes each takes. Spot losses are
correlated (several nodes at once), so a job's interruption rate is lower than ``nodes × per-node rate``
while each interruption costs more; :meth:`TraceStats.job_mtbf_s` uses the measured event rate.
"""

from __future__ import annotations

import csv
import itertools
import json
from dataclasses import dataclass
from pathlib import Path

from starverse.errors import ConfigError


@dataclass(frozen=True)
class TraceStats:
    """What a spot trace says about interruptions."""

    source: str
    """The trace file."""
    duration_h: float
    """Hours covered (first to last record)."""
    node_hours: float
    """Integral of live nodes over time."""
    mean_nodes: float
    """Average live nodes (node_hours / duration_h)."""
    peak_nodes: int
    """Most nodes alive at once."""
    removals: int
    """Nodes taken back."""
    events: int
    """Distinct times at which at least one node was taken back."""
    max_nodes_per_event: int
    """Largest simultaneous loss."""

    @property
    def removals_per_node_hour(self) -> float:
        """Per-device interruption rate (the pool file's ``interruptions_per_hour``)."""
        return self.removals / self.node_hours if self.node_hours > 0 else 0.0

    @property
    def events_per_hour(self) -> float:
        """Rate of distinct interruption events over the whole cluster."""
        return self.events / self.duration_h if self.duration_h > 0 else 0.0

    @property
    def mean_nodes_per_event(self) -> float:
        """How many nodes one interruption takes on average (1.0 = independent losses)."""
        return self.removals / self.events if self.events else 0.0

    def job_mtbf_s(self, num_nodes: int) -> float:
        """Mean time between interruptions hitting a job of ``num_nodes`` nodes, from the measured events.

        Scales the trace's distinct-event rate by the job's share of the trace's mean cluster size; an
        independent-failure model (``num_nodes × removals_per_node_hour``) would overstate the number of
        interruptions by ``mean_nodes_per_event``.
        """
        if self.events == 0 or self.mean_nodes <= 0:
            return float("inf")
        rate_per_h = self.events_per_hour * min(1.0, num_nodes / self.mean_nodes)
        return 3600.0 / rate_per_h


def _stats(source: str, times_s: list[float], counts: list[int], removals: list[int]) -> TraceStats:
    """``counts[i]`` nodes alive from ``times_s[i]`` to ``times_s[i+1]``; ``removals[i]`` lost at ``times_s[i]``."""
    if len(times_s) < 2:
        raise ConfigError(f"{source}: trace too short (need at least two records)")
    node_s = sum(c * (t1 - t0) for c, t0, t1 in zip(counts, times_s, times_s[1:], strict=False))
    duration_h = (times_s[-1] - times_s[0]) / 3600.0
    node_hours = node_s / 3600.0
    lost = [r for r in removals if r > 0]
    return TraceStats(
        source=source,
        duration_h=duration_h,
        node_hours=node_hours,
        mean_nodes=node_hours / duration_h if duration_h > 0 else 0.0,
        peak_nodes=max(counts),
        removals=sum(lost),
        events=len(lost),
        max_nodes_per_event=max(lost, default=0),
    )


def bamboo_events(path: str | Path) -> dict[float, list[int]]:
    """A Bamboo trace's rows (``milliseconds,add|remove,nodeN``) as ``{seconds: [adds, removes]}``; a missing
    or malformed file is one :class:`ConfigError` naming the file (and the row)."""
    p = Path(path)
    by_time: dict[float, list[int]] = {}
    try:
        with open(p, newline="") as f:
            for i, row in enumerate(csv.reader(f), start=1):
                if not row:
                    continue
                if len(row) != 3 or row[1] not in ("add", "remove"):
                    raise ConfigError(f"{p}:{i}: expected 'milliseconds,add|remove,node', got {','.join(row)!r}")
                t = float(row[0]) / 1000.0
                adds, removes = by_time.setdefault(t, [0, 0])
                by_time[t] = [adds + (row[1] == "add"), removes + (row[1] == "remove")]
    except FileNotFoundError:
        raise ConfigError(f"{p}: trace file not found") from None
    except ValueError as e:
        raise ConfigError(f"{p}: malformed trace ({e})") from None
    return by_time


def load_bamboo_csv(path: str | Path) -> TraceStats:
    """Read a Bamboo trace (``milliseconds,add|remove,nodeN`` rows)."""
    p = Path(path)
    by_time = bamboo_events(p)
    times, counts, removals, alive = [], [], [], 0
    for t in sorted(by_time):
        adds, removes = by_time[t]
        alive += adds - removes
        times.append(t)
        counts.append(alive)
        removals.append(removes)
    return _stats(str(p), times, counts, removals)


def load_count_json(path: str | Path) -> TraceStats:
    """Read a "Can't Be Late" trace (nodes alive per tick); a drop of k between ticks is one k-node event."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
        gap = float(doc["metadata"]["gap_seconds"])
        data = [int(x) for x in doc["data"]]
    except FileNotFoundError:
        raise ConfigError(f"{p}: trace file not found") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{p}: malformed trace, expected {{'metadata': {{'gap_seconds'}}, 'data': [...]}} ({e})") from None
    times = [i * gap for i in range(len(data))]
    removals = [0] + [max(0, a - b) for a, b in itertools.pairwise(data)]
    return _stats(str(p), times, data, removals)


def load_trace(path: str | Path) -> TraceStats:
    """Either format, by extension (``.csv``: Bamboo, ``.json``: node counts)."""
    return load_bamboo_csv(path) if str(path).endswith(".csv") else load_count_json(path)
