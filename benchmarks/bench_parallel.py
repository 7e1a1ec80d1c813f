"""In-stage parallelism measured next to the cost model (CPU ranks, gloo, fp32). Prints ONE JSON object.

``state_bytes_error``: per rank, the bytes of parameters + gradients + optimizer state the ranks really hold
(measured from the tensors, at their peak over a step) against ``costmodel.estimate``'s weights + grads +
optimizer for the same plan, for ZeRO-0, ZeRO-1, ZeRO-3 (2 data-parallel ranks) and TP 2; the figure is the
worst relative error (target |error| <= 0.05), each case is listed with its parts.

Where the bytes are measured: parameters at every block's forward (after FSDP gathered it) and after each
backward — sharded storage always, plus the gathered copies alive at that moment; gradients after each
backward (accumulated whole gradients under ZeRO-1, shards after the reduce-scatter); optimizer state after
the step (a ZeRO-1 optimizer's ``state`` is its own partition's). Each part's maximum over the step is its
peak. A part's bytes are those of the storages behind its tensors, each storage counted once (what is
allocated: padding, and FSDP2's one all-gather buffer per unit, counted as such). FSDP2's gathered copies
are read from its parameter state (``FSDPParam.sharded_state``), the only place that says which are alive.

``lora_state_bytes_error``: the same for LoRA (rank 8) under ZeRO-1 and under TP 2, reported without a target.
Under TP the runtime keeps the rank-side adapter matrices whole (``lora_A`` of a column-wise split linear,
``lora_B`` of a row-wise one: splitting them would cost an all-reduce of the whole output per adapted linear),
while the cost model splits all adapter parameters by ``tp``.

``tp2_vs_dp2``, ``zero1_vs_dp2`` and ``zero3_vs_dp2``: training throughput of TP 2 (one replica), of ZeRO-1 and
of ZeRO-3 over 2 ranks, each divided by plain data parallelism over the same 2 ranks (gradient all-reduce),
same model and global batch, same run. Reported, no bound: on CPU ranks the all-reduces of TP and the gathers
of ZeRO-3 are not hidden behind compute as on GPUs. Beside each, ``<name>_predicted``: the same ratio from
the cost model's step times of the same plans on one-thread CPU ranks (what ``accelerate()`` ranks by).

Pipelines (the same model, 8 micro-batches of one sequence, ``Trainer.fit`` on CPU ranks):

- ``pp_bubble_error``: a 4-stage 1F1B pipeline (2+2+2+2 layers) on 4 CPU ranks, 8 micro-batches of
  ``PP_BUBBLE_MICRO_BATCH`` (4) sequences: measured bubble fraction (``FitResult.pipeline.bubble``: 1 - busiest
  stage's compute / step wall time, first step left out) minus the cost model's (``pipeline_bubble`` / step time
  of the same plan). Target ``|error| <= 0.25``. Best of two runs. ``pp_stage_ms`` lists each stage's measured
  compute per micro-batch beside the cost model's. Why 4 sequences per micro-batch: the cost model's bubble is
  that of compute-bound stages, ``(p - 1) / (m + p - 1)`` plus its p2p time; with one 64-token sequence a stage
  computes ~10 ms per micro-batch on the shared 2-core VM, the same order as waking a rank blocked in a
  ``recv`` on a machine at load ~15 (4 ranks on 2 cores), so each of the schedule's ~40 hand-offs adds that
  latency to the measured bubble (one run: 0.50 with one sequence, 0.33 with four, predicted 0.25 for both).
- ``hetero_pp_vs_even``: a 2-stage pipeline whose second rank is slowed 3x (``starverse.testing.SlowRank``):
  steady throughput with the planner's uneven split (``planner.hetero.split_layers`` over the stages' relative
  speeds 1 : 1/3, as a probe profile reports them) over throughput with an even split. Target ``>= 1.5``.
  Measured in ``HETERO_BLOCKS`` blocks of four fits in the order uneven, even, even, uneven (ABBA: a load that
  rises or falls steadily over a block weighs on both splits alike), ``HETERO_STEPS`` steps each; a fit's
  throughput is tokens per step over its median step time (first step left out), a block's ratio is the mean
  uneven throughput over the mean even one, and the figure is the median of the blocks' ratios
  (``hetero_pp_block_ratios`` lists them: their spread is the noise of the shared machine).

    .venv/bin/python benchmarks/bench_parallel.py [--steps 4] [--only state|pipeline]
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

import torch

VOCAB = 256
MODEL: dict[str, Any] = {
    "model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 8,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu",
}
SEQ, GLOBAL_BATCH, MICRO_BATCH = 64, 8, 2
STATE_CASES = {"zero0": {"zero_stage": 0}, "zero1": {"zero_stage": 1}, "zero3": {"zero_stage": 3}, "tp2": {"tp": 2}}
"""The cases of ``state_bytes_error`` (the target's)."""
LORA_STATE_CASES = {"lora_zero1": {"zero_stage": 1, "lora_rank": 8}, "lora_tp2": {"tp": 2, "lora_rank": 8}}
"""The cases of ``lora_state_bytes_error`` (reported, no target): rank-8 adapters on every linear but the head."""
THROUGHPUT_CASES = {"dp2": {"zero_stage": 0}, "tp2": {"tp": 2}, "zero1": {"zero_stage": 1}, "zero3": {"zero_stage": 3}}


def _allocated(tensors: Any) -> int:
    """Bytes of the storages behind ``tensors`` (a DTensor's local shard), each storage counted once: what is
    allocated, padding and shared flat buffers included (FSDP2's shards are views of padded buffers, its
    gathered parameters views of one all-gather buffer per unit; a freed one has 0 bytes)."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class StateMeter:
    """Peaks of parameter, gradient and optimizer bytes held by this rank (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.model, self.optimizer = model, optimizer
        self.fsdp_params = [
            fp for m in model.modules() if isinstance(m, FSDPModule)
            for group in m._get_fsdp_state()._fsdp_param_groups for fp in group.fsdp_params
        ]
        self.peak = {"params": 0, "grads": 0, "optimizer": 0}

    def _params_grads(self) -> tuple[int, int]:
        from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

        if not self.fsdp_params:
            params = list(self.model.parameters())
            return _allocated(params), _allocated(p.grad for p in params)
        params, grads = [], []
        for fp in self.fsdp_params:
            params.append(fp.sharded_param)
            grads.append(fp.sharded_param.grad)
            if fp.sharded_state == ShardedState.UNSHARDED:
                params.append(fp.unsharded_param)
            if fp.unsharded_accumulated_grad is not None:
                grads.append(fp.unsharded_accumulated_grad)
            elif fp.sharded_state == ShardedState.UNSHARDED:
                grads.append(fp.unsharded_param.grad)
        return _allocated(params), _allocated(grads)

    def sample(self) -> None:
        """Record the parameter and gradient bytes alive now."""
        p, g = self._params_grads()
        self.peak["params"] = max(self.peak["params"], p)
        self.peak["grads"] = max(self.peak["grads"], g)

    def sample_optimizer(self) -> None:
        """Record the optimizer state bytes (after a step): the state this rank's optimizer holds (a ZeRO-1
        optimizer's ``state`` is its own partition's)."""
        total = _allocated(v for s in self.optimizer.state.values() for v in s.values()
                           if isinstance(v, torch.Tensor) and v.dim() > 0)
        self.peak["optimizer"] = max(self.peak["optimizer"], total)


def _run_case(env: Any, variant: dict[str, Any], steps: int, measure: bool) -> dict[str, Any]:
    """Train ``steps`` steps of ``variant`` on this rank; its state-byte peaks or its step times."""
    import torch.distributed as dist

    from starverse.runtime.lora import apply_lora
    from starverse.runtime.modeling import build_model
    from starverse.runtime.parallel.blocks import decoder_blocks
    from starverse.runtime.parallel.parallelize import ParallelConfig, clip_grad_norm, group_mesh, parallelize

    settings = dict(variant)
    lora_rank = settings.pop("lora_rank", 0)
    config = ParallelConfig(**settings)
    mesh = group_mesh("cpu", env.world_size, config.tp)
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    model = build_model(MODEL, seed=0)
    if lora_rank:
        apply_lora(model, lora_rank)
    pm = parallelize(model, config, mesh)
    model = pm.model
    opt = pm.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False))
    meter = StateMeter(model, opt) if measure else None
    if meter is not None:
        for block in decoder_blocks(model)[1]:
            block.register_forward_pre_hook(lambda *_: meter.sample())
    gen = torch.Generator().manual_seed(0)
    per_replica = GLOBAL_BATCH // dp
    num_micro = per_replica // MICRO_BATCH
    times = []
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=gen)
        mine = x[dp_rank * per_replica : (dp_rank + 1) * per_replica]
        dist.barrier()
        t0 = time.perf_counter()
        for k in range(num_micro):
            pm.before_micro_batch(k, num_micro)
            xs = mine[k * MICRO_BATCH : (k + 1) * MICRO_BATCH]
            (model(input_ids=xs, labels=xs).loss * (MICRO_BATCH / GLOBAL_BATCH)).backward()
            if meter is not None:
                meter.sample()
        pm.sync_gradients()  # plain DP: one flat all-reduce of the gradients over the replicas
        clip_grad_norm(model.parameters(), 1.0)
        opt.step()
        if meter is not None:
            meter.sample_optimizer()
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return {"peak": meter.peak if meter else None, "times": times}


