"""The service's rules, one test each: tokens, tenant isolation (404 for another tenant's ids), paths that
try to leave the tenant's directory, body size limits, malformed bodies, quotas and the prepaid balance at
submit. No job runs here (no worker): these are fast, and run on SQLite and PostgreSQL alike."""

from __future__ import annotations

import copy
import json

import pytest
import yaml
from service_fixtures import TINY_JOB, Service

from starverse.service.db import Database
from starverse.service.tenants import create_token, hash_token


def submit(svc: Service, headers: dict[str, str], job: dict | None = None, name: str = "j") -> dict:
    r = svc.client.post("/api/jobs", headers=headers, json={"name": name, "job": job or TINY_JOB})
    assert r.status_code == 201, r.text
    return r.json()


def test_health_is_open_every_other_route_needs_a_token(service: Service) -> None:
    assert service.client.get("/api/health").json() == {"ok": True}
    for method, path in (("get", "/api/jobs"), ("get", "/api/catalog"), ("post", "/api/plan"),
                         ("get", "/api/bill"), ("get", "/api/storage/datasets"), ("get", "/api/balance")):
        r = getattr(service.client, method)(path)
        assert r.status_code == 401, (path, r.text)
        assert "Bearer" in r.json()["detail"]


def test_wrong_token_is_refused(service: Service) -> None:
    service.tenant("alice")
    for auth in ("Bearer sv_not-a-real-token", "Bearer ", "Basic YWxpY2U6cHc=", "sv_x"):
        assert service.client.get("/api/jobs", headers={"Authorization": auth}).status_code == 401


def test_expired_token_is_refused_and_a_fresh_one_works(service: Service) -> None:
    service.tenant("alice")
    expired = create_token(service.db, "alice", ttl_s=-1)
    live = create_token(service.db, "alice", ttl_s=3600)
    assert service.client.get("/api/jobs", headers={"Authorization": f"Bearer {expired}"}).status_code == 401
    assert service.client.get("/api/jobs", headers={"Authorization": f"Bearer {live}"}).status_code == 200


def test_tokens_are_stored_hashed(service: Service) -> None:
    service.tenant("alice")
    token = create_token(service.db, "alice")
    from sqlalchemy import text

    with service.db.session() as s:
        stored = [r[0] for r in s.execute(text("SELECT token_hash FROM tokens"))]
    assert token not in stored and hash_token(token) in stored


def test_another_tenants_job_answers_404_like_a_missing_one(service: Service) -> None:
    alice, bob = service.tenant("alice"), service.tenant("bob")
    job = submit(service, alice)
    jid = job["id"]
    assert service.client.get(f"/api/jobs/{jid}", headers=alice).status_code == 200
    routes = [("get", f"/api/jobs/{jid}"), ("get", f"/api/jobs/{jid}/progress"), ("get", f"/api/jobs/{jid}/logs"),
              ("get", f"/api/jobs/{jid}/checkpoints"), ("get", f"/api/jobs/{jid}/bill"),
              ("get", f"/api/jobs/{jid}/files"), ("get", f"/api/jobs/{jid}/files/job.yaml"),
              ("get", f"/api/jobs/{jid}/stream"), ("post", f"/api/jobs/{jid}/stop")]
    for method, path in routes:
        r = getattr(service.client, method)(path, headers=bob)
        missing = getattr(service.client, method)(path.replace(jid, "0" * 32), headers=bob)
        assert r.status_code == 404 == missing.status_code, (path, r.text)
        assert r.json() == missing.json()
    for path, body in ((f"/api/jobs/{jid}/resume", {}), (f"/api/jobs/{jid}/rollback", {"step": 2})):
        assert service.client.post(path, headers=bob, json=body).status_code == 404
    assert service.client.get("/api/jobs", headers=bob).json() == []
    # the job was not touched by bob's stop
    assert service.client.get(f"/api/jobs/{jid}", headers=alice).json()["state"] == "queued"


def test_run_files_cannot_be_reached_outside_the_job(service: Service) -> None:
    alice, bob = service.tenant("alice"), service.tenant("bob")
    a = submit(service, alice)
    b = submit(service, bob)
    assert service.client.get(f"/api/jobs/{a['id']}/files/job.yaml", headers=alice).status_code == 200
    sneaky = [f"../{b['id']}/job.yaml", f"..%2F{b['id']}%2Fjob.yaml", "../../../service.sqlite",
              "%2e%2e/%2e%2e/ledger.sqlite", "/etc/passwd", "....//....//etc/passwd"]
    for rel in sneaky:
        r = service.client.get(f"/api/jobs/{a['id']}/files/{rel}", headers=alice)
        assert r.status_code == 404, (rel, r.status_code, r.text[:200])


