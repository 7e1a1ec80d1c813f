"""``starverse serve token create`` makes a token of an existing tenant only: an unknown (or misspelt) name is
one line naming ``serve tenant create``, exit code 2, and no tenant, directory or sign-up credit appears."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select

from starverse.cli import main
from starverse.service.db import Database, Tenant
from starverse.service.settings import ServiceSettings


def test_token_create_refuses_an_unknown_tenant_and_invents_no_money(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "root"
    assert main(["serve", "tenant", "create", "alice", "--root", str(root)]) == 0
    capsys.readouterr()
    code = main(["serve", "token", "create", "alcie", "--root", str(root)])
    out, err = capsys.readouterr()
    assert code == 2 and out == "", out
    assert err.strip() == ("error: no tenant 'alcie'. To fix: create it first with `starverse serve tenant create "
                           "alcie` (it starts with the sign-up credit), or check the spelling")
    db = Database(ServiceSettings(root=root).url)
    with db.session() as s:
        names = [t.name for t in s.scalars(select(Tenant)).all()]
    db.dispose()
    assert names == ["alice"]
    assert len(list((root / "tenants").iterdir())) == 1  # no directory, no ledger with a sign-up payment
    code = main(["serve", "token", "create", "alice", "--root", str(root)])
    assert code == 0 and capsys.readouterr().out.startswith("sv_")