def _rank_main(env: Any, steps: int) -> dict[str, Any]:
    state = {name: _run_case(env, v, 1, True)["peak"] for name, v in {**STATE_CASES, **LORA_STATE_CASES}.items()}
    speed = {name: _run_case(env, v, steps, False)["times"] for name, v in THROUGHPUT_CASES.items()}
    return {"state": state, "times": speed}


def _stage_estimate(variant: dict[str, Any], world: int, catalog: Any = None) -> Any:
    """The cost model's estimate of ``variant`` on ``world`` CPU ranks (the benchmark's model and batch)."""
    from starverse.costmodel.step import estimate
    from starverse.plan import Group, Plan, Stage, TrainSpec

    tp = variant.get("tp", 1)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "config.json"
        cfg.write_text(json.dumps(MODEL))
        plan = Plan(
            model=str(cfg),
            train=TrainSpec(seq_len=SEQ, global_batch=GLOBAL_BATCH, precision="fp32",
                            zero_stage=variant.get("zero_stage", 0), mode="lora" if variant.get("lora_rank") else "full",
                            lora_rank=variant.get("lora_rank", 16)),
            groups=[Group(replicas=world // tp, micro_batch=MICRO_BATCH,
                          stages=[Stage(accelerator="cpu", tp=tp, layers=MODEL["num_hidden_layers"])])],
        )
        return estimate(plan, catalog)


