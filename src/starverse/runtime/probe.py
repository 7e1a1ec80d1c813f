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
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from starverse.errors import ConfigError
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
        return write_json(self.profile(), path)


def probe(ranks: list[RankSpec] | None = None, *, quick: bool = False, timeout_s: float = 300.0) -> ProbeResult:
    """Measure the local devices (one process per rank, as training runs them)."""
    from starverse.runtime.devices import local_ranks

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


# --- model profiles (``starverse probe --model M --plan P``) ------------------------------------------

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_HEAD_DIM_FAMILIES = frozenset({"llama", "mistral", "mixtral", "qwen2"})
"""Families whose HF config takes ``head_dim``, so one TP shard of a layer can be built as a layer with
``heads / tp`` heads of the same width."""


def _shard_config(cfg: dict[str, Any], layers: int, tp: int, seq_len: int) -> dict[str, Any]:
    """``cfg`` at ``layers`` depth, one TP shard wide (heads, KV heads and MLP width divided by ``tp``)."""
    from starverse.runtime.modeling import _ALIASES, _get

    out = dict(cfg)
    for key in _ALIASES["layers"]:
        if key in out:
            out[key] = layers
    pkey, positions = _get(out, "positions")
    if pkey is not None and int(positions) < seq_len:
        out[pkey] = seq_len
    if tp == 1:
        return out
    if out.get("model_type") not in _HEAD_DIM_FAMILIES:
        raise ConfigError(f"probe: tp={tp} needs a model family whose layers can be built as one TP shard "
                          f"({', '.join(sorted(_HEAD_DIM_FAMILIES))}); got {out.get('model_type')!r}; probe tp 1")
    hkey, hidden = _get(out, "hidden")
    qkey, heads = _get(out, "heads")
    kvkey, kv = _get(out, "kv_heads")
    fkey, ffn = _get(out, "ffn")
    out["head_dim"] = int(out.get("head_dim") or int(hidden) // int(heads))
    assert qkey is not None and fkey is not None and hkey is not None
    out[qkey] = int(heads) // tp
    if kvkey is not None:
        out[kvkey] = max(int(kv) // tp, 1)
    out[fkey] = int(ffn) // tp
    return out


def _fwd_bwd_s(cfg: dict[str, Any], micro_batch: int, seq_len: int, dtype: torch.dtype, device: torch.device,
               repeats: int, clock: Callable[[], float] = time.perf_counter) -> tuple[float, float]:
    """Forward and backward time (median of ``repeats``) of one training micro-batch of the model ``cfg`` (loss included)."""
    from starverse.runtime.modeling import build_model

    model = build_model(cfg, dtype=dtype).to(device)
    model.train()
    vocab = int(cfg["vocab_size"])
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (micro_batch, seq_len), generator=gen).to(device)
    fwd: list[float] = []
    bwd: list[float] = []
    for i in range(repeats + 2):  # two warm-up iterations
        _sync(device)
        t0 = clock()
        loss = model(input_ids=ids, labels=ids).loss
        _sync(device)
        t1 = clock()
        loss.backward()
        _sync(device)
        t2 = clock()
        model.zero_grad(set_to_none=True)
        if i >= 2:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    # medians: a step is a sum of micro-batches, whose typical (not best) times add up to the step's
    return float(torch.tensor(fwd).median()), float(torch.tensor(bwd).median())


def profile_entry(cfg: dict[str, Any], micro_batch: int, seq_len: int, tp: int, precision: str,
                  device: torch.device, repeats: int = 5, depths: tuple[int, int] = (1, 3),
                  clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """Measure one profile entry: the model built at two depths; the difference per added layer is one
    layer's time, what remains at the shallow depth is the embedding, head and loss."""
    lo, hi = depths
    f_lo, b_lo = _fwd_bwd_s(_shard_config(cfg, lo, tp, seq_len), micro_batch, seq_len, _DTYPES[precision], device,
                            repeats, clock)
    f_hi, b_hi = _fwd_bwd_s(_shard_config(cfg, hi, tp, seq_len), micro_batch, seq_len, _DTYPES[precision], device,
                            repeats, clock)
    # timing noise can make a difference negative on tiny layers; a measured time is never below 1 us
    layer_f = max((f_hi - f_lo) / (hi - lo), 1e-6)
    layer_b = max((b_hi - b_lo) / (hi - lo), 1e-6)
    return {"micro_batch": micro_batch, "seq_len": seq_len, "tp": tp, "precision": precision,
            "layer_forward_s": layer_f, "layer_backward_s": layer_b,
            "head_forward_s": max(f_lo - lo * layer_f, 1e-6), "head_backward_s": max(b_lo - lo * layer_b, 1e-6)}


def optimizer_s_per_param(device: torch.device, num_params: int = 4_000_000, repeats: int = 5,
                          clock: Callable[[], float] = time.perf_counter) -> float:
    """Median AdamW step over ``num_params`` fp32 parameters with gradients, per parameter."""
    params = [torch.nn.Parameter(torch.randn(num_params // 4, device=device)) for _ in range(4)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4)
    times = []
    for i in range(repeats + 1):
        _sync(device)
        t0 = clock()
        opt.step()
        _sync(device)
        if i:  # the first step allocates the moments
            times.append(clock() - t0)
    return float(torch.tensor(times).median()) / num_params


def probe_model(plan: Any, spec: Any, accelerator: str, device: str = "cpu", *, repeats: int = 5,
                links_gb_per_s: dict[str, float] | None = None,
                clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """The profile document (format: :mod:`starverse.costmodel.profile`) of ``spec`` on this device kind,
    with one entry per (micro-batch, sequence length, TP) of the plan's stages on ``accelerator`` (a stage
    without a fixed micro-batch is measured at 1). ``clock`` times every measurement: the wall clock by default;
    a check on a shared CPU may pass ``time.process_time`` (CPU time of this process, which other processes'
    load does not stretch) when it times the steps it compares with the same clock."""
    from starverse.costmodel.profile import PROFILE_FORMAT, PROFILE_VERSION, shape_key
    from starverse.costmodel.shapes import ModelShape
    from starverse.runtime.modeling import hf_config_dict

    settings = sorted({(g.micro_batch or 1, st.tp) for g in plan.groups for st in g.stages
                       if st.accelerator == accelerator})
    if not settings:
        raise ConfigError(f"probe: the plan has no stage on '{accelerator}' (this machine's device kind); "
                          "probe with a plan that uses it")
    if plan.train.precision not in _DTYPES:
        raise ConfigError(f"probe: train.precision '{plan.train.precision}' is not measured; probe with one of "
                          f"{', '.join(_DTYPES)}")
    cfg = hf_config_dict(spec)
    dev = torch.device(device)
    entries = [profile_entry(cfg, mb, plan.train.seq_len, tp, plan.train.precision, dev, repeats, clock=clock)
               for mb, tp in settings]
    return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "accelerator": accelerator,
            "host": socket.gethostname(), "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "model": shape_key(ModelShape.from_spec(spec)), "entries": entries,
            "links_gb_per_s": dict(links_gb_per_s or {}), "optimizer_s_per_param": optimizer_s_per_param(dev, clock=clock)}


def write_json(doc: dict[str, Any], path: str | Path) -> Path:
    """Write a JSON document atomically; returns the path."""
    p = Path(path).expanduser()
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(p)
    return p
