"""A job's bill from the ledger, and the checks made on the ledger before a job is launched."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

from starverse.billing import Ledger, ticks_to_decimal
from starverse.billing.insurance import EventKind
from starverse.elastic.supervisor import read_progress
from starverse.errors import BillingError, BudgetExceededError


@dataclass(frozen=True)
class LeaseBill:
    """What one lease (one device of one run) was charged."""

    lease: int
    """Lease id in the ledger."""
    device: str
    """``host/rankN``."""
    accelerator: str
    """Accelerator id."""
    mode: str
    """``on-demand``, ``spot`` or ``free``."""
    price_per_hour: str
    """Price per device-hour, in ``price_currency``."""
    price_currency: str
    """The offer's currency."""
    seconds: int | None
    """Seconds billed (None while the lease is open)."""
    charges: str
    """Charges in the job's currency (exact decimal string)."""
    charge_ticks: int
    """The same in ticks."""
    open: bool
    """True while the lease is still open (a run died: closed when the job runs again)."""


@dataclass(frozen=True)
class CreditBill:
    """One insurance credit."""

    lease: int
    """The lease it credits."""
    kind: str
    """What it pays back (lost work, checkpoint time, ...)."""
    seconds: int
    """Seconds credited."""
    amount: str
    """Amount (exact decimal string)."""
    ticks: int
    """The same in ticks."""


