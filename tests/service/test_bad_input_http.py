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
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from service_fixtures import TINY_JOB, Service, make_settings, serve_in_thread

from starverse.service.app import create_app
from starverse.service.protocol import MALFORMED_REQUEST, http_protocol


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    settings = make_settings(tmp_path_factory.mktemp("svc") / "root", "")
    app = create_app(settings)
    service = Service(settings, app.state.ctx.db, TestClient(app))
    yield service
    service.client.close()
    app.state.ctx.close()


@pytest.fixture(scope="module")
def live(svc: Service) -> Iterator[int]:
    """The module's app served by uvicorn on 127.0.0.1 (its HTTP parser, as `starverse serve` runs it): the
    bytes a TestClient will not send reach it over a socket. Yields the port."""
    with serve_in_thread(svc.client.app, http_protocol()) as port:
        yield port


def raw_request(port: int, method: bytes, target: bytes, headers: bytes = b"", body: bytes = b"") -> tuple[int, bytes]:
    """Send one request as raw bytes (any header or target byte) and return its status and body."""
    length = b"Content-Length: %d\r\n" % len(body) if body else b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(method + b" " + target + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n" + headers +
                     length + b"\r\n" + body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, payload = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), payload


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
    ("seq-len-past-the-models-positions", json.dumps({"job": train(seq_len=100_000)}).encode(), JSON,
     "job.yaml:5: train.seq_len: 100000 exceeds the 256 positions of model platform:/models/tiny. To fix: set "
     "seq_len to at most 256"),
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


BAD_UPLOADS: list[tuple[str, str, str, bytes, str]] = [
    # (id, kind, name, body, words of the one line)
    ("binary-dataset", "datasets", "up", b"\x00\xff" * 100, "datasets/up: not a text file (byte 0x00 at offset 0 is a NUL"),
    ("dataset-not-utf8", "datasets", "up", b"text, then \xff\xfe", "byte 0xff at offset 11 is not UTF-8"),
    ("empty-dataset", "datasets", "up", b"", "datasets/up: the upload is empty"),
    ("jsonl-line-not-json", "datasets", "up.jsonl", b'{"text": "a"}\n{bad\n', "datasets/up.jsonl:2: malformed JSON line"),
    ("jsonl-line-without-text", "datasets", "up.jsonl", b'{"text": "a"}\n[1]\n',
     "datasets/up.jsonl:2: each .jsonl line needs a 'text' field"),
    ("jsonl-chat-without-assistant", "datasets", "up.jsonl", b'{"messages": [{"role": "user", "content": "hi"}]}\n',
     "datasets/up.jsonl:1: 'messages' has no assistant turn"),
    ("model-not-json", "models", "up", b"{not json", "models/up: not a model config the service can train: "
                                                    "config.json:1: malformed JSON"),
    ("model-a-list", "models", "up", b"[1, 2]", "config.json: expected a JSON object"),
    ("model-not-utf8", "models", "up", b"\xff\xfe", "config.json: cannot read"),
    ("model-without-model-type", "models", "up", b"{}", "is not a supported family"),
    ("model-hidden-size-1e30", "models", "up", json.dumps({
        "model_type": "llama", "hidden_size": 10**30, "num_hidden_layers": 2, "num_attention_heads": 2,
        "vocab_size": 10, "intermediate_size": 8}).encode(), "hidden_size must be at most"),
]


@pytest.mark.parametrize(("kind", "name", "upload", "words"), [c[1:] for c in BAD_UPLOADS],
                         ids=[c[0] for c in BAD_UPLOADS])
