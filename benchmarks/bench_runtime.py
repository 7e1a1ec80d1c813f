"""Runtime benchmark: hetero DP against plain DDP, straggler balancing, cost-model step time vs measured.

Prints ONE JSON object; each figure is a ratio against a baseline measured in the same run:

- ``ddp_ratio``: Starverse hetero-DP throughput / ``DistributedDataParallel`` throughput, 2 equal CPU ranks,
  same model (the demo's scaled Llama), same micro-batches and global batch, same AdamW + clipping.
  Target >= 0.95. The two alternate (A B B A ..., ``BENCH_ROUNDS`` rounds, default 4) and the ratio is taken
  per round, so load from other processes on the machine hits both alike; the median is reported with the
  spread of the rounds (``*_spread``: min, max, (max - min) / median).
- ``straggler_balanced_vs_ideal``: rank 1 slowed 3x (``starverse.testing.SlowRank``), rebalancing on:
  job throughput over the last 10 of 30 steps / ideal aggregate (sum of the ranks' measured compute
  throughputs in the same run). Target >= 0.85.
- ``straggler_even_vs_ideal``: the same with shares kept even (rebalancing off); about 0.5 expected.
- ``estimate_step_time_error``: ``starverse.costmodel.estimate`` step time for the demo plan with a fresh
  probe profile / measured median step time - 1, a fresh probe and a measured run per round. Target
  within +-0.25.

Every figure is the median over rounds with its spread; a part that fails or has nothing to measure (a
rebalance so late that no steady-state steps are left) says so in the JSON (``*_error``, ``*_too_short``)
instead of crashing the run (see ``_common.py``).
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import Report, TooShort, interleave, paired_ratio, spread

SEQ, MB, GB = 128, 2, 16
STRAGGLE_STEPS = 30
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
    """Tokens/s over the steps after ``after_step`` (at least 3 of them, else :class:`TooShort`)."""
    times = list(res.step_times_s)[after_step:]
    if len(times) < 3 or sum(times) <= 0:
        raise TooShort(f"{len(times)} steps after step {after_step} of {len(res.step_times_s)}; need 3 (the run "
                       "stopped early)")
    return res.global_batch * res.seq_len * len(times) / sum(times)


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    import torch

    import starverse
    from starverse.runtime.launch import launch
    from starverse.runtime.trainer import Trainer
    from starverse.testing import SlowRank

    report = Report()
    rounds = int(os.environ.get("BENCH_ROUNDS", "4"))
    work = Path(tempfile.mkdtemp(prefix="bench-runtime-"))
    cluster = _demo_cluster()
    with cluster.mixed_mesh():
        model = starverse.build_model(cluster.model_config)
    tokens = _tokens(400 * SEQ * GB // 8)
    model_path = work / "model.pt"
    torch.save(model, model_path)
    runs = iter(range(10**6))

    def fresh() -> Any:
        return torch.load(model_path, weights_only=False)

    # --- ddp_ratio: ours and DDP alternate (A B B A ...), the ratio taken per round ---------------
    steps = 25

    def ours() -> float:
        # The whole training loop (every collective, vote and callback included), first step excluded.
        res = Trainer(cluster, run_dir=work / f"ours{next(runs)}", lr=1e-3, rebalance_every=0).fit(
            fresh(), dataset=[torch.from_numpy(tokens)], per_device_batch_size=MB, max_steps=steps, seq_len=SEQ,
            global_batch=GB,
        )
        return GB * SEQ * (steps - 1) / (res.wall_s - res.step_times_s[0])

    def ddp() -> float:
        walls = launch(_ddp_rank, list(cluster.ranks), timeout_s=600, args=(str(model_path), tokens, steps))
        return GB * SEQ * (steps - 1) / max(w - first for w, first in walls)

    with report.part("ddp_ratio"):
        samples = interleave({"ours": ours, "ddp": ddp}, rounds)
        report.figure("ddp_ratio", paired_ratio(samples["ours"], samples["ddp"]))
        report.figure("ddp_tokens_per_s", spread(samples["ddp"]))
        report.figure("hetero_dp_tokens_per_s", spread(samples["ours"]))
    if "--only-ddp" in sys.argv:
        report.emit()
        return

    # --- stragglers: rank 1 three times slower, balanced and even alternating ----------------------
    final_shares: list[Any] = []

    def straggle(rebalance_every: int) -> float:
        res = Trainer(cluster, callbacks=[SlowRank(1, 3.0)], run_dir=work / f"straggle{next(runs)}", lr=1e-3,
                      rebalance_every=rebalance_every, hysteresis=0.05).fit(
            fresh(), dataset=[torch.from_numpy(tokens)], per_device_batch_size=1, max_steps=STRAGGLE_STEPS,
            seq_len=SEQ, global_batch=GB,
        )
        if rebalance_every:
            final_shares.append(list(res.shares_history[-1][1]))
        # the last 10 steps, whenever the last rebalance came: on a loaded machine the balancer may still be
        # moving shares at step 30, and the figure is then what it achieves while doing so
        return _steady_tps(res, STRAGGLE_STEPS - 10) / sum(r.tokens_per_s for r in res.ranks)

    with report.part("straggler"):
        samples = interleave({"balanced": lambda: straggle(5), "even": lambda: straggle(0)}, max(2, rounds // 2))
        report.figure("straggler_balanced_vs_ideal", spread(samples["balanced"]))
        report.figure("straggler_even_vs_ideal", spread(samples["even"]))
        report.figure("straggler_final_shares", final_shares[-1])

    # --- cost model vs measured: a fresh probe profile and a measured run per round ----------------
    from starverse.catalog import load_catalog
    from starverse.costmodel import estimate
    from starverse.runtime.probe import probe

    def predict() -> float:
        prof = probe(list(cluster.ranks)).write(work / f"profile{next(runs)}.json")
        plan = cluster.plan
        plan = plan.model_copy(update={"groups": [g.model_copy(update={"micro_batch": MB}) for g in plan.groups]})
        return estimate(plan, catalog=load_catalog(profile=prof)).step_time_s

    def measure() -> float:
        res = Trainer(cluster, run_dir=work / f"measure{next(runs)}", lr=1e-3, rebalance_every=0).fit(
            fresh(), dataset=[torch.from_numpy(tokens)], per_device_batch_size=MB, max_steps=20, seq_len=SEQ,
            global_batch=GB,
        )
        return statistics.median(res.step_times_s[2:])

    with report.part("estimate_step_time_error"):
        samples = interleave({"predicted": predict, "measured": measure}, max(2, rounds // 2))
        errors = [a / b - 1.0 for a, b in zip(samples["predicted"], samples["measured"], strict=True)]
        report.figure("estimate_step_time_error", spread(errors))
        report.figure("estimate_step_time_s", spread(samples["predicted"]))
        report.figure("measured_step_time_s", spread(samples["measured"]))
    report.emit()


if __name__ == "__main__":
    main()
