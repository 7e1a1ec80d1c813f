"""The per-second billing ledger: jobs, leases, price segments, events and charges in SQLite (WAL).

Every public method is one transaction: either all of it is on disk or none of it. With WAL and
``synchronous=NORMAL`` a committed transaction survives the process being killed at any point (a power cut
may lose the last few commits, never tear one). A lease's charge rows are written in the same transaction
that closes it, under a ``(lease_id, seq)`` primary key, so a lease can never be charged twice; a process
that died with leases open leaves them open with their last heartbeat, and :meth:`Ledger.recover` closes
them there.

The runtime's view is small::

    ledger = Ledger.open(run_dir / "ledger.sqlite")
    job = ledger.start_job("llama-run", currency="USD", budget_total=Decimal("50"))
    lease = ledger.open_lease(job, "host:cuda:0", "h100-80gb-sxm", LeasePricing(PricingMode.SPOT, "2.10"))
    ledger.set_price(lease, "2.35", at_s=...)               # spot price changed
    ledger.record_event(job, EventKind.CHECKPOINT, step=100)
    ledger.close_lease(lease)
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterable, Mapping
from decimal import ROUND_HALF_EVEN, Decimal
from pathlib import Path
from typing import Any

from starverse.billing.insurance import (
    Credit,
    Event,
    EventKind,
    PricedLease,
    compute_credits,
    credit_intervals,
)
from starverse.billing.money import (
    TICKS_PER_MICRO,
    fx_rate,
    micros_to_decimal,
    normalize_currency,
    price_to_micros,
    ticks_to_decimal,
    to_decimal,
)
from starverse.billing.rating import (
    ChargeKind,
    ChargeRow,
    PricingMode,
    Segment,
    accrued_ticks,
    hourly_rate_micros,
    rate_lease,
)
from starverse.billing.records import (
    JOB_COLS,
    LEASE_COLS,
    Job,
    Lease,
    LeasePricing,
    Payment,
    PaymentKind,
    id_of,
    to_job,
    to_lease,
)
from starverse.billing.store import LEDGER_FILE, LedgerFile
from starverse.errors import BillingError, BudgetExceededError

__all__ = ["LEDGER_FILE", "Job", "Lease", "LeasePricing", "Ledger", "Payment", "PaymentKind", "budget_ticks"]

_PAYMENT_COLS = "id, kind, currency, amount_micros, at_s, ref, note"


def _now() -> int:
    return int(time.time())


class Ledger(LedgerFile):
    """An open ledger file. Use :meth:`open`; close with :meth:`close` or a ``with`` block."""

    # ---------------------------------------------------------------- jobs
    def start_job(self, name: str, *, currency: str = "USD", budget_total: Decimal | str | int | None = None,
                  max_budget_per_hour: Decimal | str | int | None = None, run_dir: str | Path | None = None,
                  at_s: int | None = None) -> Job:
        """The job called ``name``, created if new (a resumed run gets the same job back).

        Budgets given here replace the stored ones; ``None`` keeps them.
        """
        ccy = normalize_currency(currency)
        total = None if budget_total is None else price_to_micros(budget_total, "budget_total")
        hourly = None if max_budget_per_hour is None else price_to_micros(max_budget_per_hour, "max_budget_per_hour")
        with self._tx() as c:
            row = c.execute(f"SELECT {JOB_COLS} FROM jobs WHERE name = ?", (name,)).fetchone()
            if row is None:
                c.execute("INSERT INTO jobs (name, currency, budget_total_micros, max_per_hour_micros, run_dir, "
                          "created_s) VALUES (?,?,?,?,?,?)",
                          (name, ccy, total, hourly, None if run_dir is None else str(run_dir),
                           _now() if at_s is None else at_s))
            else:
                if row[2] != ccy:
                    raise BillingError(f"job {name!r} is billed in {row[2]}, not {ccy}. To fix: start it with "
                                       f"currency={row[2]!r} (prices in other currencies are converted)")
                if total is not None:
                    c.execute("UPDATE jobs SET budget_total_micros = ? WHERE id = ?", (total, row[0]))
                if hourly is not None:
                    c.execute("UPDATE jobs SET max_per_hour_micros = ? WHERE id = ?", (hourly, row[0]))
            return to_job(c.execute(f"SELECT {JOB_COLS} FROM jobs WHERE name = ?", (name,)).fetchone())

    def job(self, job: Job | int | str) -> Job:
        """A job by id, name or a stale ``Job`` value (re-read)."""
        if isinstance(job, str):
            row = self._conn.execute(f"SELECT {JOB_COLS} FROM jobs WHERE name = ?", (job,)).fetchone()
        else:
            row = self._conn.execute(f"SELECT {JOB_COLS} FROM jobs WHERE id = ?", (id_of(job),)).fetchone()
        if row is None:
            raise BillingError(f"no job {job!r} in {self.path}; `starverse bill --by job` lists them")
        return to_job(row)

    def jobs(self) -> list[Job]:
        """All jobs, oldest first."""
        return [to_job(r) for r in self._conn.execute(f"SELECT {JOB_COLS} FROM jobs ORDER BY id")]

    # ---------------------------------------------------------------- leases
    def open_lease(self, job: Job | int, device: str, accelerator: str, pricing: LeasePricing, *,
                   provider: str = "local", offer: str | None = None, at_s: int | None = None) -> Lease:
        """Start renting ``device`` for ``job`` at ``at_s`` (default now).

        Refused (``BillingError``) if the device already has a lease over that time, and
        (``BudgetExceededError``) if the job's open leases plus this one would cost more per hour than
        ``max_budget_per_hour``.
        """
        start = _now() if at_s is None else int(at_s)
        with self._tx() as c:
            j = self.job(job)
            offer_ccy = normalize_currency(pricing.currency)
            rate = fx_rate(offer_ccy, j.currency)
            offer_micros = price_to_micros(pricing.price, "price")
            micros = price_to_micros((pricing.price * rate).quantize(Decimal("0.000001"), ROUND_HALF_EVEN))
            # leases of a device never overlap: only the one that starts last can overlap a new open lease.
            # Leases are half-open [start_s, end_s) in whole seconds (as `bill --check` reads them): a lease
            # that started and ended within the second the new one starts in does not overlap it.
            clash = c.execute("SELECT id, job_id, start_s, end_s FROM leases WHERE device = ? "
                              "ORDER BY start_s DESC, id DESC LIMIT 1", (device,)).fetchone()
            if clash is not None and (clash[3] is None or clash[3] > start):
                until = "still open" if clash[3] is None else f"until {clash[3]}"
                raise BillingError(f"device {device!r} already has lease {clash[0]} (job {clash[1]}) from "
                                   f"{clash[2]} {until}, overlapping a new lease from {start}. To fix: close "
                                   "that lease first (`Ledger.recover` closes leases of a dead process)")
            if j.max_budget_per_hour is not None:
                burn = self._burn_micros(c, j.id) + hourly_rate_micros(pricing.mode, micros)
                limit = price_to_micros(j.max_budget_per_hour)
                if burn > limit:
                    raise BudgetExceededError(
                        f"lease of {device!r} ({accelerator}) refused: job {j.name!r} would cost "
                        f"{micros_to_decimal(burn)} {j.currency}/h, above max_budget_per_hour "
                        f"{j.max_budget_per_hour}. To fix: raise the budget or use fewer/cheaper devices")
            cur = c.execute(
                "INSERT INTO leases (job_id, device, accelerator, provider, offer, mode, offer_price_micros, "
                "offer_currency, fx_rate, granularity_s, start_s, end_s, last_seen_s) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?,NULL,?)",
                (j.id, device, accelerator, provider, offer, pricing.mode.value, offer_micros, offer_ccy,
                 str(rate), pricing.granularity_s, start, start))
            lease_id = int(cur.lastrowid or 0)
            c.execute("INSERT INTO price_segments VALUES (?,?,?)", (lease_id, start, micros))
            return Lease(lease_id, j.id, device, accelerator, provider, offer, pricing.mode,
                         micros_to_decimal(offer_micros), offer_ccy, rate, pricing.granularity_s, start, None, start)

    def _burn_micros(self, c: sqlite3.Connection, job_id: int) -> int:
        """What the job's open leases cost per hour now (last price of each)."""
        rows = c.execute(
            "SELECT l.mode, (SELECT price_micros FROM price_segments s WHERE s.lease_id = l.id "
            "ORDER BY s.start_s DESC LIMIT 1) FROM leases l WHERE l.job_id = ? AND l.end_s IS NULL", (job_id,))
        return sum(hourly_rate_micros(PricingMode(m), p) for m, p in rows)

    def burn_rate(self, job: Job | int) -> Decimal:
        """The job's open leases' cost per hour, in the job currency."""
        return micros_to_decimal(self._burn_micros(self._conn, id_of(job)))

    def lease(self, lease: Lease | int) -> Lease:
        """A lease by id (re-read)."""
        row = self._conn.execute(f"SELECT {LEASE_COLS} FROM leases WHERE id = ?", (id_of(lease),)).fetchone()
        if row is None:
            raise BillingError(f"no lease {id_of(lease)} in {self.path}")
        return to_lease(row)

    def leases(self, job: Job | int | None = None, *, open_only: bool = False) -> list[Lease]:
        """Leases (of one job, or all), oldest first."""
        sql = f"SELECT {LEASE_COLS} FROM leases WHERE 1=1"
        args: list[Any] = []
        if job is not None:
            sql += " AND job_id = ?"
            args.append(id_of(job))
        if open_only:
            sql += " AND end_s IS NULL"
        return [to_lease(r) for r in self._conn.execute(sql + " ORDER BY id", args)]

    def segments(self, lease: Lease | int) -> list[Segment]:
        """Price segments of a lease (job currency, micro-units), in time order."""
        return [Segment(s, p) for s, p in self._conn.execute(
            "SELECT start_s, price_micros FROM price_segments WHERE lease_id = ? ORDER BY start_s", (id_of(lease),))]

    def set_price(self, lease: Lease | int, price: Decimal | str | int | float, *, at_s: int | None = None) -> None:
        """A spot price change: from ``at_s`` on, the lease costs ``price`` (offer currency) per hour."""
        self.record_prices(lease, [(_now() if at_s is None else int(at_s), price)])

    def record_prices(self, lease: Lease | int, prices: Iterable[tuple[int, Decimal | str | int | float]]) -> None:
        """Several spot price changes ``(at_s, price)`` in one transaction (e.g. a provider's price trace)."""
        with self._tx() as c:
            row = c.execute(f"SELECT {LEASE_COLS}, (SELECT MAX(start_s) FROM price_segments s WHERE s.lease_id = "
                            "leases.id) FROM leases WHERE id = ?", (id_of(lease),)).fetchone()
            if row is None:
                raise BillingError(f"no lease {id_of(lease)} in {self.path}")
            le, last = to_lease(row), int(row[-1])
            if le.mode != PricingMode.SPOT:
                raise BillingError(f"lease {le.id} is {le.mode.value}: its price is fixed; only spot prices change")
            if le.end_s is not None:
                raise BillingError(f"lease {le.id} closed at {le.end_s}; a price change after that is not billable")
            rows = []
            for at_s, price in prices:
                t = int(at_s)
                if t <= last:
                    raise BillingError(f"lease {le.id}: price change at {t} is not after the previous one ({last}); "
                                       "price changes must be recorded in time order")
                offered = to_decimal(price, "price")
                price_to_micros(offered, "price")  # a negative price is refused before any conversion
                micros = price_to_micros((offered * le.fx_rate).quantize(Decimal("0.000001"), ROUND_HALF_EVEN))
                rows.append((le.id, t, micros))
                last = t
            c.executemany("INSERT INTO price_segments VALUES (?,?,?)", rows)
            # a price change is a sign of life: a crash after it must not close the lease before it
            c.execute("UPDATE leases SET last_seen_s = MAX(last_seen_s, ?) WHERE id = ?", (last, le.id))

    def heartbeat(self, job: Job | int, *, at_s: int | None = None) -> None:
        """Mark the job's open leases as alive at ``at_s`` (where a crash would close them)."""
        with self._tx() as c:
            c.execute("UPDATE leases SET last_seen_s = MAX(last_seen_s, ?) WHERE job_id = ? AND end_s IS NULL",
                      (_now() if at_s is None else int(at_s), id_of(job)))

    def close_lease(self, lease: Lease | int, end_s: int | None = None) -> list[ChargeRow]:
        """End the lease at ``end_s`` (default now), rate it and store its charges; returns them.

        Closing an already-closed lease at the same end (or with ``end_s=None``) returns the stored charges
        and charges nothing more.
        """
        with self._tx() as c:
            le = self.lease(lease)
            if le.end_s is not None:
                if end_s is None or int(end_s) == le.end_s:
                    return self.charges(le.id)
                raise BillingError(f"lease {le.id} is already closed at {le.end_s}, not {end_s}; "
                                   "a lease is closed once")
            end = _now() if end_s is None else int(end_s)
            return self._close(c, le, end)

    def _close(self, c: sqlite3.Connection, le: Lease, end: int) -> list[ChargeRow]:
        if end < le.start_s:
            raise BillingError(f"lease {le.id}: end {end} is before its start {le.start_s}")
        segs = self.segments(le.id)
        if segs and segs[-1].start_s > end:
            raise BillingError(f"lease {le.id}: end {end} is before its last price change ({segs[-1].start_s})")
        # a lease of the device that starts after this one (or in its second, opened after it) before `end`;
        # one that started and ended within this lease's first second, before it was opened, is not later
        later = c.execute("SELECT id, start_s FROM leases WHERE device = ? AND (start_s > ? OR (start_s = ? AND "
                          "id > ?)) AND start_s < ? LIMIT 1",
                          (le.device, le.start_s, le.start_s, le.id, end)).fetchone()
        if later is not None:
            raise BillingError(f"lease {le.id} of {le.device!r} cannot end at {end}: lease {later[0]} of the same "
                               f"device starts at {later[1]}")
        rows = rate_lease(le.mode, le.start_s, end, segs, le.granularity_s)
        for r in rows:
            if r.ticks >= 2**63:
                raise BillingError(f"lease {le.id}: a charge row of {ticks_to_decimal(r.ticks)} exceeds the ledger's "
                                   "per-row limit (~2.5e9 currency units). To fix: close and reopen the lease "
                                   "more often")
        c.executemany("INSERT INTO charges (lease_id, day, seq, job_id, mode, kind, start_s, end_s, seconds, "
                      "price_micros, ticks) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                      [(le.id, r.day, r.seq, le.job_id, le.mode.value, r.kind.value, r.start_s, r.end_s,
                        r.seconds, r.price_micros, r.ticks) for r in rows])
        c.execute("UPDATE leases SET end_s = ?, last_seen_s = MAX(last_seen_s, ?) WHERE id = ?", (end, end, le.id))
        return rows

    def recover(self, job: Job | int | None = None) -> list[Lease]:
        """Close the open leases (of ``job``, or all) at their last heartbeat: for a process that died.

        Call it when a job (re)starts, before opening new leases; returns the leases it closed.
        """
        closed = []
        with self._tx() as c:
            for le in self.leases(job, open_only=True):
                segs = self.segments(le.id)
                self._close(c, le, max(le.last_seen_s, segs[-1].start_s if segs else le.start_s))
                closed.append(le)
        return closed

    def charges(self, lease: Lease | int) -> list[ChargeRow]:
        """Stored charge rows of a (closed) lease."""
        return [ChargeRow(seq, ChargeKind(kind), a, b, secs, price, ticks) for seq, kind, a, b, secs, price, ticks in
                self._conn.execute("SELECT seq, kind, start_s, end_s, seconds, price_micros, ticks FROM charges "
                                   "WHERE lease_id = ? ORDER BY seq", (id_of(lease),))]

    # ---------------------------------------------------------------- events, spend, credits
    def record_event(self, job: Job | int, kind: EventKind | str, *, at_s: int | None = None,
                     step: int | None = None, lease: Lease | int | None = None,
                     detail: Mapping[str, Any] | None = None) -> int:
        """Record a preemption, checkpoint, resume or stop of ``job``; returns the event id."""
        try:
            k = EventKind(kind)
        except ValueError:
            known = ", ".join(e.value for e in EventKind)
            raise BillingError(f"event kind {kind!r} is unknown; use one of {known}") from None
        with self._tx() as c:
            j = self.job(job)
            cur = c.execute("INSERT INTO events (job_id, lease_id, kind, at_s, step, detail) VALUES (?,?,?,?,?,?)",
                            (j.id, None if lease is None else id_of(lease), k.value, _now() if at_s is None else
                             int(at_s), step, json.dumps(dict(detail), sort_keys=True) if detail else None))
            return int(cur.lastrowid or 0)

    def events(self, job: Job | int) -> list[Event]:
        """The job's events in time order."""
        return [Event(i, jid, lid, EventKind(k), at, step, json.loads(d) if d else {}) for i, jid, lid, k, at, step, d
                in self._conn.execute("SELECT id, job_id, lease_id, kind, at_s, step, detail FROM events "
                                      "WHERE job_id = ? ORDER BY at_s, id", (id_of(job),))]

    def spent_ticks(self, job: Job | int, *, at_s: int | None = None) -> int:
        """Charges of the job's closed leases plus what its open leases have accrued by ``at_s``."""
        jid = id_of(job)
        now = _now() if at_s is None else int(at_s)
        # by the job's leases (PK prefix of charges), not a scan of every job's charges
        where = "WHERE lease_id IN (SELECT id FROM leases WHERE job_id = ? AND end_s IS NOT NULL)"
        try:
            total = int(self._conn.execute(f"SELECT COALESCE(SUM(ticks), 0) FROM charges {where}",
                                           (jid,)).fetchone()[0])
        except sqlite3.OperationalError as e:
            if "overflow" not in str(e):
                raise
            # beyond 64 bits (~2.5e9 currency units): Python integers do not overflow
            total = sum(t for (t,) in self._conn.execute(f"SELECT ticks FROM charges {where}", (jid,)))
        for le in self.leases(jid, open_only=True):
            total += accrued_ticks(le.mode, le.start_s, now, self.segments(le.id), le.granularity_s)
        return total

    def spent(self, job: Job | int, *, at_s: int | None = None) -> Decimal:
        """:meth:`spent_ticks` as a ``Decimal`` in the job currency."""
        return ticks_to_decimal(self.spent_ticks(job, at_s=at_s))

    def credits(self, job: Job | int) -> list[Credit]:
        """Itemised insurance credits of the job (see ``insurance``)."""
        j = self.job(job)
        leases = self.leases(j.id)
        start = min([le.start_s for le in leases] + [j.created_s])
        events = self.events(j.id)
        intervals = credit_intervals(start, events)
        if not intervals:
            return []

        def overlaps(le: Lease) -> bool:
            return any(le.start_s < b and (le.end_s is None or le.end_s > a) for _, _, a, b in intervals)

        # only the leases running in an insured interval need their price segments read
        priced = [PricedLease(le.id, le.mode, le.start_s, le.end_s, self.segments(le.id))
                  for le in leases if overlaps(le)]
        return compute_credits(j.id, start, events, priced)

    # ---------------------------------------------------------------- payments
    def record_payment(self, kind: PaymentKind, amount: Decimal | str | int, *, currency: str = "USD",
                       note: str = "", ref: str | None = None, at_s: int | None = None) -> Payment:
        """Record prepaid money paid in (``amount`` > 0); with a ``ref`` already recorded, that payment is
        returned and nothing is written (a retried top-up is not paid twice)."""
        if kind not in ("signup", "topup"):
            raise BillingError(f"payment kind {kind!r}: use 'signup' or 'topup'")
        micros = price_to_micros(amount, "payment")
        if micros <= 0:
            raise BillingError(f"payment amount {amount}: must be > 0")
        ccy, at = normalize_currency(currency), _now() if at_s is None else int(at_s)
        with self._tx() as c:
            if ref is not None:
                row = c.execute(f"SELECT {_PAYMENT_COLS} FROM payments WHERE ref = ?", (ref,)).fetchone()
                if row is not None:
                    return Payment(*row)
            cur = c.execute("INSERT INTO payments (kind, currency, amount_micros, at_s, ref, note) "
                            "VALUES (?,?,?,?,?,?)", (kind, ccy, micros, at, ref, note))
            return Payment(int(cur.lastrowid or 0), kind, ccy, micros, at, ref, note)

    def payments(self) -> list[Payment]:
        """Every payment, oldest first."""
        return [Payment(*r) for r in self._conn.execute(f"SELECT {_PAYMENT_COLS} FROM payments ORDER BY id")]


def budget_ticks(amount: Decimal) -> int:
    """A budget in ticks (for comparing with :meth:`Ledger.spent_ticks`)."""
    return price_to_micros(amount, "budget") * TICKS_PER_MICRO
