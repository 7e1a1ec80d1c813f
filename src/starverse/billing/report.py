"""Bills (totals by job, device, pricing mode or day) and the ledger integrity check.

Totals are sums of the stored per-second charge rows in integer ticks, so a total is exactly the sum of its
lines and of the rows under them; credits are summed separately and never netted into the charges. Leases
still open are shown as accrued (what closing them now would cost), outside the totals.
"""

from __future__ import annotations

import os
import sqlite3
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import ROUND_HALF_EVEN, Decimal
from enum import StrEnum
from pathlib import Path

from starverse.billing.insurance import Credit
from starverse.billing.ledger import LEDGER_FILE, Ledger, Payment
from starverse.billing.money import TICKS_PER_UNIT, fx_rate, normalize_currency, ticks_to_decimal
from starverse.billing.rating import DAY_S, accrued_ticks, rate_lease
from starverse.errors import BillingError


class GroupBy(StrEnum):
    """What a bill's lines are."""

    JOB = "job"
    DEVICE = "device"
    MODE = "mode"
    DAY = "day"


def default_ledger_path() -> Path:
    """The user-level ledger: ``$STARVERSE_LEDGER``, else ``$XDG_DATA_HOME/starverse/ledger.sqlite``."""
    env = os.environ.get("STARVERSE_LEDGER")
    if env:
        return Path(env)
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "starverse" / LEDGER_FILE


def resolve_ledger_path(run_dir: str | Path | None = None, db: str | Path | None = None) -> Path:
    """The ledger file of a run directory, an explicit ``--db`` file, or the user-level default."""
    if db is not None:
        return Path(db)
    if run_dir is not None:
        p = Path(run_dir)
        if p.is_dir():
            return p / LEDGER_FILE
        if not p.exists():
            raise BillingError(f"{p}: no such run directory. To fix: pass a run directory or --db FILE")
        return p
    return default_ledger_path()


@dataclass(frozen=True)
class BillLine:
    """One line of a bill: charges and credits of one job/device/mode/day in one currency."""

    key: str
    currency: str
    seconds: int
    """Billed seconds (package rows count their whole length)."""
    charge_ticks: int
    credit_ticks: int

    @property
    def charges(self) -> Decimal:
        """Charges, 6 places."""
        return ticks_to_decimal(self.charge_ticks)

    @property
    def credits(self) -> Decimal:
        """Insurance credits, 6 places."""
        return ticks_to_decimal(self.credit_ticks)

    @property
    def net(self) -> Decimal:
        """Charges minus credits, 6 places."""
        return ticks_to_decimal(self.charge_ticks - self.credit_ticks)


@dataclass(frozen=True)
class Bill:
    """A whole bill."""

    by: GroupBy
    lines: list[BillLine]
    totals: list[BillLine]
    """One line per currency (key ``total``)."""
    credits: list[Credit]
    """Itemised insurance credits."""
    open_leases: int
    accrued: list[BillLine] = field(default_factory=list)
    """What open leases have cost so far, per currency (not in the totals)."""
    converted_to: str | None = None
    payments: list[Payment] = field(default_factory=list)
    """Prepaid money paid in (sign-up credit, top-ups), itemised; never netted into the charges."""


def _day(d: int) -> str:
    return datetime.fromtimestamp(d * DAY_S, UTC).strftime("%Y-%m-%d")


def _sum_by_lease_day(ledger: Ledger) -> list[tuple[int, int, int, int]]:
    """``(lease, day, seconds, ticks)`` sums in key order; past 64 bits (~2.5e9 currency units in one
    group) SQLite's SUM overflows, and the rows are summed in Python instead (exact, slower)."""
    try:
        return ledger.execute("SELECT lease_id, day, SUM(seconds), SUM(ticks) FROM charges "
                              "GROUP BY lease_id, day").fetchall()
    except sqlite3.OperationalError as e:
        if "overflow" not in str(e):
            raise BillingError(f"{ledger.path}: cannot read the charges ({e}); run `starverse bill --check`") from None
    sums: dict[tuple[int, int], list[int]] = defaultdict(lambda: [0, 0])
    for lease_id, day, secs, ticks in ledger.execute("SELECT lease_id, day, seconds, ticks FROM charges"):
        acc = sums[(lease_id, day)]
        acc[0] += secs
        acc[1] += ticks
    return [(k[0], k[1], v[0], v[1]) for k, v in sums.items()]