@pytest.mark.parametrize(("field", "value", "words"), [
    ("dataset", "../../other/datasets/x", "dataset"),
    ("dataset", "/etc/passwd", "dataset"),
    ("model", "../../../platform/models/tiny", "model"),
    ("model", "/etc/hostname", "model"),
    ("run_dir", "/tmp/elsewhere", "run_dir"),
    ("checkpoint", {"dir": "/tmp/x"}, "checkpoint.dir"),
    ("billing", {"ledger": "/tmp/l.sqlite"}, "billing.ledger"),
    ("checkpoint", {"trace": "/etc/passwd"}, "checkpoint.trace"),
])
def test_a_job_cannot_name_paths_outside_the_tenant(service: Service, field: str, value: object,
                                                     words: str) -> None:
    alice = service.tenant("alice")
    job = copy.deepcopy(TINY_JOB)
    job[field] = value
    r = service.client.post("/api/jobs", headers=alice, json={"job": job})
    assert r.status_code == 422, r.text
    assert words in r.json()["detail"]
    assert str(service.settings.root) not in r.text


def test_storage_names_cannot_traverse(service: Service) -> None:
    alice = service.tenant("alice")
    for name in ("..", "..%2F..%2Fservice.sqlite", ".hidden", "a..b"):
        r = service.client.put(f"/api/storage/datasets/{name}", headers=alice, content=b"x")
        assert r.status_code in (404, 422), (name, r.text)
    assert service.client.delete("/api/storage/datasets/..", headers=alice).status_code in (404, 422)
    assert not (service.settings.root / "service.sqlite.part").exists()


def test_oversized_bodies_are_refused(make_service) -> None:  # type: ignore[no-untyped-def]
    svc = make_service(max_body_bytes=4096, max_upload_bytes=10_000, quota_bytes=15_000)
    alice = svc.tenant("alice")
    big = {"name": "x" * 5000, "job": TINY_JOB}
    r = svc.client.post("/api/jobs", headers=alice, json=big)
    assert r.status_code == 413 and "larger than 4096" in r.json()["detail"]

    def chunks():  # no Content-Length: the cap is enforced while streaming
        for _ in range(10):
            yield b"x" * 1000

    r = svc.client.post("/api/plan", headers=alice, content=chunks())
    assert r.status_code == 413
    assert svc.client.put("/api/storage/datasets/big", headers=alice, content=b"x" * 10_001).status_code == 413
    # within the upload cap, but past the quota on the second upload: refused, nothing kept
    assert svc.client.put("/api/storage/datasets/a", headers=alice, content=b"a" * 9000).status_code == 201
    r = svc.client.put("/api/storage/datasets/b", headers=alice, content=b"b" * 9000)
    assert r.status_code == 413 and "quota" in r.json()["detail"]
    listed = svc.client.get("/api/storage/datasets", headers=alice).json()
    assert [i["name"] for i in listed["items"] if i["owner"] == "tenant"] == ["a"]
    assert listed["used_bytes"] == 9000
    assert svc.client.delete("/api/storage/datasets/a", headers=alice).status_code == 200
    assert svc.client.put("/api/storage/datasets/b", headers=alice, content=b"b" * 9000).status_code == 201


@pytest.mark.parametrize(("content", "ctype", "words"), [
    (b"{not json", "application/json", "not valid JSON"),
    (b"[1, 2]", "application/json", "expected an object"),
    (b"\xff\xfe", "application/json", "not valid JSON"),
    (b"model: [unclosed", "application/yaml", "not valid YAML"),
    (json.dumps({"job": {**TINY_JOB, "train": {"steps": -3}}}).encode(), "application/json", "train.steps"),
    (json.dumps({"job": {**TINY_JOB, "trian": {}}}).encode(), "application/json", "trian"),
    (json.dumps({"job": {**TINY_JOB, "dataset": "nope"}}).encode(), "application/json", "no dataset 'nope'"),
])
def test_malformed_job_bodies_answer_one_line(service: Service, content: bytes, ctype: str, words: str) -> None:
    alice = service.tenant("alice")
    r = service.client.post("/api/jobs", headers={**alice, "content-type": ctype}, content=content)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert words in detail and "\n" not in detail and "Traceback" not in r.text


