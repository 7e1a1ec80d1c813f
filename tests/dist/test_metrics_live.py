"""The Prometheus endpoint scraped live during a real ``Trainer.fit`` (2 CPU ranks), the ledger it fills,
and the total budget stopping a real run."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from decimal import Decimal
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from starverse.billing import EventKind, Ledger, check_ledger, make_bill
from starverse.metrics.callbacks import BillingCallback, MetricsCallback
from starverse.plan import Pricing
from starverse.runtime.callbacks import Callback, TrainContext
from starverse.runtime.cluster import Cluster, local_plan
from starverse.runtime.launch import RankSpec
from starverse.runtime.trainer import Trainer
from starverse.testing import SlowRank

VOCAB, SEQ, MB, GB = 48, 16, 2, 8


class TinyLM(torch.nn.Module):
    """Embedding -> MLP -> logits."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 16)
        self.fc = torch.nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(self.emb(ids)))


def _tokens() -> list[torch.Tensor]:
    return [(torch.arange(SEQ * 4) * (i + 1)) % VOCAB for i in range(6)]


def _cluster(price_per_hour: float) -> Cluster:
    ranks = (RankSpec(0, "cpu", num_threads=1), RankSpec(1, "cpu", num_threads=1))
    plan = local_plan(ranks, "tiny", 1, SEQ, GB, precision="fp32")
    plan = plan.model_copy(update={"pricing": Pricing(currency="USD", price_per_hour={"cpu": price_per_hour})})
    return Cluster(plan=plan, ranks=ranks)


class Pace(Callback):
    """Rank 0 waits ``seconds`` after each step (no CPU), so a short run lasts long enough to scrape."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_step_end(self, ctx: TrainContext) -> None:
        if ctx.rank == 0:
            time.sleep(self.seconds)


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _parse(text: str) -> Samples:
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "starverse_job"))
            out[(s.name, labels)] = s.value
    return out


class Scraper(threading.Thread):
    """Scrapes the endpoint named in run_dir/metrics.json every 50 ms until stopped."""

    def __init__(self, run_dir: Path):
        super().__init__(daemon=True)
        self.run_dir = run_dir
        self.scrapes: list[Samples] = []
        self.halt = threading.Event()

    def run(self) -> None:
        endpoint = self.run_dir / "metrics.json"
        while not self.halt.is_set():
            try:
                url = json.loads(endpoint.read_text())["url"]
                assert url.startswith("http://127.0.0.1:")
                with urllib.request.urlopen(url, timeout=5) as r:
                    self.scrapes.append(_parse(r.read().decode()))
            except (OSError, ValueError):
                pass  # not up yet, or already gone
            time.sleep(0.05)


@pytest.mark.slow
def test_live_scrape_matches_training_and_ledger(tmp_path: Path):
    steps = 8
    run_dir = tmp_path / "run"
    scraper = Scraper(run_dir)
    scraper.start()
    billing = BillingCallback(job="live")
    trainer = Trainer(_cluster(3.6), callbacks=[SlowRank(1, 3.0), Pace(0.2), billing,
                                                MetricsCallback(linger_s=1.5, billing=billing)],
                      run_dir=run_dir, rebalance_every=0)
    res = trainer.fit(TinyLM(), dataset=_tokens(), per_device_batch_size=MB, max_steps=steps, seq_len=SEQ,
                      tokenizer="bytes")
    scraper.halt.set()
    scraper.join()
    scrapes = [s for s in scraper.scrapes if ("starverse_steps_total", ()) in s]
    assert scrapes, "no scrape reached the endpoint"
    for s in scrapes:  # each scrape is one consistent snapshot
        assert s[("starverse_tokens_total", ())] == s[("starverse_steps_total", ())] * GB * SEQ
        assert s[("starverse_world_size", ())] == 2
    mid = [s for s in scrapes if 1 <= s[("starverse_steps_total", ())] < steps]
    assert mid, "no scrape while training ran"
    assert mid[-1][("starverse_cost_per_hour", (("currency", "USD"),))] == pytest.approx(7.2)
    last = scrapes[-1]
    assert last[("starverse_steps_total", ())] == steps == res.steps
    assert last[("starverse_tokens_total", ())] == res.tokens_total
    assert last[("starverse_loss", ())] == pytest.approx(res.final_loss, rel=1e-6)
    shares = {r: last[("starverse_batch_share_ratio", (("accelerator", "cpu"), ("rank", r)))] for r in ("0", "1")}
    assert sum(shares.values()) == pytest.approx(1.0)
    assert sum(last[("starverse_micro_batches", (("accelerator", "cpu"), ("rank", r)))] for r in "01") == GB // MB
    assert all(last[("starverse_step_seconds", (("accelerator", "cpu"), ("rank", r)))] > 0 for r in "01")
    with Ledger.open(run_dir / "ledger.sqlite") as led:
        assert check_ledger(led).ok
        job = led.job("live")
        leases = led.leases(job)
        assert len(leases) == 2 and all(le.end_s is not None for le in leases)
        seconds = leases[0].end_s - leases[0].start_s
        assert led.spent(job) == Decimal("0.002") * seconds  # 2 devices x 3.6/h = 0.002/s
        assert make_bill(led).totals[0].charges == led.spent(job)
        assert [e.kind for e in led.events(job)] == [EventKind.STOP]
        spent = float(led.spent(job))
    ccy = (("currency", "USD"),)
    assert last[("starverse_cost_total", ccy)] == pytest.approx(spent)
    assert last[("starverse_cost_per_hour", ccy)] == 0  # leases closed at the end
    assert last[("starverse_cost_per_million_tokens", ccy)] == pytest.approx(spent / res.tokens_total * 1e6)


@pytest.mark.slow
def test_total_budget_stops_a_real_run_within_one_interval(tmp_path: Path):
    run_dir = tmp_path / "run"
    budget = Decimal("0.12")  # 2 devices at 36/h = 0.02/s: about 3 s of training after the projection
    billing = BillingCallback(job="capped", budget_total=budget, checkpoint_s=2.0)
    trainer = Trainer(_cluster(36.0), callbacks=[SlowRank(1, 2.0), Pace(0.05), billing], run_dir=run_dir, rebalance_every=0)
    res = trainer.fit(TinyLM(), dataset=_tokens(), per_device_batch_size=MB, max_steps=100_000, seq_len=SEQ,
                      tokenizer="bytes")
    assert res.steps < 100_000
    with Ledger.open(run_dir / "ledger.sqlite") as led:
        job = led.job("capped")
        events = led.events(job)
        assert [e.kind for e in events] == [EventKind.BUDGET_STOP]
        horizon_s = events[0].detail["horizon_s"]
        spent = led.spent(job)
        assert spent <= budget + Decimal("0.02") * horizon_s  # at most one interval over
        assert spent > budget - Decimal("0.02") * 2 * horizon_s  # and it did not stop much too early
        assert events[0].step == res.steps
        assert check_ledger(led).ok