def _predicted_state_bytes(variant: dict[str, Any], world: int) -> dict[str, float]:
    """The cost model's weights + grads + optimizer bytes per device for the same plan."""
    stage = _stage_estimate(variant, world).groups[0].stages[0]
    return {"params": stage.weights_gb * 1e9, "grads": stage.grads_gb * 1e9, "optimizer": stage.optimizer_gb * 1e9}


def state_bytes_figures(results: list[dict[str, Any]], world: int, prefix: str = "",
                        variants: dict[str, dict[str, Any]] = STATE_CASES) -> dict[str, Any]:
    """``<prefix>state_bytes_error`` (worst case) and each case's measured and predicted parts (the largest
    over ranks)."""
    cases = {}
    for name, variant in variants.items():
        measured = {k: max(r["state"][name][k] for r in results) for k in ("params", "grads", "optimizer")}
        predicted = _predicted_state_bytes(variant, world)
        total_m, total_p = sum(measured.values()), sum(predicted.values())
        cases[name] = {"measured_bytes": measured, "predicted_bytes": {k: round(v) for k, v in predicted.items()},
                       "error": total_m / total_p - 1.0}
    worst = max(cases.values(), key=lambda c: abs(c["error"]))
    return {f"{prefix}state_bytes_error": worst["error"], f"{prefix}state_bytes_cases": cases}


def throughput_figures(results: list[dict[str, Any]], world: int) -> dict[str, Any]:
    """``tp2_vs_dp2``, ``zero1_vs_dp2`` and ``zero3_vs_dp2``: throughput ratios (median step time, first step
    dropped), each beside the cost model's (``<name>_predicted``: the planner's view of the same plans on
    one-thread CPU ranks, ``planner.devices.cpu_rank_catalog``)."""
    import statistics

    from starverse.catalog import load_catalog
    from starverse.planner.devices import cpu_rank_catalog

    def median_step(name: str) -> float:
        return statistics.median(max(r["times"][name][i] for r in results) for i in range(1, len(results[0]["times"][name])))

    catalog = cpu_rank_catalog(load_catalog(), 1)
    predicted = {name: _stage_estimate(v, world, catalog).step_time_s for name, v in THROUGHPUT_CASES.items()}
    base = median_step("dp2")
    out: dict[str, Any] = {"dp2_step_s": base, "dp2_step_s_predicted": predicted["dp2"]}
    for name in ("tp2", "zero1", "zero3"):
        out[f"{name}_vs_dp2"] = base / median_step(name)
        out[f"{name}_vs_dp2_predicted"] = predicted["dp2"] / predicted[name]
    return out


PP_MICRO_BATCH, PP_BUBBLE_MICRO_BATCH, PP_STEPS = 1, 4, 5
HETERO_BLOCKS, HETERO_STEPS = 3, 8
"""``hetero_pp_vs_even``: ABBA blocks, and steps per fit (see the module docstring)."""


