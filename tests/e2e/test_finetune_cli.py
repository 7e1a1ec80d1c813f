"""Fine-tuning as a new user does it: a tiny Llama saved with save_pretrained, LoRA-fine-tuned for a few steps on 2
CPU ranks with ``starverse train``, exported with ``starverse export``, loaded with ``from_pretrained``: its loss on
the training text is lower than the base model's. Plus the run's logs, ``starverse runs``, and the bad inputs."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest
import torch

from helpers import CLI, CORPUS, new_user_env, save_tiny_pretrained

pytestmark = pytest.mark.slow


def _loss(model: torch.nn.Module, tok, text: str) -> float:
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)[:120]])
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


def _run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=400)


def test_lora_fine_tune_export_and_reload(tmp_path: Path):
    base = tmp_path / "tiny-llama"
    save_tiny_pretrained(base)
    (tmp_path / "corpus.txt").write_text(CORPUS)
    job = {
        "model": "tiny-llama", "dataset": "corpus.txt", "run_dir": "runs/lora",
        "train": {"steps": 12, "seq_len": 32, "global_batch": 4, "micro_batch": 1, "lr": 0.02, "mode": "lora",
                  "lora_rank": 4, "eval_fraction": 0.2, "eval_every": 6},
        "devices": {"cpu_ranks": 2}, "checkpoint": {"interval_steps": 6, "async_save": False},
    }
    (tmp_path / "job.yaml").write_text(json.dumps(job))
    env = new_user_env(tmp_path)
    with socket.socket() as s:  # a free port to fix the exporter at (--metrics-port)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = _run(["train", "job.yaml", "--json", "--metrics-port", str(port)], env, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    run = tmp_path / "runs" / "lora"
    assert result["final_step"] == 12
    assert result["metrics_url"].startswith(f"http://127.0.0.1:{port}")
    assert json.loads((run / "metrics.json").read_text())["port"] == port
    assert "step 12/12" in out.stderr  # plain progress lines when not on a terminal

    # the run's logs: one line per step and the events, TensorBoard files, the held-out evaluation
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["type"] == "step"] == list(range(1, 13))
    events = [r for r in rows if r["type"] == "event"]
    assert [e["event"] for e in events if e["event"] in ("start", "end")] == ["start", "end"]
    start = events[0]
    assert start["mode"] == "lora" and 0 < start["trainable_params"] < 0.2 * start["params"]
    evals = [e for e in events if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [6, 12] and evals[-1]["loss"] < evals[0]["loss"] + 1.0
    assert any(e["event"] == "checkpoint" for e in events)
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))

    # checkpoints hold the adapters (and their optimizer state) only; the manifest names the base
    ckpts = sorted((run / "checkpoints").glob("step-*"))
    assert ckpts
    import torch.distributed.checkpoint as dcp

    saved = list(dcp.FileSystemReader(str(ckpts[-1])).read_metadata().state_dict_metadata)
    model_keys = [k for k in saved if k.startswith("model.")]
    optim_keys = [k for k in saved if k.startswith("optim.state.")]
    assert model_keys and all(".lora_" in k for k in model_keys), model_keys
    assert optim_keys and all(".lora_" in k for k in optim_keys), optim_keys
    assert json.loads((ckpts[-1] / "starverse.json").read_text())["model"]["name"] == str(base.resolve())

    listed = _run(["runs", "runs", "--json"], env, tmp_path)
    assert listed.returncode == 0, listed.stderr
    (row,) = json.loads(listed.stdout)
    assert row["status"] == "finished" and row["steps"] == 12 and row["mode"] == "lora"
    assert row["cost"] == "0 USD"  # from the run's ledger: this machine's own CPUs are free
    assert row["eval_loss"] == pytest.approx(evals[-1]["loss"])

    exported = _run(["export", "runs/lora", "--out", "exported", "--merge-lora"], env, tmp_path)
    assert exported.returncode == 0, exported.stderr
    assert "LoRA merged" in exported.stdout and "tokenizer included" in exported.stdout

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tuned = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    tok = AutoTokenizer.from_pretrained(tmp_path / "exported")
    before = AutoModelForCausalLM.from_pretrained(base)
    assert _loss(tuned, tok, CORPUS) < _loss(before, tok, CORPUS) - 0.1
    prompt = torch.tensor([tok.encode("the quick brown", add_special_tokens=False)])
    generated = tuned.generate(prompt, max_new_tokens=6, do_sample=False)
    assert generated.shape[1] > prompt.shape[1] and tok.decode(generated[0]).startswith("the quick brown")


def test_qlora_without_4bit_is_one_line_and_exit_2(tmp_path: Path):
    """The other bad inputs (no config, mismatched weights or tokenizer) raise the same way: tests/unit/test_finetune.py."""
    save_tiny_pretrained(tmp_path / "tiny-llama")
    (tmp_path / "corpus.txt").write_text(CORPUS)
    (tmp_path / "q.yaml").write_text(json.dumps({"model": "tiny-llama", "dataset": "corpus.txt",
                                                 "train": {"mode": "qlora"}, "devices": {"cpu_ranks": 1}}))
    out = _run(["train", "q.yaml"], new_user_env(tmp_path), tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "q.yaml: train.mode: qlora needs 4-bit base weights, not available here: 1 of the 1 ranks are not CUDA" \
        in lines[0] and "mode: lora" in lines[0]