@dataclass(frozen=True)
class JobBill:
    """The bill of one job of a ledger: charges per lease, insurance credits apart, exact ticks."""

    ledger: str
    """Ledger file."""
    job: str
    """Job name."""
    currency: str
    """The job's currency."""
    leases: tuple[LeaseBill, ...]
    """One per device per run."""
    credits: tuple[CreditBill, ...]
    """Insurance credits."""
    charge_ticks: int
    """All charges, in ticks."""
    credit_ticks: int
    """All credits, in ticks."""
    events: tuple[tuple[str, int | None], ...]
    """(kind, step) of every event in order."""

    @property
    def charges(self) -> str:
        """All charges (exact decimal string)."""
        return str(ticks_to_decimal(self.charge_ticks))

    @property
    def credit(self) -> str:
        """All credits (exact decimal string)."""
        return str(ticks_to_decimal(self.credit_ticks))

    @property
    def net(self) -> str:
        """Charges minus credits."""
        return str(ticks_to_decimal(self.charge_ticks - self.credit_ticks))

    @property
    def open_leases(self) -> int:
        """Leases left open by a run that died."""
        return sum(1 for x in self.leases if x.open)

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly form (``train --json``, the service)."""
        return {
            "ledger": self.ledger, "job": self.job, "currency": self.currency,
            "leases": [x.__dict__.copy() for x in self.leases],
            "charges": self.charges, "charge_ticks": self.charge_ticks,
            "credits": [c.__dict__.copy() for c in self.credits],
            "credit": self.credit, "credit_ticks": self.credit_ticks, "net": self.net,
            "events": [{"kind": k, "step": s} for k, s in self.events], "open_leases": self.open_leases,
        }


def job_bill(ledger_path: str | Path, job_name: str) -> JobBill:
    """The bill of ``job_name`` in the ledger at ``ledger_path``."""
    with Ledger.open(ledger_path, create=False) as ledger:
        job = ledger.job(job_name)
        leases = []
        for le in ledger.leases(job):
            rows = ledger.charges(le.id)
            ticks = sum(r.ticks for r in rows)
            leases.append(LeaseBill(
                lease=le.id, device=le.device, accelerator=le.accelerator, mode=le.mode.value,
                price_per_hour=f"{le.offer_price.normalize():f}", price_currency=le.offer_currency,
                seconds=sum(r.seconds for r in rows) if le.end_s is not None else None,
                charges=str(ticks_to_decimal(ticks)), charge_ticks=ticks, open=le.end_s is None,
            ))
        credits = tuple(CreditBill(lease=c.lease_id, kind=c.kind.value, seconds=c.seconds, amount=str(c.amount),
                                   ticks=c.ticks) for c in ledger.credits(job))
        events = tuple((e.kind.value, e.step) for e in ledger.events(job))
    return JobBill(
        ledger=str(ledger_path), job=job.name, currency=job.currency, leases=tuple(leases), credits=credits,
        charge_ticks=sum(x.charge_ticks for x in leases), credit_ticks=sum(c.ticks for c in credits), events=events,
    )


def check_ledger_job(ledger_path: Path, name: str, currency: str, budget_total: Decimal | None,
                     source: str) -> None:
    """Before launching: a job already in the ledger must keep its currency and have budget left."""
    if not ledger_path.is_file():
        return
    with Ledger.open(ledger_path, create=False) as ledger:
        try:
            job = ledger.job(name)
        except BillingError:
            return  # a new job in an existing ledger
        if job.currency != currency:
            raise BillingError(
                f"{source}: billing.currency: job '{name}' in {ledger_path} is billed in {job.currency}, not "
                f"{currency}. To fix: set billing.currency: {job.currency} (other prices are converted), or "
                "name another job (billing.job)."
            )
        budget = budget_total if budget_total is not None else job.budget_total
        if budget is None:
            return
        # leases a dead run left open are closed at their last heartbeat when the job starts: count them so
        open_leases = ledger.leases(job, open_only=True)
        spent = ledger.spent(job, at_s=max((le.last_seen_s for le in open_leases), default=None))
    if spent >= budget:
        raise BudgetExceededError(
            f"{source}: billing.budget_total: job '{name}' has spent {spent} {currency} of its total budget "
            f"{budget} {currency} ({ledger_path}). To fix: raise billing.budget_total to continue it, or name "
            "another job (billing.job)."
        )


class InplaceAccounting:
    """The ledger side of in-place recovery (``recovery: in-place``), run in the supervisor's process.

    Hooked to :class:`~starverse.elastic.inplace.InplaceLauncher` (``on_loss``, ``on_join``):

    - a lost replica's lease ends at the loss (the launcher's time); a ``preemption`` event is recorded with
      ``detail.in_place_from_s``: when the step in flight started (the last completed step's time), so the
      insurance credit covers that step only (:func:`starverse.billing.insurance.credit_intervals`), not the
      work since the last checkpoint: nothing before it is redone;
    - a ``resume`` event is recorded when the survivors complete that step (the next progress record);
    - a replacement gets its own lease from the moment it is started (priced like the device it replaces);
    - :meth:`close` ends, at the end of the run, the leases still open that the leader's billing did not
      close (a replacement's).
    """

    def __init__(self, ledger_path: Path, job_name: str, run_dir: Path, pricing_of: Any, provider: str = "local"):
        """``pricing_of(accelerator) -> LeasePricing`` for a replacement's lease."""
        self.ledger_path, self.job_name, self.run_dir = Path(ledger_path), job_name, Path(run_dir)
        self.pricing_of, self.provider = pricing_of, provider
        self._waits: list[Any] = []

    def _device(self, rank: int) -> str:
        return f"{socket.gethostname()}/rank{rank}"

    def on_loss(self, loss: Any) -> None:
        """End the lost replica's lease at the loss; record the loss and, once the step in flight is done, the
        resume."""
        if not self.ledger_path.is_file():
            return
        at = int(loss.at)
        progress = read_progress(self.run_dir) or {}
        step = int(progress.get("step", 0))
        started = int(progress.get("time", at))
        with Ledger.open(self.ledger_path) as ledger:
            job = ledger.job(self.job_name)
            lease_ids = [le.id for le in ledger.leases(job, open_only=True) if le.device == self._device(loss.error.rank)]
            for lease_id in lease_ids:
                ledger.close_lease(lease_id, max(at, ledger.lease(lease_id).start_s))
            ledger.record_event(job, EventKind.PREEMPTION, at_s=at, step=step, detail={
                "in_place": True, "in_place_from_s": min(started, at), "rank": loss.error.rank,
                "device_kind": loss.error.device_kind, "leases": lease_ids})
        t = threading.Thread(target=self._resume_after, args=(step,), name="inplace-resume", daemon=True)
        t.start()
        self._waits.append(t)

    def _resume_after(self, step: int, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            p = read_progress(self.run_dir)
            if p is not None and int(p.get("step", 0)) > step:
                with Ledger.open(self.ledger_path) as ledger:
                    ledger.record_event(ledger.job(self.job_name), EventKind.RESUME, at_s=int(p["time"]), step=step,
                                        detail={"in_place": True})
                return
            time.sleep(0.05)

    def on_join(self, join: Any, spec: Any) -> None:
        """Open the replacement's lease from now (the ledger counts whole seconds: after the start of the lost
        lease of that device, which may have begun in the second of the loss and of this join, a warm spare's)."""
        if not self.ledger_path.is_file():
            return
        device = self._device(join.rank)
        with Ledger.open(self.ledger_path) as ledger:
            job = ledger.job(self.job_name)
            start = max([int(join.at)] + [le.start_s + 1 for le in ledger.leases(job) if le.device == device])
            ledger.open_lease(job, device, join.device_kind, self.pricing_of(join.device_kind),
                              provider=self.provider, at_s=start)

    def close(self) -> None:
        """After the run: wait for pending resume records, close leases left open (a replacement's) now."""
        for t in self._waits:
            t.join(timeout=5.0)
        self._waits = []
        if not self.ledger_path.is_file():
            return
        with Ledger.open(self.ledger_path) as ledger:
            job = ledger.job(self.job_name)
            for le in ledger.leases(job, open_only=True):
                ledger.close_lease(le.id, max(le.last_seen_s, le.start_s))