def test_an_upload_that_is_not_what_it_claims_is_refused_when_uploaded(svc: Service, alice: dict[str, str], kind: str,
                                                                        name: str, upload: bytes, words: str) -> None:
    """An upload is checked as a job will read it, when it is uploaded: refused with one line, nothing kept, and
    an item of that name uploaded before stays as it was."""
    good = b"some text\n" if kind == "datasets" else (svc.settings.platform_dir / "models" / "tiny").read_bytes()
    if name.endswith(".jsonl"):
        good = b'{"text": "some text"}\n'
    assert svc.client.put(f"/api/storage/{kind}/{name}", headers=alice, content=good).status_code == 201
    folder = next(svc.settings.tenants_dir.glob(f"*/{kind}/{name}")).parent
    before = svc.client.get(f"/api/storage/{kind}", headers=alice).json()
    one_line(svc.client.put(f"/api/storage/{kind}/{name}", headers=alice, content=upload), 422, words, svc)
    assert svc.client.get(f"/api/storage/{kind}", headers=alice).json() == before
    assert (folder / name).read_bytes() == good
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) == []  # no partial file left


@pytest.mark.parametrize(("kind", "upload", "words"), [
    ("datasets", b"\x00\xff" * 100, "dataset: ~/datasets/old is not a text file (binary or not UTF-8)"),
    ("models", b"[1, 2]", "model: ~/models/old: expected a JSON object"),
], ids=["binary-dataset", "model-a-list"])
def test_a_stored_item_that_is_not_what_it_claims_is_refused_at_submit(svc: Service, alice: dict[str, str],
                                                                      kind: str, upload: bytes, words: str) -> None:
    """An item stored before uploads were checked (or put in place by hand) is still checked when a job names
    it, as `starverse train` checks its files."""
    tenant = svc.client.get("/api/whoami", headers=alice).json()["id"]
    (svc.settings.tenant_dir(tenant) / kind / "old").write_bytes(upload)
    folders = _job_folders(svc)
    one_line(svc.client.post("/api/jobs", headers=alice, json={"job": job(**{kind[:-1]: "old"})}), 422, words, svc)
    assert _job_folders(svc) == folders


def test_good_uploads_are_stored_and_a_job_can_name_them(svc: Service, alice: dict[str, str]) -> None:
    chat = b'{"text": "plain"}\n\n{"prompt": "a", "response": "b"}\n{"messages": [{"role": "assistant", ' \
           b'"content": "c"}]}\n'
    for kind, name, body in (("datasets", "notes.txt", "d\u00e9j\u00e0 vu\n".encode()), ("datasets", "chat.jsonl", chat),
                             ("models", "mine", (svc.settings.platform_dir / "models" / "tiny").read_bytes())):
        r = svc.client.put(f"/api/storage/{kind}/{name}", headers=alice, content=body)
        assert r.status_code == 201 and r.json()["bytes"] == len(body), r.text
    r = svc.client.post("/api/jobs", headers=alice, json={"job": job(dataset="chat.jsonl", model="mine")})
    assert r.status_code == 201, r.text


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


def _bearer(headers: dict[str, str]) -> bytes:
    """The tenant's ``Authorization`` header line, without its CRLF."""
    return f"Authorization: {headers['Authorization']}".encode()


