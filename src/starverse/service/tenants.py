"""Tenants, their API tokens (stored as SHA-256 only) and their prepaid balances.

A token is shown once, when created; the database keeps its hash, so a stolen database does not hand out
access. A token may expire (``expires_at``) or be revoked. A tenant's balance is what it paid in (the
sign-up credit and top-ups) minus what its jobs' ledgers charged, plus the
insurance credits the ledger granted: the worker stops a tenant's running jobs (emergency checkpoint) when
it reaches zero, and a job is refused at submit while it is not positive.

What the tenant paid in (the sign-up credit, top-ups) is recorded in the tenant's own billing ledger
(``tenants/<id>/ledger.sqlite``, the ledger's ``payments``), so ``starverse bill ROOT/tenants/<id>`` shows
it and ``starverse bill ROOT/tenants/<id> --check`` verifies it like any ledger; what devices cost is in
each job's ledger (``jobs/<job>/run/ledger.sqlite``). Rows of the service database's older
``balance_entries`` table are moved into the tenant ledgers once (:func:`import_balance_entries`).
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

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from starverse.billing.ledger import LEDGER_FILE, Ledger, Payment, PaymentKind
from starverse.billing.money import MICROS_PER_UNIT, TICKS_PER_UNIT, micros_to_decimal, price_to_micros
from starverse.errors import BillingError, ConfigError
from starverse.service.db import BalanceEntry, Database, Tenant, Token, migrate
from starverse.service.settings import ServiceSettings

TOKEN_PREFIX = "sv_"
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")


def hash_token(token: str) -> str:
    """The stored form of a token."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def create_tenant(db: Database, settings: ServiceSettings, name: str, *, credit: Decimal | None = None) -> Tenant:
    """A new tenant with its directory and sign-up credit (``settings.signup_credit`` unless ``credit``)."""
    if not _NAME.match(name):
        shown = repr(name) if len(name) <= 70 else repr(name[:64]) + "..."
        raise ConfigError(f"tenant name {shown}: use 1-63 lower-case letters, digits, '-' or '_'")
    with db.session() as s:
        if s.scalar(select(Tenant).where(Tenant.name == name)) is not None:
            raise ConfigError(f"tenant {name!r} already exists. To fix: choose another name")
        t = Tenant(id=uuid.uuid4().hex, name=name, created_at=time.time(), quota_bytes=settings.quota_bytes,
                   currency=settings.currency)
        s.add(t)
        s.flush()
    for sub in ("datasets", "models", "jobs"):
        (settings.tenant_dir(t.id) / sub).mkdir(parents=True, exist_ok=True)
    amount = settings.signup_credit if credit is None else credit
    if price_to_micros(amount, "credit") > 0:
        with tenant_ledger(settings, t.id) as ledger:
            ledger.record_payment("signup", amount, currency=t.currency, note="sign-up credit", ref=f"signup:{t.id}")
    return t


def tenant_ledger(settings: ServiceSettings, tenant_id: str) -> Ledger:
    """The tenant's own ledger (its payments), created if new."""
    return Ledger.open(settings.tenant_dir(tenant_id) / LEDGER_FILE)


def tenant_by_name(s: Session, name: str) -> Tenant:
    """The tenant called ``name`` (ConfigError if none)."""
    t = s.scalar(select(Tenant).where(Tenant.name == name))
    if t is None:
        raise ConfigError(f"no tenant {name!r}. To fix: create it first with `starverse serve tenant create {name}` "
                          "(it starts with the sign-up credit), or check the spelling")
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


def authenticate(db: Database, token: str) -> tuple[Tenant, float | None] | None:
    """The tenant of a valid, unexpired, unrevoked token and the token's expiry; None otherwise."""
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
        return tenant, tok.expires_at


def top_up(db: Database, settings: ServiceSettings, tenant_name: str, amount: Decimal, note: str = "top-up") -> None:
    """Add prepaid credit to a tenant (a payment in its ledger)."""
    if amount <= 0:
        raise ConfigError(f"top-up amount {amount}: must be > 0")
    with db.session() as s:
        t = tenant_by_name(s, tenant_name)
    with tenant_ledger(settings, t.id) as ledger:
        ledger.record_payment("topup", amount, currency=t.currency, note=note)


def upgrade_state(settings: ServiceSettings) -> None:
    """Bring the service's state up to this version: the database schema (Alembic), then the older
    ``balance_entries`` rows into the tenants' ledgers."""
    migrate(settings.url)
    db = Database(settings.url)
    try:
        import_balance_entries(db, settings)
    finally:
        db.dispose()


def import_balance_entries(db: Database, settings: ServiceSettings) -> int:
    """Move the rows of the older ``balance_entries`` table into the tenants' ledgers (each recorded under
    its row id, so a move cut short and done again records none twice); returns how many were moved."""
    with db.session() as s:
        rows = s.scalars(select(BalanceEntry).order_by(BalanceEntry.id)).all()
        tenants = {t.id: t for t in s.scalars(select(Tenant)).all()}
    for r in rows:
        kind: PaymentKind = "signup" if r.kind == "signup" else "topup"
        with tenant_ledger(settings, r.tenant_id) as ledger:
            ledger.record_payment(kind, micros_to_decimal(r.amount_micros), currency=tenants[r.tenant_id].currency,
                                  note=r.note, ref=f"balance_entries:{r.id}", at_s=int(r.at))
        with db.session() as s:
            s.execute(delete(BalanceEntry).where(BalanceEntry.id == r.id))
    return len(rows)


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
    """The tenant's balance from the payments in its ledger and its jobs' ledgers."""
    paid = sum(p.amount_micros for p in payments(settings, tenant))
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


def payments(settings: ServiceSettings, tenant: Tenant) -> list[Payment]:
    """The tenant's sign-up credit and top-ups, oldest first (none before its ledger exists)."""
    path = settings.tenant_dir(tenant.id) / LEDGER_FILE
    if not path.exists():
        return []
    with Ledger.open(path, create=False, read_only=True) as ledger:
        return ledger.payments()


def balance_entries(settings: ServiceSettings, tenant: Tenant) -> list[dict[str, object]]:
    """The tenant's payments in JSON form, oldest first."""
    return [{"at": p.at_s, "kind": p.kind, "amount": str(p.amount), "note": p.note}
            for p in payments(settings, tenant)]
