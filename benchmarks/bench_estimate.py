"""Throughput of the cost model: 100,000 candidate Llama-2-70B groups through the batch API vs the scalar
``estimate()`` in a loop over a sample; and the accuracy of a measured profile: two plans of the demo model
(Llama-2-7B scaled down, CPU) estimated from a ``probe`` profile against their measured step times. Prints
one JSON object (ratios measured in the same run)."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np

from starverse.catalog import load_catalog
from starverse.config import parse
from starverse.costmodel import Candidates, DeviceTable, ModelShape, TrainShape, estimate, estimate_batch
from starverse.costmodel.profile import ModelProfile, ProfileEntry, shape_key
from starverse.models import load_model
from starverse.plan import Plan

N_BATCH = 100_000
N_SCALAR = 100


def candidates(rng: np.random.Generator, n: int, num_devices: int) -> Candidates:
    return Candidates.make(
        accelerator=rng.integers(0, num_devices, n),
        tp=rng.choice([1, 2, 4, 8], n),
        pp=rng.choice([1, 2, 4, 5, 8, 10, 16, 20], n),
        replicas=rng.choice([1, 2, 4, 8, 16], n),
        micro_batch=rng.choice([1, 2, 4], n),
        num_micro_batches=rng.choice([4, 8, 16, 32], n),
        zero_stage=rng.integers(0, 4, n),
        recompute=rng.integers(0, 4, n),
        offload=rng.integers(0, 2, n),
        sequence_parallel=rng.integers(0, 2, n).astype(bool),
    )


def main() -> None:
    catalog = load_catalog()
    spec = load_model("llama-2-70b")
    shape = ModelShape.from_spec(spec)
    train = TrainShape(seq_len=4096)
    ids = ["a100-80gb-sxm", "h100-80gb-sxm", "rtx-4090", "tpu-v5e"]
    dev = DeviceTable.from_catalog(catalog, ids, "bf16")
    rng = np.random.default_rng(0)
    cand = candidates(rng, N_BATCH, len(ids))
    estimate_batch(shape, train, dev, candidates(rng, 1000, len(ids)))  # warm-up
    # best of 5 (timeit's convention: the machine is shared, the minimum is the code's own cost)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        out = estimate_batch(shape, train, dev, cand)
        times.append(time.perf_counter() - t0)
    batch_s = min(times)
    assert out.step_time_s.shape == (N_BATCH,)
    # the same candidates with a measured profile on two of the four offers (a pool's ``profile:``)
    prof_dev = DeviceTable.from_accelerators([catalog.accelerator(i) for i in ids], "bf16",
                                             profiles=[synthetic_profile(shape, ids[0]), None,
                                                       synthetic_profile(shape, ids[2]), None])
    prof_times = []
    for _ in range(5):
        t0 = time.perf_counter()
        prof_out = estimate_batch(shape, train, prof_dev, cand)
        prof_times.append(time.perf_counter() - t0)
    assert not np.allclose(prof_out.step_time_s, out.step_time_s)

    sample = candidates(rng, N_SCALAR, len(ids))
    plans = []
    for i in range(N_SCALAR):
        pp = int(sample.pp[i])
        base, rem = divmod(spec.num_layers, pp)
        stages = [{"accelerator": ids[int(sample.accelerator[i])], "tp": int(sample.tp[i]),
                   "layers": base + (1 if j < rem else 0)} for j in range(pp)]
        mb, m, n = int(sample.micro_batch[i]), int(sample.num_micro_batches[i]), int(sample.replicas[i])
        plans.append(parse(Plan, {
            "model": "llama-2-70b",
            "train": {"seq_len": 4096, "global_batch": n * mb * m, "zero_stage": int(sample.zero_stage[i]),
                      "schedule": "1f1b",  # as the batch: one schedule, given micro-batch
                      "recompute": ["none", "selective", "full", "matmuls"][int(sample.recompute[i])],
                      "offload": ["none", "optimizer"][int(sample.offload[i])],
                      "sequence_parallel": bool(sample.sequence_parallel[i])},
            "groups": [{"replicas": n, "micro_batch": mb, "stages": stages}]}, "bench.yaml"))
    t0 = time.perf_counter()
    for p in plans:
        estimate(p, catalog, spec)
    scalar_s = time.perf_counter() - t0
    per_s_batch = N_BATCH / batch_s
    per_s_scalar = N_SCALAR / scalar_s
    profile = profile_accuracy(catalog)
    print(json.dumps({
        **profile,
        "plans_per_s_batch": round(per_s_batch),
        "plans_per_s_batch_median": round(N_BATCH / sorted(times)[len(times) // 2]),
        "plans_per_s_batch_profiles": round(N_BATCH / min(prof_times)),
        "plans_per_s_scalar": round(per_s_scalar, 1),
        "speedup": round(per_s_batch / per_s_scalar, 1),
        "batch_candidates": N_BATCH,
        "scalar_sample": N_SCALAR,
        "target_plans_per_s_batch": 500_000,
    }))


def synthetic_profile(shape: ModelShape, acc: str) -> ModelProfile:
    """A profile with an entry at every micro-batch and TP the candidates use (times are placeholders: only
    the lookup's cost is measured here)."""
    entries = tuple(ProfileEntry(mb, 4096, tp, "bf16", 0.01 * mb / tp, 0.02 * mb / tp, 0.005 * mb / tp,
                                 0.01 * mb / tp) for mb in (1, 2, 4) for tp in (1, 2, 4, 8))
    return ModelProfile("<bench>", acc, shape_key(shape), entries, {}, None)


DEMO_PLANS = ((1, 8), (4, 2))
"""(micro_batch, micro-batches per step) of the two demo plans: the same 8 sequences per step."""
SEQ_LEN = 128
ROUNDS = 3
"""A B B A rounds of the profile check (profile, steps, steps, profile)."""
PROBE_REPEATS = 5
STEPS = 5
CLOCK = time.process_time
"""The clock of the profile check, for the profile and the steps alike: CPU time of this process (one torch
thread), which the other jobs on a shared machine do not stretch as they do the wall clock."""
"""Measured steps per plan and visit (their median)."""


def _measured_step_s(cfg: dict, micro_batch: int, num_micro: int, steps: int = 8) -> float:
    """Median of ``steps`` real training steps (forward, backward per micro-batch, AdamW) on one CPU rank, in
    this process's CPU time (:data:`CLOCK`, as the profile: others' load on the shared machine stretches the
    wall clock of both sides by different amounts, not their CPU time)."""
    import torch

    from starverse.runtime.modeling import build_model

    model = build_model(cfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, int(cfg["vocab_size"]), (micro_batch, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    times = []
    for i in range(steps + 1):
        t0 = CLOCK()
        for _ in range(num_micro):
            model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:  # the first step allocates the optimizer state
            times.append(CLOCK() - t0)
    return float(np.median(times))


def profile_accuracy(catalog: object) -> dict[str, float]:
    """Estimated (with a probe profile, and without) vs measured step time of the two demo plans."""
    import torch

    from starverse.runtime.modeling import scale_config
    from starverse.runtime.probe import probe_model, write_json

    torch.set_num_threads(1)  # one CPU rank's threads, the same for the profile and the measured steps
    cfg = scale_config("meta-llama/Llama-2-7b-hf", max_params=3_000_000, vocab_size=2048)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "demo.json").write_text(json.dumps(cfg))
        spec = load_model(str(Path(tmp) / "demo.json"))

        def demo_plan(mb: int, m: int, profiles: dict[str, str]) -> Plan:
            return parse(Plan, {"model": str(Path(tmp) / "demo.json"),
                                "train": {"seq_len": SEQ_LEN, "global_batch": mb * m, "precision": "fp32"},
                                "groups": [{"replicas": 1, "micro_batch": mb, "stages": [
                                    {"accelerator": "cpu", "layers": spec.num_layers}]}],
                                "network": {"profiles": profiles}}, "demo.yaml")

        both = parse(Plan, {"model": "x", "train": {"seq_len": SEQ_LEN, "global_batch": 8, "precision": "fp32"},
                            "groups": [{"micro_batch": mb, "stages": [{"accelerator": "cpu", "layers": 1}]}
                                       for mb, _ in DEMO_PLANS]}, "both.yaml")
        # profile and steps measured under the same conditions: rounds of A B B A (probe, both plans' steps,
        # both plans' steps again, probe), each plan's error the median over rounds of its mean estimate over
        # the round's two profiles against its mean measured step (the machine is shared: load changes
        # between a profile taken once and steps measured minutes later are what the error showed before)
        out: dict[str, float] = {}
        per_round: dict[int, list[tuple[float, float, float]]] = {mb: [] for mb, _ in DEMO_PLANS}
        for r in range(ROUNDS):
            profs = [write_json(probe_model(both, spec, "cpu", "cpu", repeats=PROBE_REPEATS, clock=CLOCK),
                                Path(tmp) / f"cpu-profile-{r}a.json")]
            steps = {mb: [_measured_step_s(dict(spec.hf_config), mb, m, STEPS)] for mb, m in DEMO_PLANS}
            for mb, m in reversed(DEMO_PLANS):
                steps[mb].append(_measured_step_s(dict(spec.hf_config), mb, m, STEPS))
            profs.append(write_json(probe_model(both, spec, "cpu", "cpu", repeats=PROBE_REPEATS, clock=CLOCK),
                                    Path(tmp) / f"cpu-profile-{r}b.json"))
            for mb, m in DEMO_PLANS:
                est = float(np.mean([estimate(demo_plan(mb, m, {"cpu": str(f)}), catalog, spec).step_time_s
                                     for f in profs]))
                without = estimate(demo_plan(mb, m, {}), catalog, spec).step_time_s
                per_round[mb].append((float(np.mean(steps[mb])), est, without))
        errors, analytic = [], []
        for mb, _ in DEMO_PLANS:
            rows = per_round[mb]
            errors.append(float(np.median([e / meas - 1.0 for meas, e, _ in rows])))
            analytic.append(float(np.median([w / meas - 1.0 for meas, _, w in rows])))
            out[f"demo_mb{mb}_measured_step_s"] = round(float(np.median([x[0] for x in rows])), 4)
            out[f"demo_mb{mb}_profile_step_s"] = round(float(np.median([x[1] for x in rows])), 4)
            out[f"demo_mb{mb}_profile_step_error"] = round(errors[-1], 3)
        out["profile_rounds"] = ROUNDS
        out["profile_step_error_max"] = round(max(abs(e) for e in errors), 3)
        out["analytic_step_error_max"] = round(max(abs(e) for e in analytic), 3)
        out["target_profile_step_error_max"] = 0.10
    return out


if __name__ == "__main__":
    main()
