"""``run_job``: a job file to a JobResult through the library (what `starverse train` and the service call)."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

from helpers import TINY
from starverse.checkpoint.callback import CheckpointCallback
from starverse.elastic.job import load_job
from starverse.elastic.notice import HttpNotice, SignalNotice
from starverse.elastic.preemption import PreemptionCallback
from starverse.jobs import JobProgress, build_callbacks, prepare_job, run_job
from starverse.metrics.callbacks import BillingCallback, MetricsCallback


def write_job(tmp: Path, *, steps: int = 4, extra: str = "", checkpoint: str = "interval_steps: 1000") -> Path:
    """A tiny job on 2 CPU ranks priced at 36 USD/h per rank."""
    (tmp / "tiny.json").write_text(json.dumps(TINY))
    (tmp / "corpus.txt").write_text(Path(os.__file__).read_text()[:30000])
    (tmp / "pool.yaml").write_text("currency: USD\noffers:\n  - {accelerator: cpu, count: 2, price_per_hour: 36}\n")
    job = tmp / "job.yaml"
    job.write_text(
        "model: tiny.json\ndataset: corpus.txt\nrun_dir: run\npool: pool.yaml\n"
        f"train: {{steps: {steps}, seq_len: 32, global_batch: 8, micro_batch: 2, rebalance_every: 0}}\n"
        f"devices: {{cpu_ranks: 2}}\ncheckpoint: {{{checkpoint}}}\n" + extra
    )
    return job


def test_callbacks_are_built_in_their_fixed_order_and_pickle_together(tmp_path):
    job = load_job(write_job(tmp_path, checkpoint="interval_steps: 5, notice_url: 'http://127.0.0.1:9/p'"))
    from starverse.elastic.job import job_prices

    cbs = build_callbacks(job, mtbf_s=600.0, prices=job_prices(job, ["cpu", "cpu"]))
    assert [type(c) for c in cbs.ordered()] == [PreemptionCallback, CheckpointCallback, BillingCallback,
                                               MetricsCallback]
    assert cbs.checkpoint.billing_cursor == cbs.billing.checkpoint_cursor and cbs.checkpoint.mtbf_s == 600.0
    # the notice URL is polled by each rank: its source must cross into the rank processes (no lambdas)
    sources = cbs.preemption.sources
    assert [type(s) for s in sources] == [SignalNotice, HttpNotice] and sources[1].url == "http://127.0.0.1:9/p"
    pre, ck, billing, metrics = pickle.loads(pickle.dumps(cbs.ordered()))
    assert metrics.billing is billing and metrics.checkpoints is ck
    assert ck.billing_cursor.__self__ is billing


def test_run_job_returns_the_result_the_cli_prints(tmp_path):
    job = write_job(tmp_path)
    seen: list[JobProgress] = []
    prepared = prepare_job(job)
    assert any(line.startswith("checkpoints: ") and line.endswith("; fresh start") for line in prepared.summary_lines())
    result = prepared.run(on_progress=seen.append)
    assert result.final_step == 4 and result.lost_steps == 0 and result.stop_reason is None
    assert [a.outcome for a in result.attempts] == ["completed"]
    assert result.run_dir == tmp_path / "run" and result.checkpoints == tmp_path / "run" / "checkpoints"
    assert result.fit is not None and result.final_loss == result.fit.final_loss
    assert seen and seen[-1].step == 4 and seen[-1].max_steps == 4
    assert [p.step for p in seen] == sorted({p.step for p in seen})
    bill = result.bill
    assert bill is not None and [le.accelerator for le in bill.leases] == ["cpu", "cpu"]
    assert all(le.seconds is not None and le.charge_ticks == 36_000_000 * le.seconds for le in bill.leases)
    assert bill.charge_ticks == sum(le.charge_ticks for le in bill.leases) and bill.events[-1] == ("stop", 4)
    assert result.metrics_url is not None and result.metrics_url.startswith("http://127.0.0.1:")
    as_json = json.loads(json.dumps(result.as_dict()))
    assert as_json["bill"]["charges"] == bill.charges and as_json["final_step"] == 4
    # the same job again resumes from its final checkpoint and has nothing left to do
    again = run_job(job)
    assert again.attempts[0].resumed_from == 4 and again.final_step == 4
