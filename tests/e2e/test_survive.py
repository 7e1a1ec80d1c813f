"""Processes and exposure of `starverse train` (issue 15): ranks never outlive their supervisor, one supervisor
per run directory, nothing listens beyond 127.0.0.1, SIGTERM -> emergency checkpoint -> exit 3 with both
launchers, a `notice_url` that announces a preemption, and kill trials that resume with the uninterrupted loss."""

from __future__ import annotations

import http.server
import ipaddress
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from helpers import CLI, RAY_GROUP, TINY
from starverse.checkpoint.store import CheckpointStore
from starverse.elastic.runlock import RunLock
from starverse.errors import PreemptedError
from starverse.jobs import run_job

pytestmark = pytest.mark.slow



def _loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(addr, "ipv4_mapped", None)
    return bool(addr.is_loopback or (mapped is not None and mapped.is_loopback))


def _env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(STARVERSE_CACHE=str(tmp / "cache"), STARVERSE_PROFILE="")
    env.pop("STARVERSE_CATALOG", None)
    return env


def _job(tmp: Path, steps: int, extra: str = "", checkpoint: str = "interval_steps: 4, keep_last: 3",
         launcher: str = "local") -> Path:
    (tmp / "tiny.json").write_text(json.dumps(TINY))
    (tmp / "corpus.txt").write_text(Path(os.__file__).read_text()[:40000])
    job = tmp / "job.yaml"
    job.write_text(
        "model: tiny.json\ndataset: corpus.txt\nrun_dir: run\n"
        f"train: {{steps: {steps}, seq_len: 32, global_batch: 8, micro_batch: 2, rebalance_every: 0}}\n"
        f"devices: {{cpu_ranks: 2, launcher: {launcher}}}\ncheckpoint: {{{checkpoint}}}\n" + extra
    )
    return job


