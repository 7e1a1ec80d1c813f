"""A tenant's payments (sign-up credit, top-ups) live in its billing ledger: recorded once per reference,
moved there from the older ``balance_entries`` table once, and verified by the ledger check."""

from __future__ import annotations

import sqlite3
import time
from decimal import Decimal
from pathlib import Path

from starverse.billing import Ledger, check_ledger
from starverse.billing.ledger import LEDGER_FILE
from starverse.service.db import BalanceEntry, Database
from starverse.service.settings import ServiceSettings
from starverse.service.tenants import balance, create_tenant, payments, top_up, upgrade_state


def test_signup_topup_and_legacy_entries_are_ledger_payments(tmp_path: Path) -> None:
    settings = ServiceSettings(root=tmp_path / "root", signup_credit=Decimal("5"))
    settings.root.mkdir()
    upgrade_state(settings)
    db = Database(settings.url)
    t = create_tenant(db, settings, "alice")
    top_up(db, settings, "alice", Decimal("2.25"), note="card 42")
    # a row of the older table, as a service before this version recorded a top-up
    with db.session() as s:
        s.add(BalanceEntry(tenant_id=t.id, at=time.time(), kind="topup", amount_micros=1_500_000, note="old"))
    upgrade_state(settings)
    upgrade_state(settings)  # a second upgrade finds nothing left to move and records nothing twice
    got = [(p.kind, p.amount, p.note) for p in payments(settings, t)]
    assert got == [("signup", Decimal("5"), "sign-up credit"), ("topup", Decimal("2.25"), "card 42"),
                   ("topup", Decimal("1.5"), "old")]
    with db.session() as s:
        assert s.query(BalanceEntry).count() == 0
    assert balance(db, settings, t).as_dict()["paid_in"] == "8.750000"
    db.dispose()

    path = settings.tenant_dir(t.id) / LEDGER_FILE
    with Ledger.open(path) as ledger:
        again = ledger.record_payment("topup", "9", ref=payments(settings, t)[2].ref)
        assert again.amount == Decimal("1.5") and len(ledger.payments()) == 3  # the same ref: not paid twice
        res = check_ledger(ledger)
        assert res.ok and res.num_payments == 3
    # a payment row that bypassed the schema's checks is reported by the ledger check
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA ignore_check_constraints = ON")
    conn.execute("INSERT INTO payments (kind, currency, amount_micros, at_s, note) VALUES ('topup', 'USD', -5, 0, '')")
    conn.commit()
    conn.close()
    with Ledger.open(path) as ledger:
        res = check_ledger(ledger)
        assert not res.ok and any("payment 4: topup of -5 micro-USD" in p for p in res.problems)
