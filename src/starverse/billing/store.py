"""The ledger file: opening (checked, migrated, WAL), closing, and one-transaction writes.

:class:`LedgerFile` owns the SQLite connection; :class:`~starverse.billing.ledger.Ledger` adds the billing
operations on top. A damaged, foreign or newer file is refused before anything is written to it.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, Self

from starverse.billing.schema import APPLICATION_ID, SCHEMA_VERSION, check_header, migrate, verify
from starverse.errors import BillingError

LEDGER_FILE = "ledger.sqlite"
"""Name of the ledger inside a run directory."""


class LedgerFile:
    """An open ledger file (the connection); :class:`~starverse.billing.ledger.Ledger` is the one to use."""

    def __init__(self, conn: sqlite3.Connection, path: Path):
        self._conn = conn
        self.path = path

    # ---------------------------------------------------------------- opening
    @classmethod
    def open(cls, path: str | Path, *, create: bool = True, read_only: bool = False,
             check: Literal["quick", "full"] = "quick", timeout_s: float = 30.0) -> Self:
        """Open (or create) the ledger at ``path``, migrating its schema to the current version.

        An existing file is checked first on a read-only connection (:func:`~starverse.billing.schema.verify`:
        SQLite's page checks at level ``check``, schema and version): a foreign, damaged or newer file raises
        ``BillingError`` and is left byte-for-byte untouched, its ``-wal`` included. ``read_only``: for reports
        (``bill``): the connection cannot write, so no file is changed or removed (a healthy ledger of an older
        schema is first migrated by a short read-write open). ``timeout_s`` bounds the wait for another
        process's write lock.
        """
        p = Path(path)
        exists = check_header(p)
        if not exists and not create:
            raise BillingError(f"{p}: no ledger here. To fix: pass the run directory of a job that ran "
                               "with billing, or --db FILE")
        version = verify(p, check, timeout_s) if exists else 0
        if read_only and exists:
            if version < SCHEMA_VERSION:
                cls.open(p, create=False, timeout_s=timeout_s).close()  # a healthy older ledger: migrate it
            conn = sqlite3.connect(f"{p.resolve().as_uri()}?mode=ro", uri=True, isolation_level=None,
                                   timeout=timeout_s)
            return cls(conn, p)
        p.parent.mkdir(parents=True, exist_ok=True)
        try:
            conn = sqlite3.connect(p, isolation_level=None, timeout=timeout_s)
        except sqlite3.Error as e:
            raise BillingError(f"{p}: cannot open ledger ({e})") from None
        try:
            if not exists:
                # written before WAL is on, so the id is in the main file's header from the first moment
                conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            app_id = conn.execute("PRAGMA application_id").fetchone()[0]
            if app_id != APPLICATION_ID:
                raise BillingError(f"{p}: an SQLite database of another application (application_id "
                                   f"{app_id:#x}), not a Starverse ledger; left untouched")
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.execute("PRAGMA foreign_keys = ON")
            migrate(conn, p)
        except sqlite3.DatabaseError as e:
            conn.close()
            raise BillingError(f"{p}: ledger is corrupted ({e}); left untouched. To fix: restore it from "
                               "a backup; `starverse bill --check` shows what is wrong") from None
        except BaseException:
            conn.close()
            raise
        return cls(conn, p)

    def close(self) -> None:
        """Close the file (committed data is already durable)."""
        self._conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction; any error rolls it back, leaving what was recorded before intact."""
        conn = self._conn
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as e:
            raise BillingError(f"{self.path}: cannot write the ledger ({e}). To fix: make sure no other "
                               "process holds it for long, and that the disk is writable") from None
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        try:
            conn.execute("COMMIT")
        except sqlite3.Error as e:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            raise BillingError(f"{self.path}: commit failed ({e}); nothing of this operation was recorded") from None

    def execute(self, sql: str, args: Sequence[Any] = ()) -> sqlite3.Cursor:
        """Read-only SQL for reports (``report`` module); not for writes."""
        return self._conn.execute(sql, args)
