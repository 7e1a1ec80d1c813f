"""Runtime benchmark: hetero DP against plain DDP, straggler balancing, cost-model step time vs measured.

Prints ONE JSON object; each figure is a ratio against a baseline measured in the same run:

- ``ddp_ratio``: Starverse hetero-DP throughput / ``DistributedDataParallel`` throughput, 2 equal CPU ranks,
  same model (the demo's scaled Llama), same micro-batches and global batch, same AdamW + clipping.
  Target >= 0.95. Methods alternate (A B A B) and each keeps its best run, so load from other
  processes on the machine hits both alike.
- ``straggler_balanced_vs_ideal``: rank 1 slowed 3x (``starverse.testing.SlowRank``), rebalancing on:
  job throughput after the last rebalance / ideal aggregate (sum of the ranks' measured compute
  throughputs in the same run). Target >= 0.85.
- ``straggler_even_vs_ideal``: the same with shares kept even (rebalancing off); about 0.5 expected.
- ``estimate_step_time_error``: ``starverse.costmodel.estimate`` step time for the demo plan with a fresh
  probe profile / measured median step time - 1. Target within +-0.25.
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SEQ, MB, GB = 128, 2, 16
VOCAB = 8192


def _ddp_rank(env: Any, model_path: str, tokens: Any, steps: int) -> list[float]:
    """Plain DDP with gradient accumulation (no_sync on all but the last micro-batch); step times."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from starverse.runtime.steps import make_optimizer, make_schedule

    torch.manual_seed(0)
    model = torch.load(model_path, weights_only=False)
    # broadcast_buffers=False: the model has no buffers that change (rotary tables), so the tuned baseline skips it.
    ddp = DDP(model, forward_sync_buffers=False)
    opt = make_optimizer(model, 1e-3, 0.1)
    sched = make_schedule(opt, 1, steps)
    per_rank = GB // MB // env.world_size
    n_seq = tokens.size // SEQ
    times = []
    t_loop = time.perf_counter()
    for step in range(steps):
        t0 = time.perf_counter()
        for k in range(per_rank):
            start = ((step * GB + env.rank * per_rank * MB + k * MB) % (n_seq - MB)) * SEQ
            x = torch.from_numpy(tokens[start : start + MB * SEQ].reshape(MB, SEQ).astype("int64"))
            if k < per_rank - 1:
                with ddp.no_sync():
                    _fwd_bwd(ddp, x, per_rank)
            else:
                _fwd_bwd(ddp, x, per_rank)
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    # Like FitResult.wall_s: the whole loop, first step (warm-up) included; reported separately.
    return [time.perf_counter() - t_loop, times[0]]


def _fwd_bwd(ddp: Any, x: Any, per_rank: int) -> None:
    # Through the DDP wrapper's forward, so its reducer hooks fire; HF models take labels.
    out = ddp(input_ids=x, labels=x)
    (out.loss / per_rank).backward()


def _demo_cluster(max_params: int = 3_000_000) -> Any:
    import starverse

    return starverse.accelerate(
        model_id="meta-llama/Llama-2-7b-hf", num_cpu_ranks=2, use_gpus=False, seq_len=SEQ, global_batch=GB,
        max_params=max_params,
    )


