"""Tenants, their API tokens (stored as SHA-256 only) and their prepaid balances.

A token is shown once, when created; the database keeps its hash, so a stolen database does not hand out
access. A token may expire (``expires_at``) or be revoked. A tenant's balance is what it paid in (the
sign-up credit and top-ups, rows of ``balance_entries``) minus what its jobs' ledger charged, plus the
insurance credits the ledger granted: the worker stops a tenant's running jobs (emergency checkpoint) when
it reaches zero, and a job is refused at submit while it is not positive.

Top-ups are recorded in the service database (``balance_entries``), not in the jobs' ledgers: the ledger
records what devices cost, the balance what the tenant paid in.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time
import uuid
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from starverse.billing.ledger import LEDGER_FILE
from starverse.billing.money import MICROS_PER_UNIT, TICKS_PER_UNIT, price_to_micros
from starverse.errors import BillingError, ConfigError
from starverse.service.db import BalanceEntry, Database, Tenant, Token
from starverse.service.settings import ServiceSettings

TOKEN_PREFIX = "sv_"
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")


def hash_token(token: str) -> str:
    """The stored form of a token."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def create_tenant(db: Database, settings: ServiceSettings, name: str, *, credit: Decimal | None = None) -> Tenant:
    """A new tenant with its directory and sign-up credit (``settings.signup_credit`` unless ``credit``)."""
    if not _NAME.match(name):
        raise ConfigError(f"tenant name {name!r}: use 1-63 lower-case letters, digits, '-' or '_'")
    with db.session() as s:
        if s.scalar(select(Tenant).where(Tenant.name == name)) is not None:
            raise ConfigError(f"tenant {name!r} already exists. To fix: choose another name")
        t = Tenant(id=uuid.uuid4().hex, name=name, created_at=time.time(), quota_bytes=settings.quota_bytes,
                   currency=settings.currency)
        s.add(t)
        s.flush()
        amount = settings.signup_credit if credit is None else credit
        if amount > 0:
            s.add(BalanceEntry(tenant_id=t.id, at=time.time(), kind="signup",
                               amount_micros=price_to_micros(amount, "credit"), note="sign-up credit"))
    for sub in ("datasets", "models", "jobs"):
        (settings.tenant_dir(t.id) / sub).mkdir(parents=True, exist_ok=True)
    return t


def tenant_by_name(s: Session, name: str) -> Tenant:
    """The tenant called ``name`` (ConfigError if none)."""
    t = s.scalar(select(Tenant).where(Tenant.name == name))
    if t is None:
        raise ConfigError(f"no tenant {name!r}. To fix: `starverse serve tenant create {name}`")
    return t


def create_token(db: Database, tenant_name: str, *, ttl_s: float | None = None) -> str:
    """A new API token of the tenant (returned once; only its hash is stored)."""
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    now = time.time()
    with db.session() as s:
        t = tenant_by_name(s, tenant_name)
        s.add(Token(tenant_id=t.id, token_hash=hash_token(token), prefix=token[:10], created_at=now,
                    expires_at=None if ttl_s is None else now + ttl_s, revoked=False))
    return token


def authenticate(db: Database, token: str) -> Tenant | None:
    """The tenant of a valid, unexpired, unrevoked token; None otherwise."""
    if not token.startswith(TOKEN_PREFIX) or len(token) > 200:
        return None
    with db.session() as s:
        row = s.execute(select(Token, Tenant).join(Tenant, Tenant.id == Token.tenant_id)
                        .where(Token.token_hash == hash_token(token))).first()
        if row is None:
            return None
        tok, tenant = row
        if tok.revoked or (tok.expires_at is not None and tok.expires_at <= time.time()):
            return None
        return tenant


def top_up(db: Database, tenant_name: str, amount: Decimal, note: str = "top-up") -> None:
    """Add prepaid credit to a tenant (recorded as a balance entry)."""
    if amount <= 0:
        raise ConfigError(f"top-up amount {amount}: must be > 0")
    with db.session() as s:
        t = tenant_by_name(s, tenant_name)
        s.add(BalanceEntry(tenant_id=t.id, at=time.time(), kind="topup",
                           amount_micros=price_to_micros(amount, "top-up"), note=note))


@dataclass(frozen=True)
class Balance:
    """A tenant's prepaid balance now."""

    currency: str
    paid_in_micros: int
    """Sign-up credit and top-ups."""
    charged_ticks: int
    """What the tenant's jobs' leases cost so far (open leases up to now)."""
    credit_ticks: int
    """Insurance credits granted by the ledger."""

    @property
    def remaining_ticks(self) -> int:
        """Paid in, minus charges, plus insurance credits."""
        return self.paid_in_micros * (TICKS_PER_UNIT // MICROS_PER_UNIT) - self.charged_ticks + self.credit_ticks

    @property
    def remaining(self) -> Decimal:
        """:attr:`remaining_ticks` in currency units (6 places)."""
        return (Decimal(self.remaining_ticks) / TICKS_PER_UNIT).quantize(Decimal("0.000001"))

    def as_dict(self) -> dict[str, str]:
        """JSON form (amounts as decimal strings)."""
        q = Decimal("0.000001")
        return {"currency": self.currency,
                "paid_in": str((Decimal(self.paid_in_micros) / MICROS_PER_UNIT).quantize(q)),
                "charged": str((Decimal(self.charged_ticks) / TICKS_PER_UNIT).quantize(q)),
                "insurance_credits": str((Decimal(self.credit_ticks) / TICKS_PER_UNIT).quantize(q)),
                "remaining": str(self.remaining)}


def job_ledgers(settings: ServiceSettings, tenant_id: str) -> list[Path]:
    """The billing ledgers of the tenant's jobs (each job has its own, in its run directory: two jobs run on
    devices of the same name, which one ledger would take for overlapping leases of one device)."""
    return sorted((settings.tenant_dir(tenant_id) / "jobs").glob(f"*/run/{LEDGER_FILE}"))


def balance(db: Database, settings: ServiceSettings, tenant: Tenant) -> Balance:
    """The tenant's balance from its balance entries and its jobs' ledgers."""
    from starverse.billing import Ledger

    with db.session() as s:
        paid = int(s.scalar(select(func.coalesce(func.sum(BalanceEntry.amount_micros), 0))
                            .where(BalanceEntry.tenant_id == tenant.id)) or 0)
    charged = credited = 0
    for path in job_ledgers(settings, tenant.id):
        try:
            ledger = Ledger.open(path, create=False)
        except BillingError:
            continue  # a job creating its ledger right now: nothing charged in it yet
        with ledger:
            for j in ledger.jobs():
                charged += ledger.spent_ticks(j)
                credited += sum(c.ticks for c in ledger.credits(j))
    return Balance(tenant.currency, paid, charged, credited)


def balance_entries(db: Database, tenant: Tenant) -> list[dict[str, object]]:
    """The tenant's sign-up credit and top-ups, oldest first."""
    with db.session() as s:
        rows = s.scalars(select(BalanceEntry).where(BalanceEntry.tenant_id == tenant.id)
                         .order_by(BalanceEntry.id)).all()
        return [{"at": r.at, "kind": r.kind, "amount": str(Decimal(r.amount_micros) / MICROS_PER_UNIT),
                 "note": r.note} for r in rows]
