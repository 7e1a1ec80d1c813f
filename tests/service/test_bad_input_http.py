"""The HTTP service attacked as a hostile tenant would: malformed and wrongly typed bodies, huge numbers, deep
nesting, unknown fields, odd names and paths, out-of-range query parameters, models and datasets that do not
exist or are not what they claim. Each answers a 4xx with one JSON line naming the field (never a 500 or a
traceback), and a refused job leaves nothing behind: no job row, no job folder.

One service (SQLite, no worker) serves the whole module: no job runs, each request takes milliseconds. The
TestClient raises any exception the app lets escape, so a 500 fails the test with its traceback.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from service_fixtures import TINY_JOB, Service, make_settings

from starverse.service.app import create_app


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    settings = make_settings(tmp_path_factory.mktemp("svc") / "root", "")
    app = create_app(settings)
    service = Service(settings, app.state.ctx.db, TestClient(app))
    yield service
    service.client.close()
    app.state.ctx.close()


@pytest.fixture(scope="module")
def alice(svc: Service) -> dict[str, str]:
    return svc.tenant("alice")


@pytest.fixture(scope="module")
def bob(svc: Service) -> dict[str, str]:
    return svc.tenant("bob")


@pytest.fixture(scope="module")
def job_id(svc: Service, alice: dict[str, str]) -> str:
    r = svc.client.post("/api/jobs", headers=alice, json={"name": "ok", "job": TINY_JOB})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def one_line(r: Any, status: int, words: str, svc: Service) -> None:
    """``r`` is a ``status`` answer whose JSON ``detail`` is one line holding ``words`` and no server path."""
    assert r.status_code == status, (r.status_code, r.text[:500])
    detail = r.json()["detail"]
    assert isinstance(detail, str), detail
    assert words in detail, (words, detail)
    assert "\n" not in detail and "Traceback" not in r.text
    assert str(svc.settings.root) not in r.text and str(svc.settings.root.resolve()) not in r.text


def job(**over: Any) -> dict[str, Any]:
    j = copy.deepcopy(TINY_JOB)
    j.update(over)
    return j


def train(**over: Any) -> dict[str, Any]:
    return job(train={**TINY_JOB["train"], **over})


JSON = "application/json"
YAML = "application/yaml"

JOB_BODIES: list[tuple[str, bytes, str, str]] = [
    # (id, body, content type, words of the one line)
    ("int-of-5000-digits", b'{"job": {"dataset": "corpus", "train": {"steps": ' + b"9" * 5000 + b"}}}", JSON,
     "request body: not valid JSON (Exceeds the limit (4300 digits)"),
    ("array-nested-5000-deep", b"[" * 5000 + b"]" * 5000, JSON, "request body: not valid JSON (nested too deeply)"),
    ("object-nested-5000-deep", b'{"a":' * 5000 + b"1" + b"}" * 5000, JSON, "nested too deeply"),
    ("yaml-nested-5000-deep", b"[" * 5000, YAML, "request body: not valid YAML"),
    ("yaml-duplicate-key", b"model: tiny\ndataset: corpus\ndataset: corpus\n", YAML,
     "text:3: dataset: duplicate key (first given at line 2)"),
    ("yaml-alias-bomb", b'a: &a ["x","x","x","x","x","x","x","x","x"]\n' + b"".join(
        f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n".encode() for p, n in zip("abcdef", "bcdefg", strict=True)),
     YAML, "expands to more than 200,000 values"),
    ("job-is-a-string", json.dumps({"name": "x", "job": "str"}).encode(), JSON,
     "job: expected an object with the job file's fields (got str)"),
    ("unknown-request-field", json.dumps({"name": "x", "job": TINY_JOB, "priority": 1}).encode(), JSON,
     "request body: priority: unknown field"),
    ("name-is-an-object", json.dumps({"name": {"a": 1}, "job": TINY_JOB}).encode(), JSON,
     "name: {'a': 1}: give a job name of 1 to 128 printable characters"),
    ("name-of-100000-chars", json.dumps({"name": "n" * 100_000, "job": TINY_JOB}).encode(), JSON,
     "give a job name of 1 to 128 printable characters"),
    ("name-with-control-chars", json.dumps({"name": "a\nb\x00", "job": TINY_JOB}).encode(), JSON,
     "give a job name of 1 to 128"),
    ("devices-a-string", json.dumps({"job": job(devices="x")}).encode(), JSON,
     "job: devices: expected an object of the job file's devices fields (got str)"),
    ("billing-a-string", json.dumps({"job": job(billing="x")}).encode(), JSON, "job: billing: expected an object"),
    ("metrics-a-list", json.dumps({"job": job(metrics=[1])}).encode(), JSON, "job: metrics: expected an object"),
    ("cpu-ranks-a-million", json.dumps({"job": job(devices={"cpu_ranks": 10**6})}).encode(), JSON,
     "job: devices.cpu_ranks: 1,000,000 is more than the"),
    ("steps-true", json.dumps({"job": train(steps=True)}).encode(), JSON,
     "train.steps: must be a number, not a boolean (got true)"),
    ("steps-1e308", json.dumps({"job": train(steps=1e308)}).encode(), JSON, "train.steps"),
    ("lr-NaN", b'{"job": {"model": "tiny", "dataset": "corpus", "train": {"lr": NaN}}}', JSON,
     "train.lr: must be a finite number (got nan)"),
    ("model-that-does-not-exist", json.dumps({"job": job(model="no-such-model")}).encode(), JSON,
     "job.yaml:1: model: unknown model 'no-such-model'"),
    ("hf-id-that-is-not-bundled", json.dumps({"job": job(model="org/no-such")}).encode(), JSON,
     "job.yaml:1: model: unknown model 'org/no-such'"),
    ("tokenizer-a-server-path", json.dumps({"job": train(tokenizer="/etc/passwd")}).encode(), JSON,
     "train.tokenizer: '/etc/passwd': the service does not read tokenizer files by path"),
    ("ray-pool", json.dumps({"job": job(pool={"ray": "auto"})}).encode(), JSON, "job: pool: ray: not accepted"),
    ("inline-plan-that-does-not-load", json.dumps({"job": job(plan={"x": 1})}).encode(), JSON,
     "plan.yaml:1: x: unknown field"),
    ("inline-pool-unknown-accelerator", json.dumps({"job": job(pool={"offers": [{"accelerator": "h900",
                                                                                   "count": 1}]})}).encode(), JSON,
     "pool.yaml:2: offers[0].accelerator: unknown accelerator"),
]


def _job_folders(svc: Service) -> list[Path]:
    return sorted((svc.settings.root / "tenants").glob("*/jobs/*"))


@pytest.mark.parametrize(("body", "ctype", "words"), [c[1:] for c in JOB_BODIES], ids=[c[0] for c in JOB_BODIES])
def test_bad_job_bodies_answer_one_line_and_keep_nothing(svc: Service, alice: dict[str, str], job_id: str,
                                                         body: bytes, ctype: str, words: str) -> None:
    jobs_before = svc.client.get("/api/jobs", headers=alice).json()
    folders_before = _job_folders(svc)
    r = svc.client.post("/api/jobs", headers={**alice, "content-type": ctype}, content=body)
    one_line(r, 422, words, svc)
    assert svc.client.get("/api/jobs", headers=alice).json() == jobs_before
    assert _job_folders(svc) == folders_before  # a refused job's folder is removed


@pytest.mark.parametrize(("kind", "upload", "words"), [
    ("datasets", b"\x00\xff" * 100, "dataset: ~/datasets/up is not a text file (binary or not UTF-8)"),
    ("models", b"{not json", "model: ~/models/up:1: malformed JSON"),
    ("models", b"[1, 2]", "model: ~/models/up: expected a JSON object"),
    ("models", b"\xff\xfe", "model: ~/models/up: cannot read"),
    ("models", json.dumps({"model_type": "llama", "hidden_size": 10**30, "num_hidden_layers": 2,
                           "num_attention_heads": 2, "vocab_size": 10, "intermediate_size": 8}).encode(),
     "hidden_size must be at most"),
], ids=["binary-dataset", "model-not-json", "model-a-list", "model-not-utf8", "model-hidden-size-1e30"])
def test_an_upload_that_is_not_what_it_claims_is_refused_at_submit(svc: Service, alice: dict[str, str], kind: str,
                                                                   upload: bytes, words: str) -> None:
    """An upload is stored as given; a job naming it is checked as `starverse train` checks its files."""
    assert svc.client.put(f"/api/storage/{kind}/up", headers=alice, content=upload).status_code == 201
    folders = _job_folders(svc)
    one_line(svc.client.post("/api/jobs", headers=alice, json={"job": job(**{kind[:-1]: "up"})}), 422, words, svc)
    assert _job_folders(svc) == folders


def test_another_tenants_model_name_is_not_found(svc: Service, alice: dict[str, str], bob: dict[str, str]) -> None:
    tiny = (svc.settings.platform_dir / "models" / "tiny").read_bytes()
    assert svc.client.put("/api/storage/models/alices-model", headers=alice, content=tiny).status_code == 201
    assert svc.client.post("/api/jobs", headers=alice, json={"job": job(model="alices-model")}).status_code == 201
    r = svc.client.post("/api/jobs", headers=bob, json={"job": job(model="alices-model")})
    one_line(r, 422, "model: unknown model 'alices-model'", svc)
    assert "alice" not in r.json()["detail"].replace("alices-model", "")


@pytest.mark.parametrize(("path", "words"), [
    ("/api/jobs?limit=abc", "query.limit: must be a valid integer"),
    ("/api/jobs?limit=0", "query.limit: must be greater than or equal to 1"),
    ("/api/jobs?limit=" + "9" * 400, "query.limit: must be less than or equal to 1000"),
    ("/api/jobs?state=" + "x" * 10_000, "state: 'xxxx"),
    ("/api/jobs/{id}/progress?after=-1", "query.after: must be greater than or equal to 0"),
    ("/api/jobs/{id}/progress?after=" + str(2**63), "query.after: must be less than or equal to 2147483647"),
    ("/api/jobs/{id}/progress?after=" + "9" * 30, "query.after"),
], ids=["limit-text", "limit-0", "limit-400-digits", "state-unknown", "after-negative", "after-2**63",
        "after-30-digits"])
def test_query_parameters_out_of_range_answer_422(svc: Service, alice: dict[str, str], job_id: str, path: str,
                                                 words: str) -> None:
    one_line(svc.client.get(path.replace("{id}", job_id), headers=alice), 422, words, svc)


@pytest.mark.parametrize("rel", ["a%00b", "a" * 5000, "b/" * 3000 + "c"], ids=["nul", "5000-chars", "deep"])
def test_odd_run_file_paths_answer_404(svc: Service, alice: dict[str, str], job_id: str, rel: str) -> None:
    one_line(svc.client.get(f"/api/jobs/{job_id}/files/{rel}", headers=alice), 404, "no such file in this job", svc)


@pytest.mark.parametrize(("route", "body", "words"), [
    ("resume", {"step": True}, "body.step: must be a valid integer (got True)"),
    ("resume", {"step": "2"}, "body.step: must be a valid integer"),
    ("resume", {"step": 10**30}, "body.step: must be less than or equal to 2147483647"),
    ("resume", {"stepp": 1}, "body.stepp: Extra inputs are not permitted"),
    ("resume", [1], "body: must be a valid dictionary"),
    ("rollback", {"step": -1}, "body.step: must be greater than or equal to 0"),
    ("rollback", {"step": None}, "body.step: must be a valid integer"),
    ("rollback", {}, "body.step: Field required"),
], ids=["step-true", "step-text", "step-1e30", "unknown-field", "a-list", "negative", "null", "missing"])
def test_bad_resume_and_rollback_bodies_answer_one_line(svc: Service, alice: dict[str, str], job_id: str,
                                                         route: str, body: Any, words: str) -> None:
    one_line(svc.client.post(f"/api/jobs/{job_id}/{route}", headers=alice, json=body), 422, words, svc)
    assert svc.client.get(f"/api/jobs/{job_id}", headers=alice).json()["resume_from"] is None


@pytest.mark.parametrize(("path", "body", "words"), [
    ("/api/estimate", {"plan_yaml": "a: 1\na: 2\n"}, "plan_yaml: not valid YAML (text:2: a: duplicate key"),
    ("/api/estimate", {"plan_yaml": "[" * 5000}, "plan_yaml: not valid YAML"),
    ("/api/estimate", {"plan": {"model": "llama-2-7b", "train": "x"}}, "plan.yaml:2: train: must be a valid"),
    ("/api/validate", {"case": {}}, "case.yaml:1: model: required field is missing"),
    ("/api/validate", {"case_yaml": "model: llama-2-7b\nmodel: x\n"}, "duplicate key"),
    ("/api/plan", {"top": 10**20}, "body.top: must be less than or equal to 50"),
    ("/api/plan", {"job": "x"}, "body.job: must be a valid dictionary (got 'x')"),
], ids=["estimate-duplicate-key", "estimate-nested-5000-deep", "estimate-train-a-string", "validate-empty-case",
        "validate-duplicate-key", "plan-top-1e20", "plan-job-a-string"])
def test_bad_planning_bodies_answer_one_line(svc: Service, alice: dict[str, str], path: str, body: Any,
                                             words: str) -> None:
    one_line(svc.client.post(path, headers=alice, json=body), 422, words, svc)


def test_the_largest_ids_a_query_may_name_reach_both_databases(service: Service) -> None:
    """``after``, ``step`` and ``train.steps`` up to 2**31 - 1 are answered on SQLite and PostgreSQL alike; one
    more is a 422 (it overflowed PostgreSQL's INTEGER columns, and 2**63 SQLite's driver: a 500)."""
    alice = service.tenant("alice")
    top = 2**31 - 1
    jid = service.client.post("/api/jobs", headers=alice, json={"job": train(steps=top)}).json()["id"]
    r = service.client.get(f"/api/jobs/{jid}/progress?after={top}", headers=alice)
    assert r.status_code == 200 and r.json()["samples"] == [], r.text
    one_line(service.client.get(f"/api/jobs/{jid}/progress?after={top + 1}", headers=alice), 422,
             f"query.after: must be less than or equal to {top}", service)
    service.client.post(f"/api/jobs/{jid}/stop", headers=alice)
    one_line(service.client.post(f"/api/jobs/{jid}/rollback", headers=alice, json={"step": top}), 422,
             f"step: no checkpoint at step {top}", service)
    folders = _job_folders(service)
    one_line(service.client.post("/api/jobs", headers=alice, json={"job": train(steps=top + 1)}), 422,
             "job: train.steps: 2,147,483,648 is more than the 2,147,483,647 steps the service tracks", service)
    assert _job_folders(service) == folders
