"""The `starverse train` job file: schema errors as one line, paths relative to the file, and the MTBF the
checkpoint interval uses (per-device rate, a real spot trace, or the pool's offers)."""

from __future__ import annotations

import math

import pytest

from starverse.elastic.interval import job_mtbf_s
from starverse.elastic.job import job_mtbf, load_job
from starverse.elastic.traces import load_trace
from starverse.errors import ConfigError


def _write(tmp_path, text: str):
    p = tmp_path / "job.yaml"
    p.write_text(text)
    return p


def test_paths_are_relative_to_the_job_file_and_defaults_apply(tmp_path):
    (tmp_path / "tiny.json").write_text("{}")
    job = load_job(_write(tmp_path, "model: tiny.json\ndataset: data/\ncheckpoint: {trace: t.csv}\n"))
    assert job.model == str(tmp_path / "tiny.json")
    assert job.dataset == str(tmp_path / "data") and job.run_dir == str(tmp_path / "runs" / "job")
    assert job.checkpoint.trace == str(tmp_path / "t.csv") and job.checkpoint.interval_steps is None
    assert job.checkpoint.grace_s == 30.0 and job.checkpoint.keep_last == 3 and job.train.global_batch == 16
    assert load_job(_write(tmp_path, "model: llama\ndataset: x\n")).model == "llama"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("dataset: x\ncheckpoint:\n  intervall_steps: 5\n",
         "job.yaml:3: checkpoint.intervall_steps: unknown field; did you mean 'interval_steps'?"),
        ("dataset: x\ncheckpoint: {grace_s: 0}\n", "job.yaml:2: checkpoint.grace_s: must be greater than 0 (got 0)"),
        ("model: llama\n", "job.yaml:1: dataset: required field is missing"),
        ("dataset: x\ntrain: {global_batch: 10, micro_batch: 4}\n",
         "train.global_batch: 10 is not a multiple of train.micro_batch 4"),
        ("dataset: x\nheartbeat_s: 5\nheartbeat_timeout_s: 2\n",
         "heartbeat_timeout_s (2) must be above heartbeat_s (5); raise heartbeat_timeout_s"),
        ("dataset: x\nheartbeat_timeout_s: 0\n", "job.yaml:2: heartbeat_timeout_s: must be greater than 0 (got 0)"),
    ],
)
def test_job_file_errors_are_one_line(tmp_path, text, message):
    with pytest.raises(ConfigError) as e:
        load_job(_write(tmp_path, text))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_mtbf_from_rate_trace_and_pool(tmp_path, repo_root):
    kinds = ["rtx-4090"] * 4
    job = load_job(_write(tmp_path, "dataset: x\ncheckpoint: {interruptions_per_hour: 0.5}\n"))
    mtbf, why = job_mtbf(job, kinds)
    assert mtbf == pytest.approx(3600 / 2.0) and why == "0.5/device-h × 4 devices"

    trace = repo_root / "data/traces/bamboo/p3-trace.csv"
    job = load_job(_write(tmp_path, f"dataset: x\ncheckpoint: {{trace: {trace}}}\n"))
    mtbf, why = job_mtbf(job, kinds)
    stats = load_trace(trace)
    assert mtbf == pytest.approx(3600 / (stats.events_per_hour * 4 / stats.mean_nodes))
    assert why.split("trace ")[1] == "p3-trace.csv: 6.95 interruption events/h over 24 nodes (2.1 nodes each), scaled to 4"

    (tmp_path / "pool.yaml").write_text(
        "currency: USD\noffers:\n"
        "  - {accelerator: rtx-4090, count: 8, price_per_hour: 0.4, pricing: spot, interruptions_per_hour: 0.25}\n"
        "  - {accelerator: a100-80gb-sxm, count: 8, price_per_hour: 2.0}\n"
    )
    job = load_job(_write(tmp_path, "dataset: x\npool: pool.yaml\n"))
    assert job_mtbf(job, kinds)[0] == pytest.approx(job_mtbf_s([0.25] * 4))
    assert job_mtbf(job, ["a100-80gb-sxm"]) == (math.inf, "no interruption rate given")
    (tmp_path / "pool.yaml").write_text("offers:\n  - price_per_hour: 1\n")
    with pytest.raises(ConfigError, match=r"pool.yaml: offers\[0\]: expected a mapping with 'accelerator'"):
        job_mtbf(job, kinds)