def _tokens(n: int) -> Any:
    import numpy as np

    rng = np.random.default_rng(0)
    # A learnable stream (repeated random phrases), not pure noise.
    phrases = rng.integers(0, VOCAB, size=(64, 32))
    return phrases[rng.integers(0, 64, size=n // 32)].reshape(-1).astype(np.int32)


def _steady_tps(res: Any, after_step: int = 1) -> float:
    times = list(res.step_times_s)[after_step:]
    return res.global_batch * res.seq_len * len(times) / sum(times)


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    import torch

    import starverse
    from starverse.runtime.launch import launch
    from starverse.runtime.trainer import Trainer
    from starverse.testing import SlowRank

    out: dict[str, Any] = {}
    work = Path(tempfile.mkdtemp(prefix="bench-runtime-"))
    cluster = _demo_cluster()
    with cluster.mixed_mesh():
        model = starverse.build_model(cluster.model_config)
    tokens = _tokens(400 * SEQ * GB // 8)
    model_path = work / "model.pt"
    torch.save(model, model_path)

    # --- ddp_ratio: A B A B, best of each -------------------------------------------------------
    steps = 25
    ours: list[float] = []
    ddp: list[float] = []
    for rep in range(3):
        # Whole training loops (every collective, vote and callback included), first step excluded.
        res = Trainer(cluster, run_dir=work / f"ours{rep}", lr=1e-3, rebalance_every=0).fit(
            torch.load(model_path, weights_only=False), dataset=[torch.from_numpy(tokens)], per_device_batch_size=MB,
            max_steps=steps, seq_len=SEQ, global_batch=GB,
        )
        ours.append(GB * SEQ * (steps - 1) / (res.wall_s - res.step_times_s[0]))
        walls = launch(_ddp_rank, list(cluster.ranks), timeout_s=600, args=(str(model_path), tokens, steps))
        ddp.append(GB * SEQ * (steps - 1) / max(w - first for w, first in walls))
    out["ddp_ratio"] = max(ours) / max(ddp)
    out["ddp_tokens_per_s"] = max(ddp)
    out["hetero_dp_tokens_per_s"] = max(ours)

    if "--only-ddp" in sys.argv:
        print(json.dumps(out))
        return
    # --- stragglers: rank 1 three times slower ---------------------------------------------------
    def straggle(rebalance_every: int, tag: str) -> tuple[float, Any]:
        res = Trainer(cluster, callbacks=[SlowRank(1, 3.0)], run_dir=work / tag, lr=1e-3,
                      rebalance_every=rebalance_every, hysteresis=0.05).fit(
            torch.load(model_path, weights_only=False), dataset=[torch.from_numpy(tokens)], per_device_batch_size=1,
            max_steps=30, seq_len=SEQ, global_batch=GB,
        )
        last_change = res.shares_history[-1][0]
        tps = _steady_tps(res, max(2, last_change + 1))
        ideal = sum(r.tokens_per_s for r in res.ranks)
        return tps / ideal, res

    bal, res_b = straggle(5, "balanced")
    even, _ = straggle(0, "even")
    out["straggler_balanced_vs_ideal"] = bal
    out["straggler_even_vs_ideal"] = even
    out["straggler_final_shares"] = list(res_b.shares_history[-1][1])

    # --- cost model vs measured, with a fresh probe profile ---------------------------------------
    try:
        from starverse.catalog import load_catalog
        from starverse.costmodel import estimate
        from starverse.runtime.probe import probe

        prof = probe(list(cluster.ranks)).write(work / "profile.json")
        cat = load_catalog(profile=prof)
        plan = cluster.plan
        plan = plan.model_copy(update={"groups": [g.model_copy(update={"micro_batch": MB}) for g in plan.groups]})
        predicted = estimate(plan, catalog=cat).step_time_s
        res = Trainer(cluster, run_dir=work / "measure", lr=1e-3, rebalance_every=0).fit(
            torch.load(model_path, weights_only=False), dataset=[torch.from_numpy(tokens)], per_device_batch_size=MB,
            max_steps=20, seq_len=SEQ, global_batch=GB,
        )
        measured = statistics.median(res.step_times_s[2:])
        out["estimate_step_time_error"] = predicted / measured - 1.0
        out["estimate_step_time_s"] = predicted
        out["measured_step_time_s"] = measured
    except Exception as e:  # the cost model is another engineer's part: report why it is missing
        out["estimate_step_time_error"] = None
        out["estimate_step_time_error_reason"] = f"{e.__class__.__name__}: {e}"
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
