"""The ledger's SQLite schema, its versioned migrations, and the checks that keep foreign files untouched.

A ledger file is recognised by SQLite's ``application_id`` header field (:data:`APPLICATION_ID`), which is
read from the raw file header *before* SQLite opens it for writing: a foreign SQLite database, a corrupted
file or anything else raises ``BillingError`` and is never modified. Its write-ahead log is checked the same
way (an invalid ``-wal`` would be ignored and then deleted by SQLite, losing what it held), and
:func:`verify` runs SQLite's own page checks and the schema check on a read-only connection before the file
is opened for writing: a damaged ledger is never written to. The ``schema_version`` table records
each applied migration; :data:`MIGRATIONS` is the ordered list of them, applied in one transaction each.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from starverse.billing.rating import PricingMode, Segment, rate_lease
from starverse.errors import BillingError

APPLICATION_ID = 0x53545652
"""``PRAGMA application_id`` of a Starverse ledger ("STVR")."""
_SQLITE_MAGIC = b"SQLite format 3\x00"

_V1 = """
CREATE TABLE jobs (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    currency TEXT NOT NULL,
    budget_total_micros INTEGER CHECK (budget_total_micros IS NULL OR budget_total_micros >= 0),
    max_per_hour_micros INTEGER CHECK (max_per_hour_micros IS NULL OR max_per_hour_micros >= 0),
    run_dir TEXT,
    created_s INTEGER NOT NULL
);
CREATE TABLE leases (
    id INTEGER PRIMARY KEY,
    job_id INTEGER NOT NULL REFERENCES jobs(id),
    device TEXT NOT NULL,
    accelerator TEXT NOT NULL,
    provider TEXT NOT NULL,
    offer TEXT,
    mode TEXT NOT NULL CHECK (mode IN ('on-demand', 'spot', 'hourly', 'daily', 'monthly')),
    offer_price_micros INTEGER NOT NULL CHECK (offer_price_micros >= 0),
    offer_currency TEXT NOT NULL,
    fx_rate TEXT NOT NULL,
    granularity_s INTEGER NOT NULL CHECK (granularity_s >= 1),
    start_s INTEGER NOT NULL,
    end_s INTEGER CHECK (end_s IS NULL OR end_s >= start_s),
    last_seen_s INTEGER NOT NULL
);
CREATE INDEX leases_device_end ON leases(device, end_s);
CREATE INDEX leases_job ON leases(job_id);
CREATE TABLE price_segments (
    lease_id INTEGER NOT NULL REFERENCES leases(id),
    start_s INTEGER NOT NULL,
    price_micros INTEGER NOT NULL CHECK (price_micros >= 0),
    PRIMARY KEY (lease_id, start_s)
) WITHOUT ROWID;
CREATE TABLE events (
    id INTEGER PRIMARY KEY,
    job_id INTEGER NOT NULL REFERENCES jobs(id),
    lease_id INTEGER REFERENCES leases(id),
    kind TEXT NOT NULL CHECK (kind IN ('preemption', 'checkpoint', 'resume', 'stop', 'budget_stop')),
    at_s INTEGER NOT NULL,
    step INTEGER,
    detail TEXT
);
CREATE INDEX events_job ON events(job_id, at_s);
"""

_V2 = """
CREATE TABLE charges (
    lease_id INTEGER NOT NULL REFERENCES leases(id),
    seq INTEGER NOT NULL,
    job_id INTEGER NOT NULL,
    mode TEXT NOT NULL,
    kind TEXT NOT NULL CHECK (kind IN ('usage', 'rounding', 'package')),
    start_s INTEGER NOT NULL,
    end_s INTEGER NOT NULL CHECK (end_s >= start_s),
    day INTEGER NOT NULL,
    seconds INTEGER NOT NULL CHECK (seconds >= 0),
    price_micros INTEGER NOT NULL CHECK (price_micros >= 0),
    ticks INTEGER NOT NULL CHECK (ticks >= 0),
    PRIMARY KEY (lease_id, seq)
) WITHOUT ROWID;
"""


def _rate_closed_leases(conn: sqlite3.Connection) -> None:
    """v1 ledgers rated closed leases on the fly; v2 stores their charge rows, so rate them now."""
    leases = conn.execute(
        "SELECT id, job_id, mode, start_s, end_s, granularity_s FROM leases WHERE end_s IS NOT NULL"
    ).fetchall()
    for lease_id, job_id, mode, start_s, end_s, gran in leases:
        segs = [Segment(s, p) for s, p in conn.execute(
            "SELECT start_s, price_micros FROM price_segments WHERE lease_id = ? ORDER BY start_s", (lease_id,))]
        rows = rate_lease(PricingMode(mode), start_s, end_s, segs, gran)
        conn.executemany(
            "INSERT INTO charges (lease_id, seq, job_id, mode, kind, start_s, end_s, day, seconds, price_micros, "
            "ticks) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            [(lease_id, r.seq, job_id, mode, r.kind.value, r.start_s, r.end_s, r.day, r.seconds,
              r.price_micros, r.ticks) for r in rows],
        )


# Charges keyed by (lease, day, seq): a bill groups by lease and UTC day in key order, without sorting a
# million rows. A day is a function of the row, so the key still refuses the same charge row twice.
_V3 = """
CREATE TABLE charges_v3 (
    lease_id INTEGER NOT NULL REFERENCES leases(id),
    day INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    job_id INTEGER NOT NULL,
    mode TEXT NOT NULL,
    kind TEXT NOT NULL CHECK (kind IN ('usage', 'rounding', 'package')),
    start_s INTEGER NOT NULL,
    end_s INTEGER NOT NULL CHECK (end_s >= start_s),
    seconds INTEGER NOT NULL CHECK (seconds >= 0),
    price_micros INTEGER NOT NULL CHECK (price_micros >= 0),
    ticks INTEGER NOT NULL CHECK (ticks >= 0),
    PRIMARY KEY (lease_id, day, seq)
) WITHOUT ROWID;
INSERT INTO charges_v3 SELECT lease_id, day, seq, job_id, mode, kind, start_s, end_s, seconds, price_micros, ticks
    FROM charges;
