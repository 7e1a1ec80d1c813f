"""`starverse train` and `starverse checkpoints list` as a user runs them: SIGTERM -> emergency checkpoint and
exit code 3, rerun -> resume with no step lost, rollback with --resume-from, and the one-line errors for bad
job files and missing, foreign or corrupted checkpoints (which are never modified)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers import CLI, TINY
from starverse.cli import main

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(STARVERSE_CACHE=str(tmp / "cache"), STARVERSE_PROFILE="")  # no probe profile: datasheet figures
    env.pop("STARVERSE_CATALOG", None)
    return env


def _job(tmp: Path, steps: int, hidden: int = 32, extra: str = "", ranks: int = 2) -> Path:
    (tmp / "tiny.json").write_text(json.dumps(TINY | {"hidden_size": hidden}))
    (tmp / "corpus.txt").write_text(Path(os.__file__).read_text()[:40000])
    job = tmp / "job.yaml"
    job.write_text(
        "model: tiny.json\ndataset: corpus.txt\nrun_dir: run\n"
        f"train: {{steps: {steps}, seq_len: 32, global_batch: 8, micro_batch: 2, rebalance_every: 0}}\n"
        f"devices: {{cpu_ranks: {ranks}}}\n"
        "checkpoint: {interval_steps: 50, keep_last: 5}\n" + extra
    )
    return job


def _run(args: list[str], tmp: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], cwd=tmp, env=_env(tmp), capture_output=True, text=True, timeout=timeout)


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file()}


def _listing(tmp: Path) -> dict:
    out = _run(["checkpoints", "list", "run", "--json"], tmp)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_sigterm_checkpoints_and_exits_3_then_rerun_resumes_and_rollback(tmp_path):
    job = _job(tmp_path, steps=100_000)
    proc = subprocess.Popen([*CLI, "train", str(job)], cwd=tmp_path, env=_env(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    progress = tmp_path / "run" / "progress.json"
    deadline = time.monotonic() + 180
    while not (progress.is_file() and json.loads(progress.read_text())["step"] >= 60):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.2)
    seen = json.loads(progress.read_text())["step"]
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 3, stderr
    lines = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith("error: job preempted (SIGTERM) after 1 attempt(s); last checkpoint step-")
    stopped = json.loads(progress.read_text())["step"]
    listing = _listing(tmp_path)
    steps = [c["step"] for c in listing["checkpoints"]]
    # The emergency checkpoint is the step training stopped at: nothing lost.
    assert steps[-1] == stopped >= seen and listing["checkpoints"][-1]["reason"] == "notice"
    assert 50 in steps

    # Rerun (fewer total steps so it ends soon, on one rank: resharded 2 -> 1): resumes from the notice
    # checkpoint.
    job = _job(tmp_path, steps=stopped + 3, ranks=1)
    out = _run(["train", str(job), "--json"], tmp_path)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert f"resuming from step-{stopped}" in out.stderr
    assert res["final_step"] == stopped + 3 and res["lost_steps"] == 0
    assert res["attempts"][0]["resumed_from"] == stopped

    # Rollback: resume from step 50; the newer checkpoints are moved aside, not deleted.
    out = _run(["train", str(job), "--resume-from", "50", "--json"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["attempts"][0]["resumed_from"] == 50
    listing = _listing(tmp_path)
    assert [c["step"] for c in listing["checkpoints"]][-1] == stopped + 3
    (aside,) = listing["rolled_back"]
    assert (tmp_path / "run" / "checkpoints" / aside / f"step-{stopped + 3}").is_dir()

    # Bad input never touches the checkpoints: missing step, other model, corrupted file.
    before = _tree(tmp_path / "run" / "checkpoints")
    out = _run(["train", str(job), "--resume-from", "7"], tmp_path)
    assert out.returncode == 2 and out.stderr.startswith("error: ") and out.stderr.count("\n") == 1
    assert "no checkpoint for step 7; complete checkpoints: 50," in out.stderr
    other = _job(tmp_path, steps=10, hidden=64)
    out = _run(["train", str(other)], tmp_path)
    assert out.returncode == 2 and "written for a different model" in out.stderr and out.stderr.count("\n") == 1
    _job(tmp_path, steps=10, ranks=1)
    data = next((tmp_path / "run" / "checkpoints" / "step-50").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0x1
    data.write_bytes(bytes(raw))
    corrupted = _tree(tmp_path / "run" / "checkpoints")
    out = _run(["train", str(job), "--resume-from", "50"], tmp_path)
    assert out.returncode == 2 and "checksum mismatch (corrupted checkpoint)" in out.stderr
    assert _tree(tmp_path / "run" / "checkpoints") == corrupted
    assert set(corrupted) == set(before)
    out = _run(["checkpoints", "list", "run", "--verify"], tmp_path)
    assert out.returncode == 1 and "CORRUPTED" in out.stdout


def test_job_file_and_checkpoint_dir_errors_are_one_line(tmp_path, monkeypatch, capsys):
    """Run in this process (``starverse.cli.main``, as tests/e2e/test_bad_input_cli.py runs the CLI): each
    ``starverse train`` process imports torch (seconds of CPU) before it reads the job file. That a process of
    its own prints one such line and exits 2 is what the bad-input runs of the SIGTERM test above check."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("STARVERSE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("STARVERSE_PROFILE", "")  # no probe profile: datasheet figures
    monkeypatch.delenv("STARVERSE_CATALOG", raising=False)

    def cli(*args: str) -> tuple[int, str]:
        code = main(list(args))
        return code, capsys.readouterr().err

    job = _job(tmp_path, steps=10, extra="max_restart: 2\n")
    code, err = cli("train", str(job))
    assert code == 2
    assert err.strip() == f"error: {job}:7: max_restart: unknown field; did you mean 'max_restarts'?"
    job.write_text(job.read_text().replace("max_restart: 2\n", "").replace("micro_batch: 2", "micro_batch: 3"))
    code, err = cli("train", str(job))
    assert "train.global_batch: 8 is not a multiple of train.micro_batch 3" in err and code == 2
    assert err.count("\n") == 1, err
    code, err = cli("checkpoints", "list", "nowhere")
    assert code == 2 and err.strip().startswith("error: nowhere: no such checkpoint directory")
    (tmp_path / "foreign" / "step-3").mkdir(parents=True)
    (tmp_path / "foreign" / "step-3" / "pytorch_model.bin").write_bytes(b"\0" * 64)
    code, err = cli("checkpoints", "list", "foreign")
    assert code == 2 and "no valid Starverse manifest (foreign or corrupted)" in err and err.count("\n") == 1
    assert (tmp_path / "foreign" / "step-3" / "pytorch_model.bin").read_bytes() == b"\0" * 64
