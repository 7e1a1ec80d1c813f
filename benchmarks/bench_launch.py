"""Rank start-up benchmark: a two-rank launch with the fork server (the default on Linux) against ``spawn``.

Prints ONE JSON object. Each round starts a fresh launcher process per start method (``STARVERSE_START_METHOD``),
in ABBA order, that runs ``LAUNCHES`` two-rank launches of a trivial rank function (one all-reduce) and reports:

- wall time of the first launch (the fork server starts and imports torch and the rank modules then) and the
  median of the later ones (what every further launch of that process -- a restart, the next test -- costs);
- CPU seconds per launch, everything the launches burnt: the launcher, its reaped ranks (spawn), and the fork
  server with the ranks it reaped (read from ``/proc`` before the launcher exits).

Figures: ``forkserver_*_vs_spawn`` ratios (per round, then the median with the spread of the rounds), and each
side's medians in seconds. ``BENCH_ROUNDS`` (default 2) and ``BENCH_LAUNCHES`` (default 4) set the sizes.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import Report, paired_ratio, spread

HERE = Path(__file__).resolve().parent
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "2"))
LAUNCHES = int(os.environ.get("BENCH_LAUNCHES", "4"))
METHODS = ("forkserver", "spawn")


def _sum(env: Any) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(env.rank)])
    dist.all_reduce(t)
    return float(t.item())


def _cpu_of(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and of its reaped children (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def child(launches: int) -> None:
    """One launcher process: ``launches`` two-rank launches; prints its JSON line."""
    from multiprocessing import forkserver

    from starverse.providers.local import LocalLauncher, start_method
    from starverse.runtime.launch import RankSpec

    ranks = [RankSpec(rank=r, device_kind="cpu", device="cpu", num_threads=1) for r in range(2)]
    t = os.times()
    cpu0 = t.user + t.system + t.children_user + t.children_system
    walls = []
    for _ in range(launches):
        t0 = time.perf_counter()
        assert LocalLauncher().launch(_sum, ranks, timeout_s=300) == [1.0, 1.0]
        walls.append(time.perf_counter() - t0)
    t = os.times()
    cpu = t.user + t.system + t.children_user + t.children_system - cpu0
    server = getattr(forkserver, "_forkserver", None)
    server_pid = getattr(server, "_forkserver_pid", None)
    if server_pid is not None:
        cpu += _cpu_of(server_pid)
    print(json.dumps({"method": start_method(), "walls": walls, "cpu_s": cpu}))


def _run(method: str) -> dict[str, Any]:
    env = {**os.environ, "STARVERSE_START_METHOD": method}
    out = subprocess.run([sys.executable, __file__, "--child", str(LAUNCHES)], env=env, cwd=HERE, check=True,
                         capture_output=True, text=True, timeout=900)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["method"] == method, res
    return res


def main() -> None:
    report = Report()
    samples: dict[str, list[dict[str, Any]]] = {m: [] for m in METHODS}
    with report.part("launch"):
        for r in range(ROUNDS):
            for method in METHODS if r % 2 == 0 else reversed(METHODS):
                samples[method].append(_run(method))
        first = {m: [s["walls"][0] for s in samples[m]] for m in METHODS}
        later = {m: [statistics.median(s["walls"][1:]) for s in samples[m]] for m in METHODS}
        cpu = {m: [s["cpu_s"] / LAUNCHES for s in samples[m]] for m in METHODS}
        for name, per in (("first_launch_wall", first), ("later_launch_wall", later), ("cpu_per_launch", cpu)):
            report.figure(f"forkserver_{name}_vs_spawn", paired_ratio(per["forkserver"], per["spawn"]))
            for m in METHODS:
                report.figure(f"{m}_{name}_s", spread(per[m]))
        report.figure("launches_per_process", LAUNCHES)
    report.emit()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(int(sys.argv[2]))
    else:
        main()