def make_bill(ledger: Ledger, by: GroupBy | str = GroupBy.JOB, *, currency: str | None = None,
              at_s: int | None = None) -> Bill:
    """Totals of the stored charges grouped ``by``; ``currency`` converts every line (rounded to 6 places)."""
    try:
        group = GroupBy(by)
    except ValueError:
        raise BillingError(f"--by {by!r}: use one of {', '.join(g.value for g in GroupBy)}") from None
    target = None if currency is None else normalize_currency(currency)
    jobs = {j.id: j for j in ledger.jobs()}
    lease_rows = ledger.execute("SELECT id, job_id, device, mode FROM leases").fetchall()
    leases = {r[0]: r for r in lease_rows}
    sums: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
    # one pass in key order (lease, day): no sort of the charge rows; every grouping derives from it
    for lease_id, day, secs, ticks in _sum_by_lease_day(ledger):
        _, job_id, device, mode = leases[lease_id]
        job = jobs[job_id]
        key = {GroupBy.JOB: job.name, GroupBy.DEVICE: device, GroupBy.MODE: mode, GroupBy.DAY: _day(day)}[group]
        acc = sums[(key, job.currency)]
        acc[0] += secs
        acc[1] += ticks
    credits = [c for j in jobs.values() for c in ledger.credits(j.id)]
    for c in credits:
        _, job_id, device, mode = leases[c.lease_id]
        key = {GroupBy.JOB: jobs[job_id].name, GroupBy.DEVICE: device, GroupBy.MODE: mode,
               GroupBy.DAY: _day(c.start_s // DAY_S)}[group]
        sums[(key, jobs[job_id].currency)][2] += c.ticks
    accrued: dict[str, int] = defaultdict(int)
    open_leases = ledger.leases(open_only=True)
    for le in open_leases:
        accrued[jobs[le.job_id].currency] += accrued_ticks(
            le.mode, le.start_s, max(le.last_seen_s, le.start_s) if at_s is None else at_s,
            ledger.segments(le.id), le.granularity_s)
    lines = [BillLine(k, ccy, s, t, cr) for (k, ccy), (s, t, cr) in sorted(sums.items())]
    accrued_lines = [BillLine("accrued", ccy, 0, t, 0) for ccy, t in sorted(accrued.items())]
    if target is not None:
        lines = _merge([_convert(line, target) for line in lines])
        accrued_lines = _merge([_convert(line, target) for line in accrued_lines])
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for line in lines:
        t = totals[line.currency]
        t[0] += line.seconds
        t[1] += line.charge_ticks
        t[2] += line.credit_ticks
    return Bill(group, lines, [BillLine("total", ccy, *v) for ccy, v in sorted(totals.items())], credits,
                len(open_leases), accrued_lines, target, ledger.payments())


def _convert(line: BillLine, target: str) -> BillLine:
    """A line in ``target`` currency, each amount rounded half-even to the micro-unit."""
    rate = fx_rate(line.currency, target)

    def conv(ticks: int) -> int:
        units = Decimal(ticks) * rate / TICKS_PER_UNIT
        return int((units * 1_000_000).quantize(Decimal(1), ROUND_HALF_EVEN)) * 3600

    return BillLine(line.key, target, line.seconds, conv(line.charge_ticks), conv(line.credit_ticks))


def _merge(lines: Iterable[BillLine]) -> list[BillLine]:
    """Lines with the same key (from several currencies, once converted) added up."""
    out: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
    for line in lines:
        acc = out[(line.key, line.currency)]
        acc[0] += line.seconds
        acc[1] += line.charge_ticks
        acc[2] += line.credit_ticks
    return [BillLine(k, c, *v) for (k, c), v in sorted(out.items())]


@dataclass(frozen=True)
class CheckResult:
    """What ``bill --check`` found."""

    problems: list[str]
    num_jobs: int
    num_leases: int
    num_charges: int
    num_payments: int = 0

    @property
    def ok(self) -> bool:
        """No problem found."""
        return not self.problems


_CHARGE_FIELDS = ("lease_id", "seq", "job_id", "mode", "kind", "start_s", "end_s", "day", "seconds", "price_micros",
                  "ticks")


def check_ledger(ledger: Ledger) -> CheckResult:
    """Verify the ledger: SQLite integrity, no overlapping leases per device, closed leases end >= start,
    every closed lease's stored charges equal a fresh rating of it (so none is missing, torn or doubled),
    no charges on open leases, charge rows consistent with their lease (job, mode, day, amount), and every
    payment a positive amount of a known kind in a valid currency."""
    problems: list[str] = []
    try:
        res = [r[0] for r in ledger.execute("PRAGMA integrity_check")]
    except sqlite3.DatabaseError as e:
        return CheckResult([f"SQLite integrity check failed: {e}"], 0, 0, 0)
    if res != ["ok"]:
        problems.extend(f"SQLite: {r}" for r in res[:10])
    for table, rowid, parent, _ in ledger.execute("PRAGMA foreign_key_check"):
        problems.append(f"{table} row {rowid} refers to a missing {parent} row")
    leases = ledger.leases()
    last_by_device: dict[str, tuple[int, int | None, int]] = {}
    for le in sorted(leases, key=lambda x: (x.device, x.start_s, x.id)):
        prev = last_by_device.get(le.device)
        if prev is not None and (prev[1] is None or prev[1] > le.start_s):
            problems.append(f"device {le.device!r}: lease {prev[2]} ({prev[0]}..{prev[1]}) overlaps lease "
                            f"{le.id} starting at {le.start_s}")
        last_by_device[le.device] = (le.start_s, le.end_s, le.id)
        if le.end_s is not None and le.end_s < le.start_s:
            problems.append(f"lease {le.id}: end {le.end_s} before start {le.start_s}")
    charges: dict[int, list[tuple]] = defaultdict(list)
    num_charges = 0
    for row in ledger.execute("SELECT lease_id, seq, job_id, mode, kind, start_s, end_s, day, seconds, "
                              "price_micros, ticks FROM charges ORDER BY lease_id, day, seq"):  # key order: no sort
        charges[row[0]].append(row)
        num_charges += 1
    by_id = {le.id: le for le in leases}
    for lease_id in charges:
        if lease_id not in by_id:
            problems.append(f"charges of lease {lease_id}, which does not exist")
    for le in leases:
        stored = charges.get(le.id, [])
        segs = ledger.segments(le.id)
        if not segs or segs[0].start_s != le.start_s:
            problems.append(f"lease {le.id}: no price in force at its start {le.start_s}")
            continue
        if le.end_s is None:
            if stored:
                problems.append(f"lease {le.id} is open but has {len(stored)} charge rows")
            continue
        expected = rate_lease(le.mode, le.start_s, le.end_s, segs, le.granularity_s)
        want = [(le.id, r.seq, le.job_id, le.mode, r.kind, r.start_s, r.end_s, r.day, r.seconds,
                 r.price_micros, r.ticks) for r in expected]
        have = [tuple(s) for s in stored]
        if have != want:
            got, rated = ticks_to_decimal(sum(s[10] for s in have)), ticks_to_decimal(sum(w[10] for w in want))
            if len(have) != len(want):
                problems.append(f"lease {le.id}: {len(have)} stored charge rows totalling {got} differ from its "
                                f"rating ({len(want)} rows, {rated})")
            else:
                i = next(i for i, (a, b) in enumerate(zip(have, want, strict=True)) if a != b)
                f = next(f for f in range(len(_CHARGE_FIELDS)) if have[i][f] != want[i][f])
                problems.append(f"lease {le.id}: charge row {want[i][1]} has {_CHARGE_FIELDS[f]} {have[i][f]}, its "
                                f"rating {want[i][f]} (stored total {got}, rated {rated})")
    payments = ledger.payments()
    for pay in payments:
        try:
            ok_currency = normalize_currency(pay.currency) == pay.currency
        except BillingError:
            ok_currency = False
        if pay.amount_micros <= 0 or pay.kind not in ("signup", "topup") or not ok_currency:
            problems.append(f"payment {pay.id}: {pay.kind} of {pay.amount_micros} micro-{pay.currency} is not a "
                            "positive amount of a known kind in a valid currency")
    jobs = ledger.jobs()
    return CheckResult(problems, len(jobs), len(leases), num_charges, len(payments))