RAW_REQUESTS: list[tuple[str, bytes, bytes, bytes, bytes, int, str]] = [
    # (id, method, target, headers ({auth}: alice's token header), body, status, words of the one JSON line;
    # "" where uvicorn's parser itself refuses the request: protocol.MALFORMED_REQUEST)
    ("token-latin1-bytes", b"GET", b"/api/whoami", b"Authorization: Bearer sv_\xe9\xff\r\n", b"", 401,
     "missing, wrong or expired token"),
    ("token-utf8-accent", b"GET", b"/api/whoami", "Authorization: Bearer sv_\u00e9t\u00e9\r\n".encode(), b"", 401,
     "missing, wrong or expired token"),
    ("scheme-non-ascii", b"GET", b"/api/whoami", b"Authorization: B\xe9arer sv_x\r\n", b"", 401, "wrong or expired"),
    ("valid-token-then-a-non-ascii-byte", b"GET", b"/api/whoami", b"{auth}\xff\r\n", b"", 401, "wrong or expired"),
    ("token-of-100000-non-ascii-bytes", b"GET", b"/api/whoami", b"Authorization: Bearer sv_" + b"\xe9" * 100_000 +
     b"\r\n", b"", 401, "wrong or expired"),
    ("token-with-a-control-byte", b"GET", b"/api/whoami", b"Authorization: Bearer sv_\x01\r\n", b"", 400, ""),
    ("two-authorization-headers", b"GET", b"/api/whoami", b"{auth}\r\nAuthorization: Bearer sv_other\r\n", b"", 400,
     "Authorization: given 2 times. To fix: send one"),
    ("content-type-non-ascii", b"POST", b"/api/jobs", b"{auth}\r\nContent-Type: application/\xffjson\r\n", b"{}",
     422, "job: dataset: required"),
    ("query-value-invalid-utf8", b"GET", b"/api/jobs?state=%ff%fe", b"{auth}\r\n", b"", 422,
     "is not a job state. To fix: use one of"),
    ("query-integer-invalid-utf8", b"GET", b"/api/jobs?limit=%ff", b"{auth}\r\n", b"", 422,
     "query.limit: must be a valid integer"),
    ("query-raw-non-ascii-byte", b"GET", b"/api/jobs?state=\xc3\xa9", b"{auth}\r\n", b"", 400, ""),
    ("bill-by-invalid-utf8", b"GET", b"/api/bill?by=%ff", b"{auth}\r\n", b"", 422, "by: use 'job' or 'day'"),
    ("job-id-invalid-utf8", b"GET", b"/api/jobs/%ff%fe", b"{auth}\r\n", b"", 404, "no such job"),
    ("upload-name-invalid-utf8", b"PUT", b"/api/storage/datasets/%ff", b"{auth}\r\n", b"x", 422, "use letters, digits"),
    ("json-body-not-utf8", b"POST", b"/api/plan", b"{auth}\r\nContent-Type: application/json\r\n", b'{"job": "\xff"}',
     422, "request body: not valid JSON (byte 0xff at offset 9 is not UTF-8). To fix: send a JSON object"),
    ("json-body-nested-100000-deep", b"POST", b"/api/estimate", b"{auth}\r\nContent-Type: application/json\r\n",
     b"[" * 100_000, 422, "request body: not valid JSON (nested too deeply)"),
    ("json-body-int-of-5000-digits", b"POST", b"/api/jobs/x/resume", b"{auth}\r\nContent-Type: application/json\r\n",
     b'{"step": ' + b"9" * 5000 + b"}", 422, "request body: not valid JSON (Exceeds the limit (4300 digits)"),
    ("content-length-not-a-number", b"POST", b"/api/jobs", b"{auth}\r\nContent-Length: x\xff\r\n", b"", 400, ""),
]


@pytest.mark.parametrize(("method", "target", "headers", "body", "status", "words"), [c[1:] for c in RAW_REQUESTS],
                         ids=[c[0] for c in RAW_REQUESTS])
def test_raw_bytes_in_headers_queries_and_bodies_answer_one_line(svc: Service, alice: dict[str, str], live: int,
                                                                 method: bytes, target: bytes, headers: bytes,
                                                                 body: bytes, status: int, words: str) -> None:
    """What a TestClient will not send (bytes beyond ASCII in a header, a raw byte in a query, a body that is not
    UTF-8) sent over a socket to a real server: a 4xx with one line, never a 500, and the server still answers."""
    status_got, payload = raw_request(live, method, target, headers.replace(b"{auth}", _bearer(alice)), body)
    assert status_got == status, (status_got, payload[:300])
    assert b"Traceback" not in payload and str(svc.settings.root).encode() not in payload
    text = payload.decode("utf-8", "replace").strip()
    if words:
        detail = json.loads(text)["detail"]
        assert words in detail and "\n" not in detail, detail
    else:  # the HTTP parser refused it: uvicorn's 400, with the service's JSON line (it was plain text)
        assert json.loads(text) == MALFORMED_REQUEST, text
    assert raw_request(live, b"GET", b"/api/whoami", _bearer(alice) + b"\r\n")[0] == 200
