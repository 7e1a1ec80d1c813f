"""``starverse probe``: measure this machine's devices and write the profile the catalog reads.

Measured per rank *as training runs it*: a CPU rank gets ``cores / num_cpu_ranks`` threads, so the
``cpu`` figures are those of one CPU rank, which is what the cost model needs for a plan of CPU ranks.
Figures: dense matmul TFLOPS per precision, memory bandwidth (a large copy), and the all-reduce bus
bandwidth between the local ranks (gloo for CPU, NCCL for GPUs) as ``intra_node_gb_per_s``.
Profile format (read by ``starverse.catalog.load_catalog``)::

    {"version": 1, "host": "...", "measured_at": "...", "accelerators": {"cpu": {"fp32_tflops": ...}}}
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from starverse.runtime.launch import RankEnv, RankSpec, launch

log = logging.getLogger(__name__)


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int = 1024, min_s: float = 0.3) -> float:
    """Dense ``n×n @ n×n`` matmul throughput in TFLOPS (2n³ FLOPs each), after a warm-up."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    for _ in range(2):
        torch.mm(a, b)
    _sync(device)
    iters = 0
    t0 = time.perf_counter()
    while True:
        torch.mm(a, b)
        iters += 1
        if iters % 4 == 0:
            _sync(device)
            if time.perf_counter() - t0 >= min_s:
                break
    dt = time.perf_counter() - t0
    return 2.0 * n**3 * iters / dt / 1e12


def memory_bw_gb_per_s(device: torch.device, mb: int = 256, min_s: float = 0.3) -> float:
    """Copy bandwidth in GB/s (read + write of a ``mb`` MiB buffer per copy)."""
    numel = mb * 2**20 // 4
    src = torch.ones(numel, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    iters = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < min_s or iters < 2:
        dst.copy_(src)
        iters += 1
        _sync(device)
    dt = time.perf_counter() - t0
    return 2.0 * numel * 4 * iters / dt / 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allreduce_rank(env: RankEnv, mb: int, iters: int) -> float:
    """Bus bandwidth (GB/s) of all-reducing an ``mb`` MiB buffer over all ranks (ring-equivalent bytes)."""
    import torch.distributed as dist

    device = torch.device(env.spec.device)
    t = torch.ones(mb * 2**20 // 4, device=device)
    dist.all_reduce(t)
    _sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t)
    _sync(device)
    dt = (time.perf_counter() - t0) / iters
    n = env.world_size
    return 2.0 * (n - 1) / n * t.numel() * 4 / dt / 1e9


def _rank_figures(env: RankEnv, quick: bool) -> dict[str, float]:
    device = torch.device(env.spec.device)
    out: dict[str, float] = {}
    n = 512 if quick else (4096 if device.type == "cuda" else 1024)
    min_s = 0.1 if quick else 0.5
    precisions = {"fp32": torch.float32, "bf16": torch.bfloat16}
    if device.type == "cuda":
        precisions["fp16"] = torch.float16
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32, as in the datasheets' dense FP32 figure
    for name, dtype in precisions.items():
        out[f"{name}_tflops"] = matmul_tflops(device, dtype, n, min_s)
    out["memory_bw_gb_per_s"] = memory_bw_gb_per_s(device, 64 if quick else 256, min_s)
    if device.type == "cuda":
        out["memory_gb"] = torch.cuda.get_device_properties(device).total_memory / 1e9
    else:
        num_cpu = sum(1 for r in env.ranks if r.device == "cpu") or 1
        out["memory_gb"] = _host_memory_gb() / num_cpu
    return out


def _probe_rank(env: RankEnv, quick: bool) -> dict[str, Any]:
    import torch.distributed as dist

    # One rank at a time measures compute (the others wait), so shared cores are not counted twice.
    figures: dict[str, float] = {}
    for r in range(env.world_size):
        if r == env.rank:
            figures = _rank_figures(env, quick)
        dist.barrier()
    if env.world_size > 1:
        figures["intra_node_gb_per_s"] = _allreduce_rank(env, 8 if quick else 64, 3 if quick else 10)
    return {"kind": env.spec.device_kind, "figures": figures}


def _host_memory_gb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError):
        return 0.0


@dataclass(frozen=True)
class ProbeResult:
    """Figures measured per device kind (medians over the ranks of the kind)."""

    host: str
    """Host name."""
    measured_at: str
    """ISO UTC time."""
    accelerators: dict[str, dict[str, float]]
    """Accelerator id -> figure name -> value."""
    num_ranks: int
    """Ranks measured."""

    def profile(self) -> dict[str, Any]:
        """The profile JSON object (format in the module docstring)."""
        return {"version": 1, "host": self.host, "measured_at": self.measured_at, "accelerators": self.accelerators}

    def write(self, path: str | Path) -> Path:
        """Write the profile atomically; returns the path."""
        p = Path(path).expanduser()
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.profile(), indent=2) + "\n")
        tmp.replace(p)
        return p


def probe(ranks: list[RankSpec] | None = None, *, quick: bool = False, timeout_s: float = 300.0) -> ProbeResult:
    """Measure the local devices (one process per rank, as training runs them)."""
    from starverse.providers.local import local_ranks

    ranks = ranks or local_ranks()
    results = launch(_probe_rank, ranks, timeout_s=timeout_s, args=(quick,))
    by_kind: dict[str, list[dict[str, float]]] = {}
    for res in results:
        by_kind.setdefault(res["kind"], []).append(res["figures"])
    accs = {}
    for kind, rows in by_kind.items():
        keys = sorted(set().union(*rows))
        accs[kind] = {k: float(torch.tensor([r[k] for r in rows if k in r]).median()) for k in keys}
    return ProbeResult(socket.gethostname(), datetime.now(UTC).isoformat(timespec="seconds"), accs, len(ranks))