def _pp_fit(
    work: Path, tag: str, stages: list[tuple[str, int]], callbacks: list[Any], micro_batch: int = PP_MICRO_BATCH,
    steps: int = PP_STEPS,
) -> Any:
    """``Trainer.fit`` of one pipeline of ``stages`` ``(device kind, layers)``, one CPU rank per stage, 8
    micro-batches of ``micro_batch`` sequences."""
    from starverse.plan import Group, Plan, Stage, TrainSpec
    from starverse.runtime.cluster import Cluster
    from starverse.runtime.launch import RankSpec
    from starverse.runtime.modeling import build_model
    from starverse.runtime.trainer import Trainer

    cfg_path = work / "config.json"
    cfg_path.write_text(json.dumps(MODEL))
    gb = 8 * micro_batch
    plan = Plan(model=str(cfg_path), train=TrainSpec(seq_len=SEQ, global_batch=gb, precision="fp32"),
                groups=[Group(micro_batch=micro_batch, stages=[Stage(accelerator=k, layers=n) for k, n in stages])])
    ranks = tuple(RankSpec(r, k, "cpu", num_threads=1) for r, (k, _) in enumerate(stages))
    trainer = Trainer(Cluster(plan=plan, ranks=ranks), callbacks=callbacks, run_dir=work / tag, rebalance_every=0,
                      timeout_s=900, progress=False)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, VOCAB, (SEQ * 8,), generator=g) for _ in range(32)]
    return trainer.fit(build_model(MODEL), dataset=data, per_device_batch_size=micro_batch, max_steps=steps,
                       seq_len=SEQ, global_batch=gb, tokenizer="bytes")


def hetero_pp_figures(work: Path, layers: int) -> dict[str, Any]:
    """``hetero_pp_vs_even``: the planner's uneven split over an even one, rank 1 slowed 3x, in ABBA blocks (see
    the module docstring)."""
    import statistics

    from starverse.planner.hetero import split_layers
    from starverse.testing import SlowRank

    splits = {"uneven": split_layers([1.0, 1.0 / 3.0], layers), "even": [layers // 2, layers - layers // 2]}
    tokens_step = 8 * PP_MICRO_BATCH * SEQ
    ratios = []
    for block in range(HETERO_BLOCKS):
        tps: dict[str, list[float]] = {tag: [] for tag in splits}
        for i, tag in enumerate(("uneven", "even", "even", "uneven")):
            split = splits[tag]
            res = _pp_fit(work, f"{tag}-{block}-{i}", [("cpu", split[0]), ("cpu", split[1])], [SlowRank(1, 3.0)],
                          steps=HETERO_STEPS)
            tps[tag].append(tokens_step / statistics.median(res.step_times_s[1:]))
        ratios.append(statistics.mean(tps["uneven"]) / statistics.mean(tps["even"]))
    return {"hetero_pp_splits": splits, "hetero_pp_vs_even": round(statistics.median(ratios), 3),
            "hetero_pp_block_ratios": [round(r, 3) for r in ratios]}


def pipeline_figures() -> dict[str, Any]:
    """``pp_bubble_error`` and ``hetero_pp_vs_even`` (see the module docstring)."""
    layers = int(MODEL["num_hidden_layers"])
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        reports = [_pp_fit(work, f"pp4-{i}", [("cpu", layers // 4)] * 4, [], PP_BUBBLE_MICRO_BATCH).pipeline
                   for i in range(2)]
        rep = min(reports, key=lambda r: r.bubble)
        out["pp_stage_ms"] = [
            {"measured": round(st.time_per_micro_batch_s * 1e3, 2),
             "predicted": None if st.predicted_time_per_micro_batch_s is None
             else round(st.predicted_time_per_micro_batch_s * 1e3, 2)}
            for st in rep.stages
        ]
        out["pp_bubble_measured"] = round(rep.bubble, 4)
        out["pp_bubble_predicted"] = None if rep.predicted_bubble is None else round(rep.predicted_bubble, 4)
        out["pp_bubble_error"] = None if rep.predicted_bubble is None else round(rep.bubble - rep.predicted_bubble, 4)
        out.update(hetero_pp_figures(work, layers))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="steps per throughput case (the first is dropped)")
    parser.add_argument("--only", choices=("state", "pipeline"), default=None, help="run one half only")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from starverse.runtime.launch import RankSpec, launch

    world = 2
    out: dict[str, Any] = {"model": "llama 8 layers, hidden 128, vocab 256", "ranks": world}
    if args.only != "pipeline":
        results = launch(_rank_main, [RankSpec(r, "cpu", "cpu", num_threads=1) for r in range(world)],
                         timeout_s=900, args=(max(2, args.steps),))
        out.update(state_bytes_figures(results, world))
        out.update(state_bytes_figures(results, world, "lora_", LORA_STATE_CASES))
        out.update(throughput_figures(results, world))
    if args.only != "state":
        out.update(pipeline_figures())
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
