"""The runtime commands as a user runs them: `starverse demo`, `starverse probe`, and a user's unguarded script."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _user_env(tmp_path):
    """What a new user under ``tmp_path`` runs with, over this environment."""
    return {"STARVERSE_CACHE": str(tmp_path / "cache"), "MASTER_ADDR": "127.0.0.1", "COLUMNS": "200",
            "HOME": str(tmp_path)}


def _run(args, tmp_path, timeout=600, extra_env=None, **kw):
    env = {**os.environ, **_user_env(tmp_path), **(extra_env or {})}
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path, **kw)


def test_demo_trains_a_scaled_llama_and_prints_the_summary(tmp_path):
    out = _run([sys.executable, "-m", "starverse.cli", "demo", "--steps", "30", "--corpus-mb", "0.3",
                "--run-dir", str(tmp_path / "run")], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    # Honest about the model: Llama-2-7B does not fit here, a same-family copy is trained instead.
    assert "cannot be trained here" in text and "scaled-down copy of the same architecture" in text
    assert "llama: 2 layers, hidden 128" in text
    m = re.search(r"steps 30, final loss ([0-9.]+)", text)
    assert m, text
    assert float(m.group(1)) < 7.5  # from ~ln(8192) = 9.0 at the start: it learned
    assert re.search(r"rank 0 cpu: share \d+/8 micro-batches", text)
    assert re.search(r"rank 1 cpu: share \d+/8 micro-batches", text)
    assert (tmp_path / "run" / "final_model.pt").is_file()
    # No profile of this machine yet (fresh HOME): the demo measures it first and plans on measured figures.
    profile = json.loads((tmp_path / "run" / "profile.json").read_text())
    assert profile["accelerators"]["cpu"]["fp32_tflops"] > 0
    assert re.search(r"cost model: predicted step [0-9.]+ s vs measured [0-9.]+ s \([+-]\d+%; probe profile ", text)


def test_probe_writes_a_profile_the_catalog_reads(tmp_path):
    prof = tmp_path / "profile.json"
    out = _run([sys.executable, "-m", "starverse.cli", "probe", "--quick", "--out", str(prof)], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads(prof.read_text())
    assert data["version"] == 1
    cpu = data["accelerators"]["cpu"]
    assert set(cpu) == {"fp32_tflops", "bf16_tflops", "memory_bw_gb_per_s", "memory_gb", "intra_node_gb_per_s"}
    assert all(v > 0 for v in cpu.values())
    from starverse.catalog import load_catalog

    acc = load_catalog(profile=prof).accelerator("cpu")
    assert acc.fp32_tflops == cpu["fp32_tflops"]
    assert f"profile written to {prof}" in out.stdout.replace("\n", "")


def test_unguarded_user_script_runs_the_brief_code_once(tmp_path):
    """The product brief's lines, in a script without `if __name__ == "__main__"` (spawn must not re-run it)."""
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 300)
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import starverse
        print("SCRIPT START")
        cluster = starverse.accelerate(model_id=None, policy="cost-performance", max_budget=28, seq_len=32)
        with cluster.mixed_mesh():
            model = starverse.build_model(cluster.model_config)
        trainer = starverse.Trainer(cluster, run_dir="run")
        result = trainer.fit(model, dataset="texts", per_device_batch_size=4, max_steps=3, tokenizer="bytes")
        print("STEPS", result.steps, "TOKENS", result.tokens_total)
    """))
    out = _run([sys.executable, str(script)], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("SCRIPT START") == 1
    assert "STEPS 3 TOKENS 1536" in out.stdout  # 3 steps x 16 sequences x 32 tokens


@pytest.mark.parametrize(("args", "line", "in_process"), [
    (("--batch", "0"), "error: --batch: must be at least 1 (got 0). To fix: pass --batch 1 or more", False),
    (("--global-batch", "16", "--batch", "3"),
     "error: --global-batch 16 is not a multiple of --batch 3. To fix: choose a --batch that divides --global-batch",
     True),
], ids=["batch-0-process", "not-a-multiple-in-process"])
def test_demo_bad_arguments_are_refused_before_the_probe(tmp_path, monkeypatch, capsys, args, line, in_process):
    """A fresh HOME has no profile of this machine, so a demo that got as far as planning would probe it first
    (``probe: ...`` on stdout, ``<run dir>/profile.json``): bad options are refused before, as one line, exit 2.
    The first case as a process of its own (what a user sees), the second in this process (``starverse.cli.main``
    with the same environment): a demo process imports torch (seconds of CPU) before it refuses."""
    run = tmp_path / "run"
    argv = ["demo", *args, "--steps", "1", "--corpus-mb", "0.05", "--run-dir", str(run)]
    if in_process:
        from starverse.cli import main

        monkeypatch.chdir(tmp_path)
        for k, v in _user_env(tmp_path).items():
            monkeypatch.setenv(k, v)
        code = main(argv)
        captured = capsys.readouterr()
        stdout, stderr = captured.out, captured.err
    else:
        out = _run([sys.executable, "-m", "starverse.cli", *argv], tmp_path)
        code, stdout, stderr = out.returncode, out.stdout, out.stderr
    assert code == 2, stderr[-3000:]
    assert stderr.strip().splitlines() == [line]
    assert "probe" not in stdout
    assert not run.exists()  # neither the run dir nor its probe profile was written