def test_a_job_as_yaml_is_accepted(service: Service) -> None:
    alice = service.tenant("alice")
    r = service.client.post("/api/jobs", headers={**alice, "content-type": "application/yaml"},
                            content=yaml.safe_dump({"name": "from-yaml", **TINY_JOB}).encode())
    assert r.status_code == 201, r.text
    assert r.json()["name"] == "from-yaml" and r.json()["max_steps"] == 6


def test_named_datasets_resolve_to_the_tenants_copy_before_the_platforms(service: Service) -> None:
    alice, bob = service.tenant("alice"), service.tenant("bob")
    assert service.client.put("/api/storage/datasets/corpus", headers=alice,
                              content=b"alice's own text " * 50).status_code == 201
    a, b = submit(service, alice), submit(service, bob)
    spec_a = yaml.safe_load(service.client.get(f"/api/jobs/{a['id']}/files/job.yaml", headers=alice).text)
    spec_b = yaml.safe_load(service.client.get(f"/api/jobs/{b['id']}/files/job.yaml", headers=bob).text)
    assert spec_a["dataset"].startswith(str(service.settings.tenant_dir(_tenant_id(service, "alice"))))
    assert spec_b["dataset"] == str((service.settings.platform_dir / "datasets" / "corpus").resolve())
    # bob cannot name alice's upload: he gets the platform's copy, and alice's private name is not his
    assert service.client.put("/api/storage/datasets/secret", headers=alice, content=b"s" * 100).status_code == 201
    r = service.client.post("/api/jobs", headers=bob, json={"job": {**TINY_JOB, "dataset": "secret"}})
    assert r.status_code == 422 and "no dataset 'secret'" in r.json()["detail"]
    names = {i["name"] for i in service.client.get("/api/storage/datasets", headers=bob).json()["items"]}
    assert names == {"corpus"}


def _tenant_id(service: Service, name: str) -> str:
    from sqlalchemy import select

    from starverse.service.db import Tenant

    with service.db.session() as s:
        t = s.scalar(select(Tenant).where(Tenant.name == name))
        assert t is not None
        return t.id


def test_submit_is_refused_without_balance_and_a_top_up_lets_it_in(service: Service) -> None:
    from decimal import Decimal

    from starverse.service.tenants import top_up

    broke = service.tenant("broke", credit=Decimal(0))
    r = service.client.post("/api/jobs", headers=broke, json={"job": TINY_JOB})
    assert r.status_code == 402 and "top up" in r.json()["detail"]
    top_up(service.db, service.settings, "broke", Decimal("2.5"))
    bal = service.client.get("/api/balance", headers=broke).json()
    assert bal["remaining"] == "2.500000" and [e["kind"] for e in bal["entries"]] == ["topup"]
    assert [(p["kind"], p["amount"]) for p in service.client.get("/api/bill", headers=broke).json()["payments"]] == [
        ("topup", "2.500000")]
    assert service.client.post("/api/jobs", headers=broke, json={"job": TINY_JOB}).status_code == 201
    rich = service.tenant("rich")
    assert service.client.get("/api/balance", headers=rich).json()["entries"][0]["kind"] == "signup"


def test_stop_of_a_queued_job_and_resume_rules(service: Service) -> None:
    alice = service.tenant("alice")
    jid = submit(service, alice)["id"]
    assert service.client.post(f"/api/jobs/{jid}/resume", headers=alice, json={}).status_code == 409
    r = service.client.post(f"/api/jobs/{jid}/stop", headers=alice)
    assert r.json()["state"] == "stopped"
    assert service.client.post(f"/api/jobs/{jid}/stop", headers=alice).status_code == 409
    r = service.client.post(f"/api/jobs/{jid}/rollback", headers=alice, json={"step": 4})
    assert r.status_code == 422 and "no checkpoint at step 4" in r.json()["detail"]
    assert service.client.post(f"/api/jobs/{jid}/resume", headers=alice, json={}).json()["state"] == "queued"


def test_the_database_schema_comes_from_the_migrations(service: Service) -> None:
    from sqlalchemy import inspect

    db = Database(service.settings.url)
    try:
        tables = set(inspect(db.engine).get_table_names())
    finally:
        db.dispose()
    assert {"alembic_version", "tenants", "tokens", "jobs", "job_events", "job_samples", "balance_entries"} <= tables