DROP TABLE charges;
ALTER TABLE charges_v3 RENAME TO charges
"""


# Leases of one device never overlap, so the one that starts last decides whether a new lease may open;
# (device, start_s) finds it in O(log n) however often the device was leased, and closing a lease (an
# update of end_s) no longer rewrites an index.
_V4 = """
DROP INDEX leases_device_end;
CREATE INDEX leases_device_start ON leases(device, start_s)
"""


# Prepaid money a customer paid in (a service's sign-up credit, top-ups): recorded beside what devices cost,
# so a bill and `bill --check` see both. ``ref`` makes recording the same payment twice a no-op.
_V5 = """
CREATE TABLE payments (
    id INTEGER PRIMARY KEY,
    kind TEXT NOT NULL CHECK (kind IN ('signup', 'topup')),
    currency TEXT NOT NULL,
    amount_micros INTEGER NOT NULL CHECK (amount_micros > 0),
    at_s INTEGER NOT NULL,
    ref TEXT UNIQUE,
    note TEXT NOT NULL DEFAULT ''
)
"""


@dataclass(frozen=True)
class Migration:
    """One schema step: SQL, then an optional data step, applied in one transaction."""

    version: int
    description: str
    sql: str
    data: Callable[[sqlite3.Connection], None] | None = None


MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "jobs, leases, price segments, events", _V1),
    Migration(2, "stored charge rows (rated when a lease closes)", _V2, _rate_closed_leases),
    Migration(3, "charges keyed by lease, UTC day and position (bills without sorting)", _V3),
    Migration(4, "leases indexed by device and start (overlap checks in O(log n))", _V4),
    Migration(5, "payments: prepaid credit paid in (sign-up credit, top-ups)", _V5),
)
"""Ordered; a ledger at version N gets migrations N+1.. applied when opened."""
SCHEMA_VERSION = MIGRATIONS[-1].version
"""The version this code writes."""


def check_header(path: Path) -> bool:
    """``True`` if ``path`` is a Starverse ledger, ``False`` if it is absent or empty (a new ledger).

    Raises ``BillingError`` for anything else, without opening the file for writing.
    """
    if not path.exists():
        return False
    if path.is_dir():
        raise BillingError(f"{path}: is a directory, not a ledger file. To fix: pass the file "
                           "(e.g. RUN_DIR/ledger.sqlite) or the run directory as RUN_DIR")
    with path.open("rb") as f:
        header = f.read(100)
    if len(header) == 0:
        wal = path.with_name(path.name + "-wal")
        # created, then killed before the first checkpoint: SQLite recovers the WAL
        return wal.exists() and wal.stat().st_size > 0
    if len(header) < 100 or not header.startswith(_SQLITE_MAGIC):
        raise BillingError(f"{path}: not a Starverse ledger (not an SQLite database, or corrupted); "
                           "left untouched. To fix: restore it from a backup or use another --db path")
    app_id = int.from_bytes(header[68:72], "big")
    if app_id != APPLICATION_ID:
        raise BillingError(f"{path}: an SQLite database of another application (application_id "
                           f"{app_id:#x}), not a Starverse ledger; left untouched. To fix: use another --db path")
    check_wal(path)
    return True


_WAL_MAGIC = (0x377F0682, 0x377F0683)
"""First four bytes of a write-ahead log (the low bit: checksums over big-endian words)."""
_WAL_VERSION = 3007000
_WAL_HEADER = 32


def _wal_checksum(data: bytes, big_endian: bool) -> tuple[int, int]:
    """SQLite's WAL checksum (Fletcher-like over pairs of 32-bit words), as in ``walChecksumBytes``."""
    order: Literal["big", "little"] = "big" if big_endian else "little"
    s0 = s1 = 0
    for i in range(0, len(data), 8):
        s0 = (s0 + int.from_bytes(data[i:i + 4], order) + s1) & 0xFFFFFFFF
        s1 = (s1 + int.from_bytes(data[i + 4:i + 8], order) + s0) & 0xFFFFFFFF
    return s0, s1


