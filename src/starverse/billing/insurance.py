"""Training insurance: after a preemption, the work redone and the restart time are credited.

For each preemption the job (not the single device) loses the work since its last checkpoint (or since it
last resumed, whichever is later) and waits until it resumes. Both intervals are priced at what the job's
leases actually cost in them (:func:`starverse.billing.rating.interval_ticks`), so a credit never exceeds
what was charged. Further preemptions while the job is already down add nothing: the restart interval of
the first one covers them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from enum import StrEnum
from typing import Any

from starverse.billing.money import ticks_to_decimal
from starverse.billing.rating import PricingMode, Segment, interval_ticks


class EventKind(StrEnum):
    """Things that happen to a job, recorded in the ledger."""

    PREEMPTION = "preemption"
    """Devices were taken back (spot) or lost; work since the last checkpoint is lost."""
    CHECKPOINT = "checkpoint"
    """A complete checkpoint exists as of this time."""
    RESUME = "resume"
    """Training runs again (from the last checkpoint)."""
    STOP = "stop"
    """The job stopped on purpose."""
    BUDGET_STOP = "budget_stop"
    """The job stopped because the next interval would exceed its total budget."""


@dataclass(frozen=True)
class Event:
    """One recorded event."""

    id: int
    job_id: int
    lease_id: int | None
    kind: EventKind
    at_s: int
    step: int | None
    detail: Mapping[str, Any]


class CreditKind(StrEnum):
    """What a credit refunds."""

    REDO = "redo"
    """Work between the last checkpoint (or resume) and the preemption, which had to be done again."""
    RESTART = "restart"
    """Time between the preemption and the resume."""


@dataclass(frozen=True)
class Credit:
    """One itemised credit line."""

    job_id: int
    lease_id: int
    """The lease whose charges in the interval are refunded."""
    kind: CreditKind
    preemption_event: int
    """Id of the preemption event this credit is for."""
    start_s: int
    end_s: int
    ticks: int
    """Amount in ticks of the job currency (see ``money``)."""

    @property
    def seconds(self) -> int:
        """Length of the credited interval."""
        return self.end_s - self.start_s

    @property
    def amount(self) -> Decimal:
        """Amount as ``Decimal`` (6 places)."""
        return ticks_to_decimal(self.ticks)


@dataclass(frozen=True)
class PricedLease:
    """What insurance needs of a lease."""

    id: int
    mode: PricingMode
    start_s: int
    end_s: int | None
    segments: Sequence[Segment]


def credit_intervals(job_start_s: int, events: Sequence[Event]) -> list[tuple[CreditKind, Event, int, int]]:
    """``(kind, preemption, start_s, end_s)`` of every interval the job is insured for, from its events.

    The redone work starts at the checkpoint the job resumed from when the resume event names its step
    and a checkpoint of that step was recorded before the preemption (a checkpoint that was still being
    written when the job died is not the one it resumes from); else at the last checkpoint or resume. A loss
    survived in place (``detail.in_place_from_s``: when the step in flight started) redoes only that step.
    """
    out: list[tuple[CreditKind, Event, int, int]] = []
    safe_s = job_start_s  # work before this time is safe (checkpointed, or from before the last resume)
    resumed_s = job_start_s
    checkpoints: list[Event] = []
    down: Event | None = None  # the preemption the job has not resumed from yet
    for ev in sorted(events, key=lambda e: (e.at_s, e.id)):
        if ev.kind == EventKind.CHECKPOINT and down is None:
            safe_s = max(safe_s, ev.at_s)
            checkpoints.append(ev)
        elif ev.kind == EventKind.PREEMPTION and down is None:
            down = ev
        elif ev.kind == EventKind.RESUME and down is not None:
            start = safe_s
            used = [c for c in checkpoints if ev.step is not None and c.step == ev.step]
            if used:
                start = max(used[-1].at_s, resumed_s)
            in_place_from = down.detail.get("in_place_from_s")
            if in_place_from is not None:  # in-place recovery: only the step in flight is redone
                start = max(start, int(in_place_from))
            if down.at_s > start:
                out.append((CreditKind.REDO, down, start, down.at_s))
            if ev.at_s > down.at_s:
                out.append((CreditKind.RESTART, down, down.at_s, ev.at_s))
            safe_s = resumed_s = max(safe_s, ev.at_s)
            down = None
    if down is not None:  # not resumed (yet): the lost work is already known
        start = max(safe_s, int(down.detail.get("in_place_from_s", safe_s)))
        if down.at_s > start:
            out.append((CreditKind.REDO, down, start, down.at_s))
    return out


def compute_credits(job_id: int, job_start_s: int, events: Sequence[Event],
                    leases: Sequence[PricedLease]) -> list[Credit]:
    """Itemised credits (one line per lease and interval) of one job from its events and leases."""
    credits: list[Credit] = []
    for kind, preemption, a, b in credit_intervals(job_start_s, events):
        for le in leases:
            ticks = interval_ticks(le.mode, le.start_s, le.end_s, le.segments, a, b)
            if ticks > 0:
                lo = max(a, le.start_s)
                hi = b if le.end_s is None else min(b, le.end_s)
                credits.append(Credit(job_id, le.id, kind, preemption.id, lo, hi, ticks))
    return credits
