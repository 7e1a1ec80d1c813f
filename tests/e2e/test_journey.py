"""A new user's journey through the CLI, on this machine's CPU ranks priced from `examples/train/pool.yaml`:

`starverse plan` the tiny example → `starverse train` with that plan (checkpoint every INTERVAL steps, ledger,
Prometheus metrics) → one rank process is SIGKILLed mid-run (a spot device taken back without notice) → the
supervisor re-plans on the survivor and resumes from the last checkpoint → `starverse checkpoints list` →
`starverse bill --json` shows the per-second charges and the insurance credit for the redone work → `bill
--check` passes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from helpers import CLI
from helpers import new_user_env as _env
from starverse.providers.local import RANK_PROCESS_NAME
from starverse.providers.reaper import descendants

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "train"
INTERVAL = 80  # wide enough that 2 s after a checkpoint is still before the next one on a fast, idle machine
STEPS = 160
PRICE_MICROS = 120_000  # pool.yaml: 0.12 USD per rank-hour, spot; one tick per micro-unit-hour is 1/3600 s


def _run(args: list[str], tmp: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], cwd=tmp, env=_env(tmp), capture_output=True, text=True, timeout=timeout)


def _rank_processes(launcher: int) -> list[int]:
    """The rank processes under the ``launcher`` process, oldest first (rank 0 starts first): its descendants
    named ``sv-rank<N>`` (children of the fork server the launcher started, or of the launcher with ``spawn``)."""
    found = []
    for pid, start in descendants(launcher).items():
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if comm.startswith(RANK_PROCESS_NAME.format(rank="")):
            found.append((start, pid))
    return [pid for _, pid in sorted(found)]


def _scrape(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "starverse_job")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def test_plan_train_lose_a_rank_resume_list_and_bill(tmp_path):
    # 1. plan: the tiny Llama on the local pool (2 CPU ranks), written out as a plan file
    out = _run(["plan", str(EXAMPLE / "plan-job.yaml"), "--pool", str(EXAMPLE / "pool.yaml"),
                "--out", "plan.yaml", "--json"], tmp_path)
    assert out.returncode == 0, out.stderr
    best = json.loads(out.stdout)["plans"][0]
    assert best["devices"] == {"cpu": 2} and best["cost_per_hour"] == pytest.approx(0.24)
    assert (tmp_path / "plan.yaml").is_file()

    # 2. train with that plan; the pool prices the leases
    (tmp_path / "corpus.txt").write_text(Path(os.__file__).read_text()[:60000])
    job = tmp_path / "job.yaml"
    job.write_text(
        f"model: {EXAMPLE / 'tiny-llama.json'}\ndataset: corpus.txt\nrun_dir: run\nplan: plan.yaml\n"
        f"pool: {EXAMPLE / 'pool.yaml'}\n"
        f"train: {{steps: {STEPS}, seq_len: 128, global_batch: 16, micro_batch: 2, rebalance_every: 0}}\n"
        f"devices: {{cpu_ranks: 2}}\ncheckpoint: {{interval_steps: {INTERVAL}, keep_last: 5}}\n"
        "billing: {max_budget_per_hour: 1.0}\nmetrics: {port: 0}\n"
    )
    proc = subprocess.Popen([*CLI, "train", str(job), "--json"], cwd=tmp_path, env=_env(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / f"step-{INTERVAL}"
    deadline = time.monotonic() + 150
    committed_at = None
    scraped: dict[str, float] = {}
    killed = None
    try:
        while killed is None:
            assert proc.poll() is None, f"the job ended before a rank was killed: {proc.communicate()}"
            assert time.monotonic() < deadline, f"no checkpoint of step {INTERVAL} in time"
            if committed_at is None and ckpt.is_dir():
                committed_at = time.monotonic()
            if committed_at is not None and not scraped and (run / "metrics.json").is_file():
                scraped = _scrape(json.loads((run / "metrics.json").read_text())["url"])
            # the ledger counts whole seconds: lose the device >= 2 s after the checkpoint, before the next one
            if committed_at is not None and time.monotonic() - committed_at >= 2.0:
                step = json.loads((run / "progress.json").read_text())["step"]
                assert step < 2 * INTERVAL - 2, f"steps too fast to lose a rank between checkpoints (step {step})"
                ranks = _rank_processes(proc.pid)
                assert len(ranks) == 2, ranks
                os.kill(ranks[-1], signal.SIGKILL)  # rank 1: the spot device taken back without notice
                killed = step
            time.sleep(0.05)
        stdout, stderr = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    res = json.loads(stdout)

    # metrics while training: served on 127.0.0.1, money from the ledger
    assert scraped["starverse_world_size"] == 2
    assert scraped["starverse_cost_per_hour{currency=USD}"] == pytest.approx(0.24)
    assert scraped["starverse_steps_total"] >= INTERVAL
    assert res["metrics_url"].startswith("http://127.0.0.1:")

    # 3. the supervisor resumed on the survivor from the last complete checkpoint
    first, second = res["attempts"]
    assert (first["outcome"], second["outcome"]) == ("lost", "completed")
    assert "killed by signal SIGKILL" in first["detail"]
    assert first["device_kinds"] == ["cpu", "cpu"] and second["device_kinds"] == ["cpu"]
    assert second["resumed_from"] == INTERVAL and res["final_step"] == STEPS
    assert first["last_step"] >= killed
    assert res["lost_steps"] == first["last_step"] - INTERVAL and 0 < res["lost_steps"] <= INTERVAL

    # 4. checkpoints list: the step resumed from and the final one (written by one rank)
    out = _run(["checkpoints", "list", "run", "--json"], tmp_path)
    assert out.returncode == 0, out.stderr
    listed = {c["step"]: c for c in json.loads(out.stdout)["checkpoints"]}
    assert {INTERVAL, STEPS} <= set(listed) and listed[STEPS]["ranks"] == 1 and listed[INTERVAL]["ranks"] == 2

    # 5. the bill: per-second charges of three leases (2 ranks, then the survivor), the credit apart
    out = _run(["bill", "run", "--by", "device", "--json"], tmp_path)
    assert out.returncode == 0, out.stderr
    by_device = json.loads(out.stdout)
    (total,) = by_device["totals"]
    assert total["currency"] == "USD" and by_device["open_leases"] == 0
    assert total["charge_ticks"] == sum(line["charge_ticks"] for line in by_device["lines"]) > 0
    bill = res["bill"]
    assert bill["charge_ticks"] == total["charge_ticks"]  # the train summary's bill is the ledger's
    assert len(bill["leases"]) == 3 and not any(le["open"] for le in bill["leases"])
    for le in bill["leases"]:  # spot at 0.12 USD/h, per second
        assert le["mode"] == "spot" and le["charge_ticks"] == PRICE_MICROS * le["seconds"]
    # insurance: the work from the first checkpoint to the loss, on both leases of the first attempt
    credits = by_device["credits"]
    assert len(credits) == 2 and {c["kind"] for c in credits} == {"redo"}
    assert all(c["seconds"] >= 1 and c["ticks"] == PRICE_MICROS * c["seconds"] for c in credits)
    assert total["credit_ticks"] == sum(c["ticks"] for c in credits) == bill["credit_ticks"] > 0
    first_leases = {le["lease"] for le in bill["leases"][:2]}
    assert {c["lease"] for c in credits} == first_leases
    assert [e["kind"] for e in bill["events"]] == ["checkpoint", "preemption", "resume", "checkpoint", "stop"]

    out = _run(["bill", "run", "--check"], tmp_path)
    assert out.returncode == 0 and "OK (1 jobs, 3 leases" in out.stdout, out.stdout + out.stderr
