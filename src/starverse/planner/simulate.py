"""Trace-driven simulation of a spot plan: real preemption traces replayed against its checkpoints.

The planner's spot factor (:func:`~starverse.planner.policy.spot_factor`) is a closed formula over independent
losses. Here the losses come from a real trace (``data/traces``): correlated (one event takes several nodes),
with the replacement delay the trace shows (how long until the cluster is back to its size). Each simulated
job starts at a random point of the trace (replayed cyclically), and its devices are a random subset of the
trace's nodes:

- jobs start at stratified random points of the trace (one per ``1/runs`` of it);
- a trace node is one device (as ``interruptions_per_hour`` per device-hour is read from the same traces);
  a job larger than the trace's mean cluster is spread over ``ceil(n / mean_nodes)`` independent copies of
  the trace, each with its own random start;
- an event that takes ``k`` of the ``c`` nodes alive hits a job holding ``m`` of them with the
  hypergeometric probability ``1 - C(c-m, k) / C(c, k)``;
- the job works ``τ`` seconds, then writes a checkpoint for ``C`` seconds, and so on. Policy ``restart``
  (the supervisor's re-plan): a hit loses the work since the last complete checkpoint and costs a restart
  (``R`` seconds) on the devices left. Policy ``in-place`` (torchft-style): the survivors go on, losing only
  the step in flight, after a reconfiguration (``R``). Either way, until the trace's replacements arrive the
  job runs on fewer devices: the delay is charged as lost time in proportion to the share of devices lost;
- every device of the plan is paid for the whole wall time (survivors are held while waiting).

It is vectorised over jobs: one pass over the loss events (numpy over all jobs at once), so thousands of jobs
simulate per second (``benchmarks/bench_plan.py``: ``simulate_jobs_per_s``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt

from starverse.elastic.traces import bamboo_events
from starverse.errors import ConfigError, InfeasiblePlanError

FloatArray = npt.NDArray[np.float64]
MAX_WINDOWS = 50
"""Windows of losses (each 1.25 x the job's checkpointed compute time) simulated before the jobs are declared
unable to finish: losses come faster than a checkpoint (or a restart) completes."""
MAX_EVENTS = 20_000_000
"""Most loss events drawn at once (jobs x the trace's losses over one window): 160 MB per array."""
MAX_TOTAL_EVENTS = 5 * MAX_EVENTS
"""Most loss events drawn over all windows (a few seconds of work per ten million) before the jobs are declared
unable to finish."""
Policy = Literal["restart", "in-place"]
POLICIES: tuple[str, ...] = ("restart", "in-place")


@dataclass(frozen=True)
class Trace:
    """A preemption trace as loss events, with the delay until each loss was replaced."""

    source: str
    """The trace file."""
    duration_s: float
    """Length of the trace (it is replayed cyclically)."""
    event_s: FloatArray
    """Times of the loss events, seconds from the trace's start."""
    lost: FloatArray
    """Nodes taken back at each event."""
    alive_before: FloatArray
    """Nodes alive just before each event."""
    delay_s: FloatArray
    """Time until the cluster was back to ``alive_before`` nodes (cyclically; at most the trace's length)."""
    node_hours: float
    """Integral of the live nodes over the trace."""

    @property
    def mean_nodes(self) -> float:
        """Average live nodes."""
        return self.node_hours * 3600.0 / self.duration_s

    @property
    def removals_per_node_hour(self) -> float:
        """Per-device loss rate: what a pool's ``interruptions_per_hour`` means."""
        return float(self.lost.sum()) / self.node_hours if self.node_hours > 0 else 0.0


def _from_series(source: str, times_s: Sequence[float], counts: Sequence[int]) -> Trace:
    """``counts[i]`` nodes alive from ``times_s[i]`` on (after the changes at that time)."""
    t = np.asarray(times_s, dtype=np.float64)
    c = np.asarray(counts, dtype=np.float64)
    if t.size < 2 or t[-1] <= t[0]:
        raise ConfigError(f"{source}: trace too short (need records spanning some time)")
    t = t - t[0]
    duration = float(t[-1])
    node_hours = float(np.sum(c[:-1] * np.diff(t))) / 3600.0
    before = np.r_[c[0], c[:-1]]
    drop = np.maximum(before - c, 0.0)
    idx = np.flatnonzero(drop > 0)
    # replacement delay: first later record (cyclically) whose count is back to the level before the loss
    tt = np.r_[t, t + duration]
    cc = np.r_[c, c]
    delays = np.empty(idx.size)
    for j, i in enumerate(idx):
        later = np.flatnonzero(cc[i + 1:] >= before[i])
        delays[j] = min(float(tt[i + 1 + later[0]] - t[i]), duration) if later.size else duration
    return Trace(source, duration, t[idx], drop[idx], before[idx], delays, node_hours)


def load_trace_events(path: str | Path) -> Trace:
    """Read a trace: Bamboo CSV (``milliseconds,add|remove,node``) or "Can't Be Late" JSON (nodes alive per
    tick of ``metadata.gap_seconds``). Bad files raise :class:`ConfigError` naming the file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: trace file not found; bundled traces are under data/traces/")
    try:
        if p.suffix == ".csv":
            events = bamboo_events(p)
            times = sorted(events)
            counts = np.cumsum([events[x][0] - events[x][1] for x in times]).tolist()
            return _from_series(str(p), times, counts)
        doc = json.loads(p.read_text())
        gap = float(doc["metadata"]["gap_seconds"])
        data = [int(x) for x in doc["data"]]
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise ConfigError(f"{p}: malformed trace ({e}); expected Bamboo CSV or {{'metadata': {{'gap_seconds'}}, "
                          "'data': [...]}}") from None
    return _from_series(str(p), [i * gap for i in range(len(data))], data)


@dataclass(frozen=True)
class SimJob:
    """What the simulation needs of a plan."""

    work_s: float
    """Compute time of the whole job without interruptions or checkpoints."""
    num_devices: int
    """Spot devices of the plan (all of them take part in every loss)."""
    checkpoint_s: float
    """Time training is blocked per checkpoint (C)."""
    interval_s: float
    """Work between checkpoints (τ)."""
    restart_s: float
    """Relaunch and checkpoint load after a loss (R); with ``in-place`` the reconfiguration time."""
    step_s: float
    """One optimizer step (what ``in-place`` loses per hit)."""
    price_per_hour: float
    """All devices of the plan, per hour."""


@dataclass(frozen=True)
class SimResult:
    """Per simulated job: wall time, cost and redone work."""

    wall_s: FloatArray
    """Wall time to finish."""
    redone_s: FloatArray
    """Work done twice (lost to interruptions)."""
    cost: FloatArray
    """Paid for the wall time."""
    work_s: float
    """The job's uninterrupted compute time."""

    def p(self, q: float) -> dict[str, float]:
        """Quantile ``q`` (0-100) of wall hours, cost, redone hours and the wall-time factor."""
        wall = float(np.percentile(self.wall_s, q))
        return {"wall_hours": wall / 3600.0, "cost": float(np.percentile(self.cost, q)),
                "redone_hours": float(np.percentile(self.redone_s, q)) / 3600.0, "factor": wall / self.work_s}

    @property
    def factor_p50(self) -> float:
        """Median wall time over the uninterrupted compute time (the simulated spot factor)."""
        return float(np.median(self.wall_s)) / self.work_s


def _hit_probability(lost: FloatArray, alive: FloatArray, held: float) -> FloatArray:
    """``1 - C(c - m, k) / C(c, k)``: a loss of ``k`` of ``c`` nodes takes at least one of the job's ``m``."""
    k = lost.astype(np.int64)
    miss = np.ones(lost.shape)
    for j in range(int(k.max(initial=0))):
        term = np.clip((alive - held - j) / np.maximum(alive - j, 1.0), 0.0, 1.0)
        miss = np.where(j < k, miss * term, miss)
    return np.where(held >= alive, 1.0, 1.0 - miss)


def _copies(traces: Sequence[tuple[Trace, int]], runs: int, rng: np.random.Generator
            ) -> list[tuple[Trace, float, FloatArray, FloatArray, FloatArray]]:
    """The job's devices spread over copies of each trace: per copy, the trace, the devices it holds, the
    probability each event hits them, the devices lost given a hit, and each job's random start offset."""
    out = []
    for trace, n in traces:
        copies = max(1, math.ceil(n / max(trace.mean_nodes, 1e-9)))
        held = np.full(copies, n // copies, dtype=np.float64)
        held[: n % copies] += 1
        for m in held:
            p = _hit_probability(trace.lost, trace.alive_before, m)
            with np.errstate(divide="ignore", invalid="ignore"):
                got = np.clip(trace.lost * m / trace.alive_before / np.maximum(p, 1e-12), 1.0, m)
            # stratified starts (one per 1/runs of the trace, in random order): the start point is most of the
            # spread between jobs, so this steadies the quantiles without biasing them
            start = (rng.permutation(runs) + rng.random(runs)) / runs * trace.duration_s
            out.append((trace, float(m), p, got, start[:, None]))
    return out


def _events(copies: Sequence[tuple[Trace, float, FloatArray, FloatArray, FloatArray]], num_devices: int,
            t_from: float, t_to: float, rng: np.random.Generator) -> tuple[FloatArray, FloatArray, FloatArray]:
    """Per job, the losses in ``[t_from, t_to)`` that hit it (times sorted, inf-padded), their replacement
    delays, and the share of the job's devices each takes."""
    times, delays, shares = [], [], []
    for trace, _, p, got, offset in copies:
        first = math.floor(t_from / trace.duration_s)
        cycles = math.ceil(t_to / trace.duration_s) + 1 - first
        base = (trace.event_s[None, :] + trace.duration_s * (first + np.arange(cycles))[:, None]).ravel()
        t = base[None, :] - offset
        hit = (rng.random(t.shape) < np.tile(p, cycles)[None, :]) & (t >= t_from) & (t < t_to)
        times.append(np.where(hit, t, np.inf))
        delays.append(np.tile(trace.delay_s, cycles))
        shares.append(np.tile(got / num_devices, cycles))
    t_all = np.concatenate(times, axis=1)
    keep = int(np.isfinite(t_all).sum(axis=1).max(initial=0))
    order = np.argsort(t_all, axis=1, kind="stable")[:, :keep]
    # one gather of the times; delays and shares are per event column, looked up through `order`
    return np.take_along_axis(t_all, order, axis=1), np.concatenate(delays)[order], np.concatenate(shares)[order]


def simulate(job: SimJob, traces: Sequence[tuple[Trace, int]], policy: Policy = "restart", runs: int = 1000,
             seed: int = 0) -> SimResult:
    """Simulate ``runs`` jobs on ``traces`` (each: a trace and how many of the job's devices it carries)."""
    if policy not in POLICIES:
        raise ConfigError(f"unknown policy '{policy}'; use one of: {', '.join(POLICIES)}")
    if runs < 1:
        raise ConfigError(f"--runs must be at least 1 (got {runs})")
    rng = np.random.default_rng(seed)
    tau, c = job.interval_s, job.checkpoint_s
    cycle = tau + c
    copies = _copies(traces, runs, rng)
    done = np.zeros(runs)
    redone = np.zeros(runs)
    seg = np.zeros(runs)  # when the current stretch of work started (right after a checkpoint load)
    finish = np.full(runs, np.nan)
    window = job.work_s * (1.0 + c / tau) * 1.25 + 3600.0
    events = sum(runs * t.event_s.size * (window / t.duration_s + 2) for t, *_ in copies)
    if events > MAX_EVENTS:
        raise ConfigError(f"the simulation would draw {events:,.0f} loss events at once ({runs:,} jobs over "
                          f"{window / 3600:,.0f} h of losses, checkpoints of {c:,.1f} s every {tau:,.3g} s of work); "
                          f"the most is {MAX_EVENTS:,}. To fix: fewer --runs, a longer --interval-s or a shorter job")
    windows = int(min(MAX_WINDOWS, max(MAX_TOTAL_EVENTS // max(events, 1.0), 2)))
    t_from = 0.0
    while np.isnan(finish).any():
        if t_from >= windows * window:
            raise InfeasiblePlanError(
                f"the simulated jobs do not finish within {t_from / 3600:,.0f} h ({windows * 1.25:g} x their "
                f"checkpointed compute time): losses come faster than a checkpoint ({c:,.1f} s) after "
                f"{tau:,.3g} s of work, plus a restart ({job.restart_s:,.0f} s), completes",
                ["To fix: faster checkpoints (--checkpoint-gb-per-s), a shorter restart (--restart-s), fewer "
                 "devices on spot, or a trace with fewer losses"])
        # losses are drawn a window at a time, so a long job does not pay for a horizon it may not need
        t_to = t_from + window
        t_ev, delay, share = _events(copies, job.num_devices, t_from, t_to, rng)
        width = t_ev.shape[1]
        # per job, the next loss not yet handled; losses during a restart (before `seg`) are stepped over.
        # Only the jobs still running are touched: `live` shrinks as jobs finish or run out of losses
        last = max(width - 1, 0)
        live = np.flatnonzero(np.isnan(finish)) if width else np.zeros(0, dtype=np.int64)
        ptr = np.zeros(live.size, dtype=np.int64)
        while live.size:
            s0 = seg[live]
            t_hit = t_ev[live, np.minimum(ptr, last)]
            stale = (ptr < width) & (t_hit <= s0)
            while stale.any():
                ptr += stale
                t_hit = t_ev[live, np.minimum(ptr, last)]
                stale = (ptr < width) & (t_hit <= s0)
            more = (ptr < width) & np.isfinite(t_hit)
            live, ptr, t_hit, s0 = live[more], ptr[more], t_hit[more], s0[more]
            if not live.size:
                break
            col = ptr
            ptr = ptr + 1
            d0 = done[live]
            dt = t_hit - s0
            cycles = np.floor(dt / cycle)
            into = dt - cycles * cycle
            worked = cycles * tau + np.minimum(into, tau)
            ends = d0 + worked >= job.work_s
            finish[live[ends]] = s0[ends] + _time_for(job.work_s - d0[ends], tau, cycle)
            hit = ~ends
            lost = np.minimum(into, tau) if policy == "restart" else np.minimum(np.minimum(into, tau), job.step_s)
            h = live[hit]
            done[h] = d0[hit] + worked[hit] - lost[hit]
            redone[h] += lost[hit]
            seg[h] = t_hit[hit] + job.restart_s + delay[h, col[hit]] * share[h, col[hit]]
            live, ptr = h, ptr[hit]
        # jobs that finish before the next window's first loss
        end = seg + _time_for(job.work_s - done, tau, cycle)
        finish = np.where(np.isnan(finish) & (end <= t_to), end, finish)
        t_from = t_to
    return SimResult(finish, redone, finish / 3600.0 * job.price_per_hour, job.work_s)


def _time_for(work_s: FloatArray, tau: float, cycle: float) -> FloatArray:
    """Wall time to do ``work_s`` from a fresh start, checkpointing after every ``tau`` of work."""
    full = np.floor(work_s / tau)
    return np.asarray(full * cycle + (work_s - full * tau), dtype=np.float64)
