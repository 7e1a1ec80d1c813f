"""Prepared GPU check: ``Trainer.fit`` of a ~1B-parameter Llama in bf16 on one CUDA GPU, MFU vs measured peak.

Run on a machine with a CUDA GPU (nothing is downloaded; the model is built from its config with fresh
weights and trained on synthetic tokens)::

    .venv/bin/python benchmarks/gpu_check.py [--steps 20] [--batch 4] [--seq-len 2048]

Prints ONE JSON object: the measured dense bf16 matmul peak of the GPU, the training throughput, and
``mfu_vs_measured_peak`` = model FLOP/s (6N + attention, as in ``FitResult``) / measured peak
(target >= 0.40), plus ``mfu_vs_datasheet`` when the catalog knows the device. Without CUDA it prints
``{"skipped": "no CUDA device"}`` and exits 0.

``fsdp2_ac`` (issue 10): the same model sharded with FSDP2 (``runtime/parallel``: ZeRO-3, bf16 parameters
with fp32 reduction) and full activation checkpointing of every decoder block, trained with a plain loop on
the one GPU (a world of one rank: FSDP2's gathers are local copies, the point is that the path runs and what
it costs); reports its MFU against the same measured peak and its peak device memory. ``--dry-run-cpu``
runs both checks on one CPU rank with a tiny model (no figures of value).

``qlora`` (issue 14): one QLoRA fine-tuning run of the same model: the linear layers (not the head) replaced
by bitsandbytes NF4 layers (``runtime.lora.quantize_4bit``), rank-16 adapters (``apply_lora``), bf16
autocast, AdamW over the adapters only, a few steps; reports step time, adapter fraction, peak device memory
and whether the loss fell. It needs CUDA and ``bitsandbytes``; where either is missing it reports
``{"skipped": <why>}`` (``runtime.lora.qlora_support``) and the rest of the check still runs.

Sized to finish in under 4 minutes on one H200 (three ~1B models built on the host, 20 + 20 + 8 steps);
``wall_s`` of each part is in the JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# TinyLlama-1.1B's shape: 22 layers, hidden 2048, GQA 32/4 heads, SwiGLU 5632, vocab 32000.
LLAMA_1B: dict[str, Any] = {
    "model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
    "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu",
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--accum", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--dry-run-cpu", action="store_true",
                        help="check this script's logic on one CPU rank with a tiny model (no figures of value)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    import numpy as np
    import torch

    t_start = time.perf_counter()
    dry = args.dry_run_cpu
    if not torch.cuda.is_available() and not dry:
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    config = dict(LLAMA_1B)
    if dry:
        config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=300)

    import starverse
    from starverse.runtime.probe import matmul_tflops
    from starverse.runtime.steps import flops_per_token
    from starverse.runtime.trainer import Trainer

    device = torch.device("cpu" if dry else "cuda:0")
    peak = max(matmul_tflops(device, torch.bfloat16, n=512 if dry else 8192, min_s=0.2 if dry else 1.0) for _ in range(2))
    cluster = starverse.accelerate(
        num_cpu_ranks=1, use_gpus=not dry, seq_len=args.seq_len, global_batch=args.batch * args.accum
    )
    # One GPU: train on rank 0 only (a multi-GPU machine still gets one rank here, as the check asks).
    if cluster.world_size > 1:
        from starverse.runtime.cluster import Cluster, local_plan

        ranks = cluster.ranks[:1]
        cluster = Cluster(plan=local_plan(ranks, "llama-1b", 22, args.seq_len, args.batch * args.accum), ranks=ranks)
    model = starverse.build_model(config)
    n_params = sum(p.numel() for p in model.parameters())
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config["vocab_size"], size=args.seq_len * args.batch * args.accum * (args.steps + 2))
    run_dir = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    res = Trainer(cluster, run_dir=run_dir, lr=3e-4, rebalance_every=0).fit(
        model, dataset=[torch.from_numpy(tokens)], per_device_batch_size=args.batch, max_steps=args.steps,
        seq_len=args.seq_len, global_batch=args.batch * args.accum, precision="bf16", tokenizer="bytes",
    )
    r0 = res.ranks[0]
    fpt = flops_per_token(model, args.seq_len)
    achieved_tflops = res.tokens_per_s * fpt / 1e12
    out = {
        "device": "cpu (dry run)" if dry else torch.cuda.get_device_name(device),
        "device_kind": r0.device_kind,
        "params": n_params,
        "seq_len": args.seq_len,
        "global_batch": args.batch * args.accum,
        "steps": res.steps,
        "final_loss": res.final_loss,
        "tokens_per_s": res.tokens_per_s,
        "step_time_s": res.step_time_s,
        "measured_bf16_peak_tflops": peak,
        "achieved_tflops": achieved_tflops,
        "mfu_vs_measured_peak": achieved_tflops / peak,
        "mfu_vs_datasheet": res.mfu,
    }
    out["wall_s"] = time.perf_counter() - t_start
    t0 = time.perf_counter()
    out["fsdp2_ac"] = fsdp2_ac_check(config, args, device, peak)
    out["fsdp2_ac"]["wall_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    out["qlora"] = qlora_check(config, args, device)
    out["qlora"]["wall_s"] = time.perf_counter() - t0
    print(json.dumps(out))
    return 0


def fsdp2_ac_check(config: dict[str, Any], args: argparse.Namespace, device: Any, peak_tflops: float) -> dict[str, Any]:
    """FSDP2 (ZeRO-3) + full recompute of ``config`` on ``device`` in a world of one rank: MFU and memory."""
    import socket

    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import starverse
    from starverse.runtime.parallel.parallelize import ParallelConfig, clip_grad_norm, group_mesh, parallelize
    from starverse.runtime.steps import flops_per_token

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)
    try:
        model = starverse.build_model(config)
        fpt = flops_per_token(model, args.seq_len)
        low = torch.bfloat16 if device.type == "cuda" else torch.float32
        pm = parallelize(model.to(device), ParallelConfig(zero_stage=3, recompute="full"),
                         group_mesh(device.type, 1, 1),
                         mp_policy=MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32))
        opt = torch.optim.AdamW(pm.model.parameters(), lr=3e-4, fused=device.type == "cuda")
        rng = np.random.default_rng(0)
        times, losses = [], []
        for _ in range(args.steps):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            for k in range(args.accum):
                pm.before_micro_batch(k, args.accum)
                ids = torch.from_numpy(rng.integers(0, int(config["vocab_size"]), (args.batch, args.seq_len))).to(device)
                loss = pm.model(input_ids=ids, labels=ids).loss / args.accum
                loss.backward()
            clip_grad_norm(pm.model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()) * args.accum)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        steady = times[2:] or times[1:] or times
        tokens_per_s = args.batch * args.accum * args.seq_len * len(steady) / sum(steady)
        achieved = tokens_per_s * fpt / 1e12
        return {
            "zero_stage": 3, "recompute": "full", "param_dtype": str(low).removeprefix("torch."),
            "steps": args.steps, "final_loss": losses[-1], "tokens_per_s": tokens_per_s,
            "step_time_s": float(np.median(steady)), "achieved_tflops": achieved,
            # Full recompute runs each block's forward twice; MFU counts model FLOPs only (6N + attention).
            "mfu_vs_measured_peak": achieved / peak_tflops,
            "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
        }
    finally:
        dist.destroy_process_group()


QLORA_STEPS, QLORA_RANK = 8, 16


def qlora_check(config: dict[str, Any], args: argparse.Namespace, device: Any) -> dict[str, Any]:
    """A few QLoRA steps of ``config`` on ``device`` (see the module docstring); ``{"skipped": why}`` where
    4-bit weights cannot run (no CUDA, or no bitsandbytes)."""
    import numpy as np
    import torch

    import starverse
    from starverse.runtime.lora import apply_lora, qlora_support, quantize_4bit

    why = qlora_support([str(device)])
    if why is not None:
        return {"skipped": why}
    torch.cuda.reset_peak_memory_stats(device)
    model = starverse.build_model(config)
    quantize_4bit(model)
    apply_lora(model, QLORA_RANK)
    model.to(device)  # bitsandbytes quantizes the base weights to NF4 here
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3)
    rng = np.random.default_rng(1)
    # one fixed batch, repeated: the loss must fall when only the adapters learn
    ids = torch.from_numpy(rng.integers(0, int(config["vocab_size"]), (args.batch, args.seq_len))).to(device)
    times, losses = [], []
    for _ in range(QLORA_STEPS):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    steady = times[2:] or times
    return {
        "lora_rank": QLORA_RANK, "steps": QLORA_STEPS, "batch": args.batch, "seq_len": args.seq_len,
        "trainable_fraction": sum(p.numel() for p in trainable) / sum(p.numel() for p in model.parameters()),
        "step_time_s": float(np.median(steady)), "first_loss": losses[0], "final_loss": losses[-1],
        "loss_fell": losses[-1] < losses[0],
        "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 1e9,
    }


if __name__ == "__main__":
    sys.exit(main())
