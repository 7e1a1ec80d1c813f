"""What one service instance is configured with (``starverse serve`` options)."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

from starverse.service.db import sqlite_url

DB_FILE = "service.sqlite"


@dataclass(frozen=True)
class ServiceSettings:
    """One service instance: where its state lives and its limits."""

    root: Path
    """State directory: tenants' files and runs (``tenants/<id>/``), the platform's registered datasets and
    models (``platform/``), worker locks, and the SQLite database unless ``database_url`` names another."""
    database_url: str = ""
    """SQLAlchemy URL (``sqlite:///FILE`` or ``postgresql://...``); empty: ``ROOT/service.sqlite``."""
    max_body_bytes: int = 1 << 20
    """Largest JSON/YAML request body (413 above it)."""
    max_upload_bytes: int = 64 << 20
    """Largest dataset or model upload (413 above it; the tenant's quota applies too)."""
    quota_bytes: int = 256 << 20
    """Storage quota of a new tenant (datasets and models)."""
    signup_credit: Decimal = Decimal("5")
    """Prepaid credit a new tenant starts with (in ``currency``)."""
    currency: str = "USD"
    """Currency of new tenants' balances and ledgers."""
    worker_slots: int = 2
    """Jobs the worker runs at once."""
    poll_s: float = 0.5
    """How often the worker looks at the queue and samples running jobs."""
    planner_processes: int = 1
    """Processes that run planner searches next to the server (the server itself stays responsive)."""
    status_cache_s: float = 0.5
    """How long a job's status answer is reused (0: never). What this process changes drops it at once; what
    the worker changes shows within this time (the worker itself samples running jobs every ``poll_s``)."""
    auth_cache_s: float = 5.0
    """How long a valid token's tenant is remembered (0: never): its expiry is still checked on every request;
    a token revoked in the database stops working within this time."""
    plan_cache_entries: int = 256
    """Answers of identical plan requests kept (0: every request searches)."""
    max_plan_offers: int = 16
    """Most offers in the pool of one ``/api/plan`` request (422 above it): the search grows with every offer."""
    max_plan_devices: int = 65_536
    """Most devices (the sum of the offers' ``count``) in the pool of one ``/api/plan`` request (422 above it):
    four times the 16,384 H100s of the largest published training run (Llama 3 405B)."""
    plan_time_limit_s: float = 30.0
    """Longest one ``/api/plan`` search may run in the planner process (422 past it, and the process is free
    for the next request); ``starverse plan`` on the user's own machine has no limit."""
    cpu_ranks: int = 1
    """CPU ranks of a job that does not set ``devices.cpu_ranks``."""

    @property
    def url(self) -> str:
        """The database URL in force."""
        return self.database_url or sqlite_url(self.root / DB_FILE)

    @property
    def tenants_dir(self) -> Path:
        """Parent of every tenant's directory."""
        return self.root / "tenants"

    @property
    def platform_dir(self) -> Path:
        """The platform's registered datasets (``datasets/``) and models (``models/``)."""
        return self.root / "platform"

    def tenant_dir(self, tenant_id: str) -> Path:
        """One tenant's directory: ``datasets/``, ``models/``, ``jobs/<id>/`` and ``ledger.sqlite``."""
        return self.tenants_dir / tenant_id
