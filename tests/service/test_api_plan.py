"""Catalog, models, estimate, plan and validate over HTTP: the library's answers, the library's errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from service_fixtures import Service

# these routes touch the database only to authenticate (covered on PostgreSQL by test_api_rules)
pytestmark = pytest.mark.parametrize("db_url", [""], ids=["sqlite"])

REPO = Path(__file__).resolve().parents[2]
PLAN = {"model": "llama-2-7b", "train": {"seq_len": 4096, "global_batch": 128, "precision": "bf16",
                                         "zero_stage": 3, "recompute": "full"},
        "groups": [{"replicas": 8, "micro_batch": 1, "stages": [{"accelerator": "a100-80gb-sxm", "tp": 1, "layers": 32}]}]}


def test_catalog_and_models(service: Service) -> None:
    h = service.tenant("alice")
    cat = service.client.get("/api/catalog", headers=h).json()
    assert "h100-80gb-sxm" in {a["id"] for a in cat["accelerators"]}
    assert "llama-2-7b" in {m["id"] for m in service.client.get("/api/models", headers=h).json()}


def test_plan_quickstart_and_an_infeasible_job(service: Service) -> None:
    h = service.tenant("alice")
    body = {"job_yaml": (REPO / "examples/quickstart/job.yaml").read_text(),
            "pool_yaml": (REPO / "examples/quickstart/pool.yaml").read_text(), "top": 3}
    doc = service.client.post("/api/plan", headers=h, json=body).json()
    assert doc["feasible"] and 1 <= len(doc["plans"]) <= 3 and doc["frontier"]
    assert doc["plans"][0]["rank"] == 1 and doc["chosen"]
    assert doc["plans"][0]["cost_per_hour"] <= 20  # the job's max_budget_per_hour
    # the same job and pool again, as objects this time: the canonical form is the same, so the answer comes
    # from the plan cache without a second search; another `top` is another search
    plans = service.client.app.state.ctx.plans  # type: ignore[attr-defined]
    same = {"job": yaml.safe_load(body["job_yaml"]), "pool": yaml.safe_load(body["pool_yaml"]), "top": 3}
    assert service.client.post("/api/plan", headers=h, json=same).json() == doc
    assert (plans.misses, plans.hits) == (1, 1)
    assert len(service.client.post("/api/plan", headers=h, json={**same, "top": 1}).json()["plans"]) == 1
    assert plans.misses == 2
    bad = {"job": {"model": "llama-2-7b", "train": {"seq_len": 4096, "global_batch": 128, "tokens": 2e9},
                   "constraints": {"max_budget_per_hour": 0.1}},
           "pool": {"currency": "USD", "offers": [{"accelerator": "rtx-4090", "count": 2, "price_per_hour": 0.69}]}}
    doc = service.client.post("/api/plan", headers=h, json=bad).json()
    assert doc["feasible"] is False and "0.1 USD/h" in doc["message"] and doc["reasons"]
    assert str(service.settings.root) not in str(doc)


def test_plan_input_errors(service: Service) -> None:
    h = service.tenant("alice")
    pool = (REPO / "examples/quickstart/pool.yaml").read_text()
    cases = [({"job_yaml": "model: [", "pool_yaml": pool}, "job_yaml: not valid YAML"),
             ({"job": {"model": "llama-2-7b"}, "job_yaml": "x: 1", "pool_yaml": pool}, "exactly one"),
             ({"job": {"model": "../../etc/x.json", "train": {"seq_len": 8}}, "pool_yaml": pool}, "registry id"),
             ({"job": {"model": "llama-2-7b", "train": {"seq_len": 4096, "global_batch": 8, "tokens": 1e6},
                       "objective": "fastest"}, "pool_yaml": pool}, "objective"),
             ({"job_yaml": "model: x", "pool_yaml": pool, "topp": 3}, "topp")]
    for body, words in cases:
        r = service.client.post("/api/plan", headers=h, json=body)
        assert r.status_code == 422, (body, r.text)
        assert words in r.text, (words, r.text)


def test_estimate_and_validate(service: Service) -> None:
    h = service.tenant("alice")
    est = service.client.post("/api/estimate", headers=h, json={"plan": PLAN}).json()
    assert est["tokens_per_s"] > 0 and est["fits"] is True
    r = service.client.post("/api/estimate", headers=h, json={"plan_yaml": yaml.safe_dump({**PLAN, "model": "nope-9b"})})
    assert r.status_code == 422 and "nope-9b" in r.json()["detail"]
    case = {**PLAN, "measured": {"tokens_per_s": 25000.0}, "source": "a test"}
    doc = service.client.post("/api/validate", headers=h, json={"case": case}).json()
    assert doc["ok"] and doc["measured_tokens_per_s"] == 25000.0
    assert abs(doc["error"] - (doc["predicted_tokens_per_s"] / 25000.0 - 1)) < 1e-12