def check_wal(path: Path) -> None:
    """The ledger's ``-wal`` file, if any, has a valid header; ``BillingError`` (file untouched) otherwise.

    A log shorter than its 32-byte header is what a crash during its first write leaves, and holds no
    committed transaction; SQLite ignores it rightly. A full header that is not valid is damage: SQLite would
    ignore the log, and delete it when the last connection closes, with every transaction it held.
    """
    wal = path.with_name(path.name + "-wal")
    try:
        with wal.open("rb") as f:
            header = f.read(_WAL_HEADER)
    except FileNotFoundError:
        return
    if len(header) < _WAL_HEADER:
        return
    magic = int.from_bytes(header[:4], "big")
    ok = (magic in _WAL_MAGIC and int.from_bytes(header[4:8], "big") == _WAL_VERSION
          and _wal_checksum(header[:24], bool(magic & 1)) == (int.from_bytes(header[24:28], "big"),
                                                              int.from_bytes(header[28:32], "big")))
    if not ok:
        raise BillingError(f"{wal}: the ledger's write-ahead log is damaged (invalid header), so the transactions "
                           "it holds cannot be read; ledger and log left untouched. To fix: restore both from a "
                           "backup (moving the -wal away accepts losing its transactions)")


_TABLES = {1: ("jobs", "leases", "price_segments", "events", "schema_version"), 2: ("charges",), 5: ("payments",)}
"""Tables each schema version adds (the others change indexes and keys, not the set of tables)."""


def verify(path: Path, level: Literal["quick", "full"] = "quick", timeout_s: float = 30.0) -> int:
    """Check an existing ledger on a read-only connection before anyone writes to it: SQLite's page checks
    (``PRAGMA quick_check``, or ``integrity_check`` that also matches every index to its table), the schema
    version (not newer than this code) and its tables. Returns the schema version; ``BillingError`` naming
    the first problem otherwise. Nothing is written and no file is removed."""
    try:
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=timeout_s)
    except sqlite3.Error as e:
        raise BillingError(f"{path}: cannot open ledger ({e})") from None
    try:
        pragma = "quick_check" if level == "quick" else "integrity_check"
        rows = [str(r[0]).replace("*** in database main ***", "").strip() for r in conn.execute(
            f"PRAGMA {pragma}(3)")]
        if rows != ["ok"]:
            problems = [line for r in rows for line in r.splitlines() if line.strip()]
            raise _damaged(path, f"SQLite {pragma}: " + "; ".join(problems[:2]))
        version = current_version(conn)
        if version > SCHEMA_VERSION:
            raise BillingError(f"{path}: ledger schema version {version} is newer than this Starverse "
                               f"({SCHEMA_VERSION}); left untouched. To fix: upgrade starverse")
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        missing = [t for v, tables in _TABLES.items() if v <= version for t in tables if t not in names]
        if missing:
            raise _damaged(path, f"schema version {version} but no table {', '.join(missing)}")
        return version
    except sqlite3.DatabaseError as e:
        raise _damaged(path, str(e)) from None
    finally:
        conn.close()


def _damaged(path: Path, what: str) -> BillingError:
    return BillingError(f"{path}: ledger is damaged ({what}); left untouched and never written to. To fix: "
                        "restore it from a backup")


def current_version(conn: sqlite3.Connection) -> int:
    """Highest applied migration (0 for a new file)."""
    has = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'").fetchone()
    if not has:
        return 0
    row = conn.execute("SELECT MAX(version) FROM schema_version").fetchone()
    return int(row[0] or 0)


def migrate(conn: sqlite3.Connection, path: Path, target: int = SCHEMA_VERSION) -> int:
    """Apply the missing migrations up to ``target``; return the version reached.

    A ledger newer than this code is refused (``BillingError``), never downgraded.
    """
    version = current_version(conn)
    if version > SCHEMA_VERSION:
        raise BillingError(f"{path}: ledger schema version {version} is newer than this Starverse "
                           f"({SCHEMA_VERSION}); left untouched. To fix: upgrade starverse")
    for m in MIGRATIONS:
        if m.version <= version or m.version > target:
            continue
        conn.execute("BEGIN IMMEDIATE")
        try:
            # read again under the write lock: another process opening the same new ledger may have applied
            # this migration while this one waited for the lock
            applied = current_version(conn)
            if applied < m.version:
                if m.version == 1:
                    conn.execute(
                        "CREATE TABLE schema_version (version INTEGER PRIMARY KEY, "
                        "applied_s INTEGER NOT NULL, description TEXT NOT NULL)")
                for stmt in m.sql.split(";"):
                    if stmt.strip():
                        conn.execute(stmt)
                if m.data is not None:
                    m.data(conn)
                conn.execute("INSERT INTO schema_version VALUES (?, ?, ?)",
                             (m.version, int(time.time()), m.description))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        version = max(m.version, applied)
    return version
