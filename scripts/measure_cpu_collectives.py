"""Measure what collectives between local CPU ranks cost (gloo, one thread per rank, 127.0.0.1). Prints ONE JSON.

The source of the cost model's CPU collective figures (``costmodel.constants.CPU_COLLECTIVE_LATENCY_S`` and
``CPU_DTENSOR_COLLECTIVE_S``, the catalog's ``cpu`` ``intra_node_gb_per_s``):

- ``allreduce_latency_s``: median time of an 8-byte all-reduce between 2 ranks (per-call latency of gloo
  between two processes of one host).
- ``allreduce_bus_gb_per_s``: bus bandwidth of a 16 MB all-reduce between 2 ranks, ``2 (n-1)/n x bytes / time``
  (what ``costmodel.comm.ring_allreduce_s`` divides by).
- ``tp_collective_s``: what one tensor-parallel all-reduce costs as the runtime runs it (DTensor
  ``parallelize_module`` + gloo): the fwd+bwd time of the benchmark model (``benchmarks/bench_parallel.py``'s
  llama, 8 layers) on one micro-batch under TP 2, minus half the time of the same micro-batch unsharded on one
  rank (TP 2's ideal compute), divided by the all-reduces the cost model counts (4 per layer + 2).
- ``zero3_collective_s`` (a check of the same figure for FSDP2): the fwd+bwd time under ZeRO-3 over 2 ranks
  minus the unsharded time, divided by the collectives FSDP2 runs per micro-batch (an all-gather forward, one
  backward and a reduce-scatter per block and for the root module).

    .venv/bin/python scripts/measure_cpu_collectives.py [--iters 200]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def _median_s(fn: Any, iters: int) -> float:
    import torch.distributed as dist

    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[max(1, iters // 10):])


def _rank_main(env: Any, iters: int) -> dict[str, float]:
    import torch.distributed as dist

    from bench_parallel import MICRO_BATCH, MODEL, SEQ, VOCAB
    from starverse.runtime.modeling import build_model
    from starverse.runtime.parallel.parallelize import ParallelConfig, group_mesh, parallelize

    small = torch.zeros(2)
    big = torch.zeros(4 * 1024 * 1024)
    latency = _median_s(lambda: dist.all_reduce(small), iters)
    big_s = _median_s(lambda: dist.all_reduce(big), max(5, iters // 20))
    bus = 2.0 * (env.world_size - 1) / env.world_size * big.numel() * 4 / big_s / 1e9

    x = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    plain = build_model(MODEL, seed=0)

    def step(model: torch.nn.Module) -> None:
        model(input_ids=x, labels=x).loss.backward()
        model.zero_grad(set_to_none=True)

    plain_s = _median_s(lambda: step(plain), max(5, iters // 10))
    tp_model = parallelize(build_model(MODEL, seed=0), ParallelConfig(tp=2), group_mesh("cpu", env.world_size, 2)).model
    tp_s = _median_s(lambda: step(tp_model), max(5, iters // 10))
    z3_model = parallelize(build_model(MODEL, seed=0), ParallelConfig(zero_stage=3),
                           group_mesh("cpu", env.world_size, 1)).model
    z3_s = _median_s(lambda: step(z3_model), max(5, iters // 10))
    layers = int(MODEL["num_hidden_layers"])
    return {"allreduce_latency_s": latency, "allreduce_bus_gb_per_s": bus, "plain_step_s": plain_s,
            "tp2_step_s": tp_s, "tp_collective_s": max(tp_s - plain_s / 2.0, 0.0) / (4 * layers + 2),
            "zero3_step_s": z3_s, "zero3_collective_s": max(z3_s - plain_s, 0.0) / (3 * (layers + 1))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    from starverse.runtime.launch import RankSpec, launch

    results = launch(_rank_main, [RankSpec(r, "cpu", "cpu", num_threads=1) for r in range(2)], timeout_s=600,
                     args=(args.iters,))
    out: dict[str, Any] = {k: max(r[k] for r in results) for k in results[0]}
    out["allreduce_bus_gb_per_s"] = min(r["allreduce_bus_gb_per_s"] for r in results)
    out["load_average_1min"] = round(os.getloadavg()[0], 2)
    sys.stdout.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