def _start(tmp: Path, job: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([*CLI, "train", str(job)], cwd=tmp, env=_env(tmp), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_step(proc: subprocess.Popen[str], tmp: Path, step: int, timeout_s: float = 240) -> int:
    progress = tmp / "run" / "progress.json"
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.communicate()
        if progress.is_file():
            try:
                seen = int(json.loads(progress.read_text())["step"])
            except (ValueError, KeyError):
                seen = -1
            if seen >= step:
                return seen
        assert time.monotonic() < deadline, "training did not reach the step"
        time.sleep(0.1)


def _descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def _gone_within(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    return [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def _listening(procs: list[psutil.Process]) -> list[tuple[int, str, int]]:
    out = []
    for p in procs:
        try:
            conns = p.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        out += [(p.pid, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return out


def _bill_check(tmp: Path) -> None:
    out = subprocess.run([*CLI, "bill", "run", "--check"], cwd=tmp, env=_env(tmp), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def _train_json(tmp: Path, job: Path) -> dict:
    out = subprocess.run([*CLI, "train", str(job), "--json"], cwd=tmp, env=_env(tmp), capture_output=True,
                         text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


@pytest.mark.timeout(1200)
def test_kill_trials_resume_with_the_uninterrupted_loss_and_leave_no_process(tmp_path):
    """SIGKILL of the supervisor alone, then of supervisor and ranks together (the rank-alone and during-a-
    checkpoint-write trials are tests/dist/test_elastic_recovery.py's): each rerun resumes from the last committed
    checkpoint, no process is left, the ledger checks, and the final loss is the uninterrupted run's. 120 steps: ranks
    forked from a warm fork server start in well under a second, and a run of 30 tiny steps could end before the
    test's poll saw the step it kills at."""
    steps = 120
    (tmp_path / "ref").mkdir()
    reference = _train_json(tmp_path / "ref", _job(tmp_path / "ref", steps))
    assert reference["final_step"] == steps
    job = _job(tmp_path, steps)

    # 1. the supervisor alone: its ranks die with it
    proc = _start(tmp_path, job)
    _wait_step(proc, tmp_path, 3)
    tree = [psutil.Process(proc.pid), *_descendants(proc.pid)]
    ranks = tree[1:]
    assert len(ranks) >= 2
    # every listening socket of the job (the rendezvous store, gloo, the metrics endpoint) is on the loopback
    listening = _listening(tree)
    assert listening and [x for x in listening if not _loopback(x[1])] == [], listening
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    assert not _gone_within(ranks, 5.0), "rank processes outlived their supervisor"

    # 2. the rerun, killed with its ranks at once (the whole session)
    proc = _start(tmp_path, job)
    first = _wait_step(proc, tmp_path, 1)
    _wait_step(proc, tmp_path, max(first + 2, 10))  # past a committed checkpoint (every 4 steps), whatever trial 1 left
    tree = [psutil.Process(proc.pid), *_descendants(proc.pid)]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    assert not _gone_within(tree, 5.0)

    # 3. the last rerun resumes from the last committed checkpoint and ends with the uninterrupted loss
    res = _train_json(tmp_path, job)
    assert res["final_step"] == steps
    resumed = res["attempts"][0]["resumed_from"]
    assert resumed is not None and resumed % 4 == 0 and resumed > 0
    torch.testing.assert_close(res["final_loss"], reference["final_loss"], rtol=1e-5, atol=1e-6)
    _bill_check(tmp_path)


def test_a_second_supervisor_on_a_live_run_dir_is_refused_naming_the_holder(tmp_path):
    job = _job(tmp_path, 4)
    with RunLock(tmp_path / "run"):
        out = subprocess.run([*CLI, "train", str(job)], cwd=tmp_path, env=_env(tmp_path), capture_output=True,
                             text=True, timeout=240)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith(f"error: {tmp_path / 'run'}: run directory in use by another supervisor: pid "
                                 f"{os.getpid()} on ")
    assert "To fix: wait for it to end, stop it (`kill -TERM " in out.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()  # refused before anything was written


@pytest.mark.timeout(600)
@pytest.mark.xdist_group(RAY_GROUP)
def test_sigterm_under_ray_writes_an_emergency_checkpoint_and_exits_3(tmp_path):
    # (the local launcher's SIGTERM -> exit 3 is tests/e2e/test_recovery.py's first test)
    job = _job(tmp_path, 100_000, checkpoint="interval_steps: 1000", launcher="ray")
    proc = _start(tmp_path, job)
    _wait_step(proc, tmp_path, 3, timeout_s=300)
    tree = _descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 3, stderr[-3000:]
    assert "error: job preempted (SIGTERM) after 1 attempt(s); last checkpoint step-" in stderr
    listing = subprocess.run([*CLI, "checkpoints", "list", "run", "--json"], cwd=tmp_path, env=_env(tmp_path),
                             capture_output=True, text=True, timeout=60)
    last = json.loads(listing.stdout)["checkpoints"][-1]
    stopped = json.loads((tmp_path / "run" / "progress.json").read_text())["step"]
    assert last["reason"] == "notice" and last["step"] == stopped
    # nothing the job started is left: ranks, Ray workers and Ray's daemons
    assert not _gone_within(tree, 15.0), [p.cmdline()[:3] for p in tree if p.is_running()]
    _bill_check(tmp_path)


class _Metadata(http.server.BaseHTTPRequestHandler):
    """A metadata endpoint on 127.0.0.1: 404 until the test announces the preemption, then 200."""

    preempted = threading.Event()

    def do_GET(self) -> None:
        code = 200 if self.preempted.is_set() else 404
        self.send_response(code)
        self.end_headers()
        self.wfile.write(b'{"action": "terminate"}' if code == 200 else b"")

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.timeout(600)
def test_notice_url_announcing_a_preemption_stops_every_rank_with_an_emergency_checkpoint(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metadata)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Metadata.preempted.clear()
    url = f"http://127.0.0.1:{server.server_address[1]}/spot/instance-action"
    job = _job(tmp_path, 100_000, checkpoint=f"interval_steps: 1000, notice_url: '{url}', notice_poll_s: 0.2")

    def announce(progress) -> None:
        if progress.step >= 3:
            _Metadata.preempted.set()

    try:
        with pytest.raises(PreemptedError, match=r"every device got a notice"):
            run_job(job, on_progress=announce)
    finally:
        server.shutdown()
    last = CheckpointStore(tmp_path / "run" / "checkpoints").latest()
    assert last is not None and last.reason == "notice" and last.step >= 3
    assert sorted(p.name for p in (tmp_path / "run" / "notices").glob("rank-*.json")) == ["rank-0.json", "rank-1.json"]
    assert json.loads((tmp_path / "run" / "notices" / "rank-0.json").read_text())["source"] == url


def test_run_lock_names_its_holder_and_is_released(tmp_path):
    with RunLock(tmp_path) as lock:
        holder = json.loads(lock.path.read_text())
        assert holder["pid"] == os.getpid()
    with RunLock(tmp_path):  # released: taken again at once
        pass


@pytest.mark.timeout(600)
@pytest.mark.xdist_group(RAY_GROUP)
def test_ray_supervisor_killed_alone_leaves_no_actor_and_no_ray_daemon(tmp_path):
    job = _job(tmp_path, 100_000, checkpoint="interval_steps: 1000", launcher="ray")
    proc = _start(tmp_path, job)
    _wait_step(proc, tmp_path, 2, timeout_s=300)
    tree = _descendants(proc.pid)  # the private Ray session's daemons and the rank actors' workers
    assert any("raylet" in " ".join(p.cmdline()) for p in tree), [p.cmdline()[:2] for p in tree]
    listening = _listening([psutil.Process(proc.pid), *tree])
    assert listening and [x for x in listening if not _loopback(x[1])] == [], listening
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    left = _gone_within(tree, 15.0)
    assert not left, [(p.pid, p.cmdline()[:3]) for p in left]
