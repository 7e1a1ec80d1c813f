"""``starverse serve`` admin commands: a token made on the command line opens the API; top-ups and
registrations; bad input is one line and exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from starverse.cli import main
from starverse.service.app import create_app
from starverse.service.db import Database
from starverse.service.settings import ServiceSettings
from starverse.service.tenants import create_token


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out.strip(), err.strip()


def test_token_create_topup_and_register(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "root"
    assert run(capsys, "serve", "tenant", "create", "alice", "--root", str(root))[0] == 0
    code, token, err = run(capsys, "serve", "token", "create", "alice", "--root", str(root))
    assert code == 0 and token.startswith("sv_") and err == ""
    assert run(capsys, "serve", "tenant", "topup", "alice", "12.5", "--root", str(root))[0] == 0
    (tmp_path / "c.txt").write_text("hello " * 100)
    code, dest, _ = run(capsys, "serve", "dataset", "register", "hello", str(tmp_path / "c.txt"), "--root", str(root))
    assert code == 0 and Path(dest).is_file()
    client = TestClient(create_app(ServiceSettings(root=root)))
    h = {"Authorization": f"Bearer {token}"}
    assert client.get("/api/whoami", headers=h).json()["tenant"] == "alice"
    bal = client.get("/api/balance", headers=h).json()
    assert bal["paid_in"] == "17.500000" and [e["kind"] for e in bal["entries"]] == ["signup", "topup"]
    # the sign-up credit and the top-up are payments in the tenant's billing ledger: `bill` shows them and
    # `bill --check` verifies them like any ledger
    tenant_dir = root / "tenants" / client.get("/api/whoami", headers=h).json()["id"]
    code, out, _ = run(capsys, "bill", str(tenant_dir), "--json")
    assert code == 0 and [(p["kind"], p["amount"]) for p in json.loads(out)["payments"]] == [
        ("signup", "5.000000"), ("topup", "12.500000")]
    code, out, _ = run(capsys, "bill", str(tenant_dir), "--check", "--json")
    assert code == 0 and json.loads(out)["ok"] and json.loads(out)["payments"] == 2
    names = {(i["name"], i["owner"]) for i in client.get("/api/storage/datasets", headers=h).json()["items"]}
    assert names == {("hello", "platform")}
    # a second token of the same tenant; an expired one is refused (the CLI makes none that is expired at once)
    code, _, err = run(capsys, "serve", "token", "create", "alice", "--ttl-hours", "-1", "--root", str(root))
    assert code == 2 and "gives a token that has expired when it is printed" in err
    db = Database(ServiceSettings(root=root).url)
    expired = create_token(db, "alice", ttl_s=-1)
    db.dispose()
    assert client.get("/api/whoami", headers={"Authorization": f"Bearer {expired}"}).status_code == 401


@pytest.mark.parametrize(("args", "words"), [
    (("serve", "tenant", "topup", "nobody", "5"), "no tenant 'nobody'"),
    (("serve", "tenant", "topup", "alice", "lots"), "not a number"),
    (("serve", "tenant", "create", "Bad Name"), "tenant name"),
    (("serve", "dataset", "register", "../x", "/etc/hostname"), "no '/'"),
    (("serve", "--database", "mysql://x", "tenant", "create", "bob"), "--database"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          args: tuple[str, ...], words: str) -> None:
    root = str(tmp_path / "root")
    run(capsys, "serve", "tenant", "create", "alice", "--root", root)
    code, _, err = run(capsys, *args, "--root", root)
    assert code == 2, err
    assert words in err and len(err.splitlines()) == 1 and "Traceback" not in err
