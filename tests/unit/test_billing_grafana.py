"""The Grafana dashboard parses, is provisionable, and uses only metrics the exporter defines and serves;
the billing side stays free of torch."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from starverse.metrics import METRICS, JobState, MetricsExporter, RankState, dashboard_path


def _exprs(dash: dict) -> list[str]:
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


def test_dashboard_is_provisionable_and_refers_only_to_defined_metrics():
    dash = json.loads(dashboard_path().read_text())
    assert dash["uid"] == "starverse-training" and dash["id"] is None  # provisioning assigns the id
    # not `job`: Prometheus's own target label (ours would become exported_job under honor_labels: false)
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "starverse_job"}
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) >= 10
    defined = {m.name for m in METRICS}
    used = set()
    for expr in _exprs(dash):
        names = [n for n in re.findall(r"\bstarverse_[a-z_]+", expr) if n != "starverse_job"]
        assert names, expr
        used.update(names)
        assert 'starverse_job="$starverse_job"' in expr and not re.search(r"(?<!starverse_)job=", expr), expr
    assert used <= defined, used - defined
    # the money, per-rank and checkpoint figures are all on the dashboard
    for name in ("starverse_cost_total", "starverse_batch_share_ratio", "starverse_step_seconds",
                 "starverse_preemptions_total", "starverse_last_checkpoint_seconds", "starverse_mfu_ratio"):
        assert name in used


def test_money_panels_have_currency_units_and_steps_have_their_own_axis():
    dash = json.loads(dashboard_path().read_text())
    money = [p for p in dash["panels"] if any(re.search(r"starverse_(cost|credit|budget)", t["expr"])
                                             for t in p["targets"])]
    assert len(money) >= 4
    for p in money:
        units = {o["matcher"]["options"]: o["properties"][0]["value"] for o in p["fieldConfig"]["overrides"]}
        assert p["fieldConfig"]["defaults"]["unit"] == "currencyUSD", p["title"]
        assert units[r".*\bEUR\b.*"] == "currencyEUR" and units[r".*\bCNY\b.*"] == "suffix: CNY", p["title"]
        assert all("{{currency}}" in t["legendFormat"] for t in p["targets"]), p["title"]
    (both,) = [p for p in dash["panels"] if p["title"] == "Checkpoints and steps"]
    (steps,) = [o for o in both["fieldConfig"]["overrides"] if o["matcher"]["options"] == "steps"]
    assert {"id": "custom.axisPlacement", "value": "right"} in steps["properties"]


def test_exporter_serves_every_defined_metric_on_localhost():
    exp = MetricsExporter("job-a").start()
    try:
        assert exp.url.startswith("http://127.0.0.1:") and exp.port > 0
        exp.update(JobState(steps=5, tokens=640, tokens_per_s=12.5, mfu=0.4, loss=2.5, world_size=2,
                            ranks=[RankState(0, "rtx-4090", 1.0, 0.8, 3, 0.75), RankState(1, "t4", 1.1, 0.9, 1, 0.25)],
                            currency="USD", cost=3.2, credits=0.1, cost_per_hour=7.2, budget_remaining=6.8,
                            preemptions=1, checkpoints=2, checkpoint_s=0.5, checkpoint_s_total=1.25))
        with urllib.request.urlopen(exp.url, timeout=5) as r:
            fams = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    finally:
        exp.stop()
    for m in METRICS:
        base = m.name.removesuffix("_total") if m.kind == "counter" else m.name
        assert base in fams, m.name
        assert fams[base].type == m.kind
        sample_names = {s.name for s in fams[base].samples}
        assert m.name in sample_names, (m.name, sample_names)
    cost = fams["starverse_cost_per_million_tokens"].samples[0]
    assert cost.value == 3.2 / 640 * 1e6 and cost.labels == {"starverse_job": "job-a", "currency": "USD"}
    assert all("job" not in s.labels for f in fams.values() for s in f.samples)
    share = {s.labels["rank"]: s.value for s in fams["starverse_batch_share_ratio"].samples}
    assert share == {"0": 0.75, "1": 0.25}


def test_billing_and_exporter_do_not_import_torch():
    code = ("import sys, starverse.billing, starverse.metrics, starverse.cli.bill; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
