"""The service's state: tenants, hashed tokens, the job queue, job events and samples (what tenants paid in
is in their billing ledgers; see ``tenants``).

One schema for SQLite (embedded, the default) and PostgreSQL (``--database postgresql://...``), created and
upgraded by Alembic (``service/migrations``). The jobs table is the queue: a worker claims a job with one
conditional ``UPDATE ... WHERE state = 'queued'`` and owns it only if that statement changed one row, so two
workers (or a worker and a restarted one) never both run it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    create_engine,
    event,
)
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from starverse.errors import ConfigError


class JobState(StrEnum):
    """Where a job is in its life."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


ACTIVE_STATES = (JobState.QUEUED.value, JobState.RUNNING.value)


class Base(DeclarativeBase):
    """Declarative base of the service tables."""


class Tenant(Base):
    """A customer of the platform: its own jobs, files, ledger and balance."""

    __tablename__ = "tenants"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[float] = mapped_column(Float)
    quota_bytes: Mapped[int] = mapped_column(BigInteger)
    """Most bytes of datasets and models the tenant may store."""
    currency: Mapped[str] = mapped_column(String(8))
    """Currency of the prepaid balance and of every job's ledger."""


class Token(Base):
    """An API token of a tenant; only its SHA-256 is stored."""

    __tablename__ = "tokens"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    """First characters of the token, to tell tokens apart in listings."""
    created_at: Mapped[float] = mapped_column(Float)
    expires_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    revoked: Mapped[bool] = mapped_column(Boolean, default=False)


class Job(Base):
    """A training job and its place in the queue."""

    __tablename__ = "jobs"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    name: Mapped[str] = mapped_column(String(128))
    state: Mapped[str] = mapped_column(String(16), default=JobState.QUEUED.value)
    spec: Mapped[str] = mapped_column(Text)
    """The job file the runner runs (YAML, paths resolved inside the tenant's directory)."""
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)
    started_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    worker_id: Mapped[str | None] = mapped_column(String(32), nullable=True)
    pid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    resume_from: Mapped[int | None] = mapped_column(Integer, nullable=True)
    """Checkpoint step the next launch resumes from (rollback); None: the latest."""
    stop_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    launches: Mapped[int] = mapped_column(Integer, default=0)
    """Times a runner was started for this job (a resume is a launch)."""
    fresh_starts: Mapped[int] = mapped_column(Integer, default=0)
    """Launches that found no checkpoint and started at step 0 (more than one: the job ran twice)."""
    exit_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    stop_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    last_step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_steps: Mapped[int] = mapped_column(Integer, default=0)

    __table_args__ = (Index("ix_jobs_tenant_created", "tenant_id", "created_at"), Index("ix_jobs_state", "state"))


class JobEvent(Base):
    """Something that happened to a job (queued, started, checkpoint, preemption, recovered, stopped...)."""

    __tablename__ = "job_events"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    at: Mapped[float] = mapped_column(Float)
    kind: Mapped[str] = mapped_column(String(32))
    detail: Mapped[str] = mapped_column(Text, default="")


class JobSample(Base):
    """One progress sample of a running job (what its live charts draw)."""

    __tablename__ = "job_samples"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    at: Mapped[float] = mapped_column(Float)
    step: Mapped[int] = mapped_column(Integer)
    loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    tokens_per_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    shares: Mapped[str] = mapped_column(Text, default="[]")
    """JSON list: batch share of each rank."""


class BalanceEntry(Base):
    """A sign-up credit or top-up as services before the ledger's payments recorded them (micro-units); kept
    only to move such rows into the tenants' ledgers (``tenants.import_balance_entries``), never written."""

    __tablename__ = "balance_entries"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    at: Mapped[float] = mapped_column(Float)
    kind: Mapped[str] = mapped_column(String(16))
    amount_micros: Mapped[int] = mapped_column(BigInteger)
    note: Mapped[str] = mapped_column(Text, default="")


def sqlite_url(path: str | Path) -> str:
    """The SQLAlchemy URL of an SQLite file."""
    return f"sqlite:///{Path(path).resolve()}"


def make_engine(url: str) -> Engine:
    """An engine for ``url`` (sqlite:/// or postgresql://); SQLite gets WAL and a busy timeout so the web
    process and the worker process can write concurrently."""
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url.removeprefix("postgresql://")
    if not (url.startswith("sqlite") or url.startswith("postgresql+")):
        raise ConfigError(f"--database {url!r}: use sqlite:///FILE or postgresql://USER@HOST:PORT/DB")
    if url.startswith("sqlite"):
        # 20 connections kept open (one past the pool is closed when returned, and opening one costs three
        # PRAGMAs), 40 at most: the server's threads for sync routes
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False},
                               pool_size=20, max_overflow=20)

        @event.listens_for(engine, "connect")
        def _pragmas(conn: Any, _record: Any) -> None:
            cur = conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20)


def migrate(url: str) -> None:
    """Create or upgrade the schema to the newest Alembic revision."""
    from alembic import command
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(Path(__file__).with_name("migrations")))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")
    finally:
        engine.dispose()


class Database:
    """An engine and its session factory."""

    def __init__(self, url: str):
        self.url = url
        self.engine = make_engine(url)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session committed at the end of the block (rolled back on an exception)."""
        s = self._sessions()
        try:
            yield s
            s.commit()
        except BaseException:
            s.rollback()
            raise
        finally:
            s.close()

    def add_event(self, s: Session, job_id: str, kind: str, detail: str = "") -> None:
        """Record a job event in session ``s``."""
        s.add(JobEvent(job_id=job_id, at=time.time(), kind=kind, detail=detail))

    def dispose(self) -> None:
        """Close the engine's connections."""
        self.engine.dispose()
