"""Job start-up benchmark: the CPU of a tiny ``starverse train`` with the fork server forked from the supervisor
(a "zygote", the default on Linux) against the freshly exec'd server (``STARVERSE_START_METHOD=forkserver-exec``).

Prints ONE JSON object. Each round runs, in ABBA order, one ``starverse train`` per method of a job that barely
trains (2 CPU ranks, a one-layer model of 30k parameters, 4 steps, as the e2e tests run it): what the test suite
pays per job is almost all start-up. CPU counted, all processes: the CLI with every child it reaped (``wait4``'s
rusage, what ``/usr/bin/time`` prints), plus the fork server with the ranks it reaped, read from ``/proc`` just
before the CLI exits (the server exits after the CLI, so no rusage holds it). Wall time is the CLI's.

Figures: ``zygote_cpu_vs_exec`` and ``zygote_wall_vs_exec`` (per-round ratios, median and spread), each side's
CPU and wall in seconds, and the server's own share. ``BENCH_ROUNDS`` (default 4) sets the rounds.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import Report, paired_ratio, spread

HERE = Path(__file__).resolve().parent
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "4"))
METHODS = {"zygote": "forkserver", "exec": "forkserver-exec"}
TINY = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 320, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "hidden_act": "silu"}
JOB = ("model: tiny.json\ndataset: corpus.txt\nrun_dir: run\n"
       "train: {steps: 4, seq_len: 32, global_batch: 8, micro_batch: 2, rebalance_every: 0}\n"
       "devices: {cpu_ranks: 2}\ncheckpoint: {interval_steps: 1000}\n")


def _cpu_of(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and of its reaped children (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def child(out: str) -> int:
    """The CLI, in this process: ``starverse train job.yaml --json``; writes to ``out`` whether the job's server was
    forked from it and the CPU of a server still running (an exec'd one: the CLI never reaps it; a forked one is
    stopped and reaped at the job's end, its CPU and its ranks' are in the CLI's rusage)."""
    from multiprocessing import forkserver

    from starverse.cli import main as cli
    from starverse.providers import forkserver_zygote

    forked: list[int | None] = []
    fork_server = forkserver_zygote.fork_server

    def recorded(modules: Any) -> int | None:
        forked.append(fork_server(modules))
        return forked[-1]

    forkserver_zygote.fork_server = recorded  # type: ignore[assignment]
    sys.argv = ["starverse", "train", "job.yaml", "--json"]
    code = 1
    try:
        code = cli()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
        Path(out).write_text(json.dumps({"forked": forked, "server_cpu_s": _cpu_of(pid) if pid is not None else 0.0}))
    return code


def _job_dir(root: Path) -> Path:
    root.mkdir()
    (root / "tiny.json").write_text(json.dumps(TINY))
    (root / "corpus.txt").write_text(Path(os.__file__).read_text()[:30000])
    (root / "job.yaml").write_text(JOB)
    return root


def _run(method: str, tmp: Path, n: int) -> dict[str, float]:
    work = _job_dir(tmp / f"{method}{n}")
    out = work / "server.json"
    env = {**os.environ, "STARVERSE_START_METHOD": METHODS[method],
           "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")])}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", str(out)], cwd=work, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stdout, stderr = proc.communicate(timeout=600)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{method}: starverse train exited {proc.returncode}: {stderr.decode()[-2000:]}")
    res = json.loads(stdout.decode())
    assert res["final_step"] == 4, res
    server = json.loads(out.read_text())
    if (method == "zygote") != (len(server["forked"]) == 1 and server["forked"][0] is not None):
        raise RuntimeError(f"{method}: the job's fork server was not the expected kind (forked: {server['forked']})")
    return {"wall_s": wall, "server_cpu_s": float(server["server_cpu_s"])}


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main() -> None:
    report = Report()
    samples: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
    with report.part("jobstart"), tempfile.TemporaryDirectory() as tmp:
        for r in range(ROUNDS):
            for method in METHODS if r % 2 == 0 else reversed(list(METHODS)):
                before = _children_cpu()
                s = _run(method, Path(tmp), r)
                s["cli_cpu_s"] = _children_cpu() - before  # the CLI and what it reaped (one child ran since)
                s["cpu_s"] = s["cli_cpu_s"] + s["server_cpu_s"]
                samples[method].append(s)
        for name in ("cpu_s", "wall_s"):
            per = {m: [s[name] for s in samples[m]] for m in METHODS}
            report.figure(f"zygote_{name.removesuffix('_s')}_vs_exec", paired_ratio(per["zygote"], per["exec"]))
            for m in METHODS:
                report.figure(f"{m}_{name}", spread(per[m]))
        for m in METHODS:
            report.figure(f"{m}_server_cpu_s", spread([s["server_cpu_s"] for s in samples[m]]))
        report.figure("rounds", ROUNDS)
    report.emit()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        raise SystemExit(child(sys.argv[2]))
    main()
