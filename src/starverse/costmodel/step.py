"""``estimate(plan) -> Estimate``: the scalar cost model over a whole (possibly heterogeneous) plan.

Each group is evaluated with one stage row per real pipeline stage (so stages may sit on different
accelerators), through the same functions the batch estimator uses (:mod:`costmodel.stage`,
:mod:`costmodel.group`). Groups run data-parallel: each processes its batch share, the step waits for the
slowest, then gradients are all-reduced between groups over the cross-group links.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from starverse.costmodel import constants as C
from starverse.costmodel.attention_rates import attention_tflops_for
from starverse.costmodel.batch import joint_sync_s, sharded_sync_s
from starverse.costmodel.comm import ring_allreduce_s
from starverse.costmodel.group import PART_NAMES, combine, model_numbers
from starverse.costmodel.measured import (
    intra_node_gb_per_s,
    measured_layer_times,
    optimizer_s_per_param,
    plan_profiles,
)
from starverse.costmodel.pricing import cheapest_price_per_hour
from starverse.costmodel.profile import ModelProfile
from starverse.costmodel.rows import StageRows
from starverse.costmodel.shapes import OFFLOAD_CODES, RECOMPUTE_CODES, ModelShape, TrainShape
from starverse.costmodel.stage import stage_costs
from starverse.errors import ConfigError, StarverseError
from starverse.plan import Group, Plan


@dataclass(frozen=True)
class StageMemory:
    """Memory of one device of one pipeline stage (GB)."""

    accelerator: str
    """Catalog id."""
    tp: int
    """Tensor-parallel degree."""
    layers: int
    """Layers on the stage."""
    weights_gb: float
    """Weights (incl. ZeRO-3 gathered working set)."""
    grads_gb: float
    """Gradients."""
    optimizer_gb: float
    """Optimizer state on the device (fp32 master + Adam moments)."""
    activations_gb: float
    """Activations of the micro-batches in flight, logits, recompute working set."""
    total_gb: float
    """All of the above plus the fixed runtime reserve."""
    capacity_gb: float
    """Usable device memory (minus fragmentation)."""
    margin_gb: float
    """capacity - total (negative: does not fit)."""
    flat_grad_segment_gb: float = 0.0
    """Allocator segment of the flat gradient copy that no freed activation block can hold
    (``TrainSpec.flat_grad_allreduce``; reserved beside the activations' segments, so counted in device-wide
    readings): the part ``total_gb`` does not hold already (it holds the larger of the copy and the activations)."""


@dataclass(frozen=True)
class GroupEstimate:
    """One group's share of the work and its timing."""

    index: int
    """Position in ``plan.groups``."""
    num_devices: int
    """Devices in the group."""
    batch_share: float
    """Share of the global batch."""
    sequences_per_step: int
    """Sequences per step over all its replicas."""
    micro_batch: int
    """Chosen (or given) micro-batch."""
    num_micro_batches: int
    """Micro-batches per replica per step."""
    schedule: str
    """Pipeline schedule used (the plan's, or the fastest when the plan leaves it out)."""
    virtual_stages: int
    """Model chunks per device (interleaved)."""
    step_time_s: float
    """Time this group needs for its share."""
    breakdown: dict[str, float]
    """Parts of its step time (seconds)."""
    stages: list[StageMemory]
    """Memory per stage."""
    fits: bool
    """Every stage fits."""


@dataclass(frozen=True)
class Estimate:
    """What a plan costs: time, throughput, memory, money, power."""

    step_time_s: float
    """Seconds per optimizer step."""
    tokens_per_s: float
    """Trained tokens per second, whole job."""
    mfu: float
    """Model FLOPs utilisation against the dense peak of all devices."""
    model_tflops_per_device: float
    """Model TFLOP/s (no recompute) per device."""
    hardware_tflops_per_device: float
    """Executed TFLOP/s per device (with recompute)."""
    memory_gb: float
    """Worst device's memory need."""
    capacity_gb: float
    """That device's usable memory."""
    margin_gb: float
    """Smallest capacity - need over all devices."""
    fits: bool
    """Every device fits."""
    cost_per_hour: float | None
    """All devices, per hour (``currency``); None when a price is unknown."""
    cost_per_million_tokens: float | None
    """Cost of a million trained tokens."""
    currency: str
    """Currency of the costs."""
    power_kw: float
    """Sum of device TDPs (kW)."""
    bottleneck: str
    """Largest part of the step: compute | memory | tp_comm | dp_comm | pp_comm | pipeline_bubble."""
    breakdown: dict[str, float]
    """Step time parts (seconds) of the slowest group, plus cross-group gradient sync."""
    groups: list[GroupEstimate]
    """Per-group details."""
    num_devices: int
    """Devices in the plan."""
    warnings: list[str] = field(default_factory=list)
    """Things the user should know (unknown prices, tight memory...)."""
    job_hours: float | None = None
    """Hours for ``train.tokens``/``train.steps`` when given."""
    job_cost: float | None = None
    """Cost of the whole job when its length and prices are known."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (NaN become None)."""

        def clean(x: Any) -> Any:
            if isinstance(x, float) and not math.isfinite(x):
                return None
            if isinstance(x, dict):
                return {k: clean(v) for k, v in x.items()}
            if isinstance(x, list):
                return [clean(v) for v in x]
            return x

        return clean(asdict(self))  # type: ignore[no-any-return]


def _resolve(plan: Plan, catalog: Any, spec: Any) -> tuple[Any, Any]:
    if catalog is None:
        from starverse.catalog import load_catalog

        catalog = load_catalog()
    if spec is None:
        from starverse.models import load_model

        spec = load_model(plan.model)
    return catalog, spec


def check_plan(plan: Plan, spec: Any, catalog: Any) -> None:
    """Plan-vs-model and plan-vs-catalog checks; ConfigError naming the field."""
    name = getattr(spec, "name", plan.model)
    for gi, g in enumerate(plan.groups):
        total = sum(s.layers * s.repeat for s in g.stages)
        if total != spec.num_layers:
            raise ConfigError(
                f"groups[{gi}].stages: layers sum to {total} but model '{name}' has {spec.num_layers}; "
                f"make the stages' layers (times repeat) add up to {spec.num_layers}", loc=("groups", gi, "stages")
            )
        for si, s in enumerate(g.stages):
            try:
                catalog.accelerator(s.accelerator)
            except StarverseError as e:
                raise ConfigError(f"groups[{gi}].stages[{si}].accelerator: {e}",
                                  loc=("groups", gi, "stages", si, "accelerator")) from None
            if spec.num_heads % s.tp or spec.num_kv_heads % s.tp:
                ok = [d for d in range(1, spec.num_kv_heads + 1)
                      if spec.num_heads % d == 0 and spec.num_kv_heads % d == 0]
                raise ConfigError(
                    f"groups[{gi}].stages[{si}].tp: {s.tp} does not divide the model's {spec.num_heads} attention "
                    f"heads and {spec.num_kv_heads} KV heads; use one of {', '.join(map(str, ok))}",
                    loc=("groups", gi, "stages", si, "tp"),
                )


def _stage_rows(plan: Plan, g: Group, catalog: Any, micro_batches: np.ndarray, m: np.ndarray,
                profiles: dict[str, ModelProfile]) -> StageRows:
    """Rows of shape (S, K): S stages of the group, K micro-batch choices."""
    stages = g.expanded_stages()
    precision = plan.train.precision
    k = len(micro_batches)
    tr = plan.train
    accs = [catalog.accelerator(s.accelerator) for s in stages]
    dpn = [plan.network.node_size(a) for a in accs]
    nic = [line_rate_gbps(plan, plan.network.link_gbps(a.id, a.id)
                          or plan.network.inter_node_gbps.get(a.id, a.inter_node_gbps)) for a in accs]

    def col(values: list[float]) -> np.ndarray:
        return np.repeat(np.asarray(values, dtype=np.float64)[:, None], k, axis=1)

    def full(value: float) -> np.ndarray:
        return np.full((len(stages), k), float(value))

    pp = len(stages)
    layer_s, layer_fwd_s, head_s = measured_layer_times(profiles, stages, micro_batches, tr.seq_len, precision)
    return StageRows(
        peak_tflops=col([C.peak_tflops(a, precision) for a in accs]),
        gemm_efficiency=col([C.gemm_efficiency(a, precision) for a in accs]),
        memory_gb=col([plan.network.usable_memory_gb.get(a.id, C.usable_memory_gb(a)) for a in accs]),
        memory_bw_gb_per_s=col([a.memory_bw_gb_per_s for a in accs]),
        intra_node_gb_per_s=col([intra_node_gb_per_s(plan, a, s.tp, profiles) for a, s in zip(accs, stages, strict=True)]),
        devices_per_node=col([float(d) for d in dpn]),
        inter_node_gbps=col([float(x) for x in nic]),
        tp=col([float(s.tp) for s in stages]),
        layers=col([float(s.layers) for s in stages]),
        first=np.repeat((np.arange(pp) == 0)[:, None], k, axis=1),
        last=np.repeat((np.arange(pp) == pp - 1)[:, None], k, axis=1),
        stage_index=col([float(i) for i in range(pp)]),
        pp=full(pp),
        replicas=full(g.replicas * g.cp),  # gradients are reduced over data x context parallel ranks
        micro_batch=np.repeat(micro_batches[None, :].astype(np.float64), pp, axis=0),
        num_micro_batches=np.repeat(m[None, :].astype(np.float64), pp, axis=0),
        zero_stage=full(tr.zero_stage),
        recompute=full(RECOMPUTE_CODES[tr.recompute]),
        offload=full(OFFLOAD_CODES[tr.offload]),
        sequence_parallel=np.full((pp, k), tr.sequence_parallel),
        pipeline_devices=full(sum(s.tp for s in stages)),
        attention_tflops=col([attention_tflops_for(a, precision, tr.attention) for a in accs]),
        flash_attention=np.repeat(np.array([C.has_flash_attention(a) for a in accs])[:, None], k, axis=1),
        host_collectives=np.repeat(np.array([C.host_collectives(a) for a in accs])[:, None], k, axis=1),
        compiled_memory=np.repeat(np.array([C.compiled_memory(a) for a in accs])[:, None], k, axis=1),
        matrix_unit=col([float(a.matrix_unit or 0) for a in accs]),
        measured_layer_s=layer_s,
        measured_layer_forward_s=layer_fwd_s,
        measured_head_s=head_s,
        measured_optimizer_s_per_param=col([optimizer_s_per_param(profiles, a.id) for a in accs]),
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class _GroupEval:
    costs: dict[str, np.ndarray]
    out: dict[str, np.ndarray]
    micro_batches: np.ndarray
    m: np.ndarray
    best: int
    schedule: str
    virtual_stages: int


def _schedule_options(plan: Plan, g: Group) -> list[tuple[str, int]]:
    """The plan's schedule, or when the plan leaves it out and the group pipelines, every schedule a
    competent engineer would try: 1F1B and interleaved 1F1B with v chunks per device (v dividing every
    stage's layers)."""
    tr = plan.train
    stages = g.expanded_stages()
    if "schedule" in tr.model_fields_set or len(stages) <= 1:
        return [(tr.schedule, tr.virtual_stages if tr.schedule == "interleaved" else 1)]
    fewest = min(s.layers for s in stages)
    opts = [("1f1b", 1)]
    opts += [("interleaved", v) for v in range(2, fewest + 1) if all(s.layers % v == 0 for s in stages)]
    return opts


def line_rate_gbps(plan: Plan, gbps: float) -> float:
    """The line rate (Gbit/s) the model takes ``NETWORK_EFFICIENCY`` of for a figure of the plan's network:
    the figure itself, or where the plan says NCCL reached it (``network.achieved_gbps``) the rate of which it
    is that share, so that the model's sends and rings run at the figure."""
    return gbps / C.NETWORK_EFFICIENCY if plan.network.achieved_gbps else gbps


def node_link_gbps(plan: Plan, catalog: Any, a: str, b: str) -> float:
    """Gbit/s between a node of accelerator ``a`` and one of ``b``: the measured ``network.links`` pair,
    else (different kinds) ``network.cross_group_gbps``, else the slower of the two nodes' NICs (as a line
    rate, :func:`line_rate_gbps`)."""
    link = plan.network.link_gbps(a, b)
    if link is None and a != b and plan.network.cross_group_gbps is not None:
        link = plan.network.cross_group_gbps
    if link is None:
        link = float(min(plan.network.inter_node_gbps.get(x, catalog.accelerator(x).inter_node_gbps) for x in (a, b)))
    return line_rate_gbps(plan, link)


def group_link_gbps(plan: Plan, catalog: Any, a: str, b: str) -> float:
    """Gbit/s between a node of one group on accelerator ``a`` and a node of another group on ``b``: the
    measured ``network.links`` pair, else ``network.cross_group_gbps`` whatever the two kinds (groups are separate
    offers or slices: TPU slices of one kind meet only over the data-centre network), else the slower NIC
    (:func:`node_link_gbps`)."""
    if plan.network.link_gbps(a, b) is None and plan.network.cross_group_gbps is not None:
        return line_rate_gbps(plan, plan.network.cross_group_gbps)
    return node_link_gbps(plan, catalog, a, b)


def _cross_node_costs(plan: Plan, g: Group, catalog: Any, mn: Any, mbs: np.ndarray,
                      costs: dict[str, np.ndarray]) -> None:
    """Pipeline sends between stages on different accelerators leave the node over the link between the
    two kinds (:func:`node_link_gbps`), shared by the stage's TP ranks; so does the tied-embedding
    all-reduce when the first and last stage sit on different kinds (updates ``costs`` in place)."""
    stages = g.expanded_stages()

    def per_device_gb_per_s(a: str, b: str, tp: int) -> float:
        return node_link_gbps(plan, catalog, a, b) / 8.0 * C.NETWORK_EFFICIENCY / tp

    p2p = costs["p2p"]
    for i in range(len(stages) - 1):
        a, b = stages[i], stages[i + 1]
        if a.accelerator == b.accelerator and plan.network.link_gbps(a.accelerator, b.accelerator) is None:
            continue
        bw = per_device_gb_per_s(a.accelerator, b.accelerator, max(a.tp, b.tp)) * 1e9
        send = mbs * mn.seq_len * mn.h * mn.bytes_per_value / a.tp / bw + C.COLLECTIVE_LATENCY_S
        p2p[i] = np.maximum(p2p[i], send)
    first, last = stages[0], stages[-1]
    if mn.tie and len(stages) > 1 and first.accelerator != last.accelerator:
        bw = per_device_gb_per_s(first.accelerator, last.accelerator, max(first.tp, last.tp))
        tied = ring_allreduce_s(mn.vocab * mn.h / last.tp * mn.grad_bytes_per_value, 2.0, bw)
        costs["tied_s"][-1] = np.maximum(costs["tied_s"][-1], tied)


def _eval_group(plan: Plan, gi: int, g: Group, catalog: Any, mn: Any, sequences: int,
                profiles: dict[str, ModelProfile]) -> _GroupEval:
    per_replica = sequences // g.replicas
    if g.micro_batch is not None:
        mbs = np.array([g.micro_batch], dtype=np.int64)
    else:
        mbs = np.array(_divisors(per_replica), dtype=np.int64)
    m = per_replica // mbs
    rows = _stage_rows(plan, g, catalog, mbs, m, profiles)
    pp = rows.tp.shape[0]
    best_eval: _GroupEval | None = None
    best_key: tuple[float, float] = (np.inf, np.inf)
    for schedule, v in _schedule_options(plan, g):
        mn_s = replace(mn, schedule=schedule, virtual_stages=float(v), cp=float(g.cp))
        costs = stage_costs(mn_s, rows)
        _cross_node_costs(plan, g, catalog, mn_s, mbs, costs)
        per_stage = [{key: val[i] for key, val in costs.items()} for i in range(pp)]
        ones = np.ones(rows.tp.shape[1])
        out = combine(mn_s, per_stage, [ones] * pp, rows.pp[0], rows.num_micro_batches[0])
        step = out["step_time_s"]
        if schedule == "interleaved" and "schedule" not in plan.train.model_fields_set:
            # Megatron's interleaved schedule needs the micro-batch count to be a multiple of the stages
            step = np.where(m % pp == 0, step, np.inf)
        fits = out["fits"]
        if fits.any():
            best = int(np.argmin(np.where(fits, step, np.inf)))
        else:
            best = int(np.argmin(out["memory_gb"] - out["capacity_gb"]))
        key = (0.0 if fits[best] else 1.0, float(step[best]) if fits[best] else float(
            out["memory_gb"][best] - out["capacity_gb"][best]))
        if key < best_key:
            best_key = key
            best_eval = _GroupEval(costs, out, mbs, m, best, schedule, v)
    assert best_eval is not None
    return best_eval


def _split_batch(plan: Plan, catalog: Any, mn: Any, profiles: dict[str, ModelProfile]) -> list[int]:
    """Sequences per step for each group (given shares, or proportional to speed)."""
    gb = plan.train.global_batch
    groups = plan.groups
    if len(groups) == 1:
        shares = [1.0]
    elif all(g.batch_share is not None for g in groups):
        shares = [float(g.batch_share) for g in groups]  # type: ignore[arg-type]
    else:
        # speed of each group at an even provisional split, then proportional to speed
        speeds = []
        for gi, g in enumerate(groups):
            unit = g.replicas * (g.micro_batch or 1)
            provisional = max(unit, gb // len(groups) // unit * unit)
            ev = _eval_group(plan, gi, g, catalog, mn, provisional, profiles)
            speeds.append(provisional / float(ev.out["step_time_s"][ev.best]))
        given = sum(g.batch_share or 0.0 for g in groups)
        free = [i for i, g in enumerate(groups) if g.batch_share is None]
        total_speed = sum(speeds[i] for i in free)
        shares = [g.batch_share if g.batch_share is not None else (1.0 - given) * speeds[i] / total_speed
                  for i, g in enumerate(groups)]
    seqs = []
    for gi, (g, share) in enumerate(zip(groups, shares, strict=True)):
        unit = g.replicas * (g.micro_batch or 1)
        exact = share * gb
        n = round(exact / unit) * unit
        if g.batch_share is None:
            n = max(n, unit)  # every group gets at least one micro-batch per replica
        if g.batch_share is not None and abs(n - exact) > 1e-6:
            raise ConfigError(
                f"groups[{gi}].batch_share: {g.batch_share} of train.global_batch={gb} is {exact:g} sequences, "
                f"not a multiple of replicas x micro_batch = {unit}; change the share or the batch",
                loc=("groups", gi, "batch_share"),
            )
        seqs.append(n)
    diff = gb - sum(seqs)
    if diff:
        # give the remainder to a group whose unit divides it (the one with the most sequences first)
        order = sorted(range(len(groups)), key=lambda i: -seqs[i])
        for i in order:
            unit = groups[i].replicas * (groups[i].micro_batch or 1)
            movable = groups[i].batch_share is None or len(groups) == 1
            if movable and diff % unit == 0 and seqs[i] + diff > 0:
                seqs[i] += diff
                diff = 0
                break
    for gi, (g, n) in enumerate(zip(groups, seqs, strict=True)):
        unit = g.replicas * (g.micro_batch or 1)
        if diff or n <= 0 or n % unit:
            what = f"replicas={g.replicas}" + (f" x micro_batch={g.micro_batch}" if g.micro_batch else "")
            raise ConfigError(
                f"train.global_batch: {gb} sequences cannot be divided into micro-batches over "
                f"groups[{gi}] ({what}); use a global_batch that is a multiple of {unit}"
                + (" per group share" if len(groups) > 1 else ""), loc=("train", "global_batch"),
            )
    return seqs


def estimate(plan: Plan, catalog: Any = None, spec: Any = None) -> Estimate:
    """Estimate a plan (see module docstring). ConfigError names the field of an inconsistent plan."""
    catalog, spec = _resolve(plan, catalog, spec)
    check_plan(plan, spec, catalog)
    shape = ModelShape.from_spec(spec)
    train = TrainShape.from_train(plan.train)
    mn = model_numbers(shape, train)
    profiles = plan_profiles(plan, shape)
    seqs = _split_batch(plan, catalog, mn, profiles)
    warnings: list[str] = []

    groups: list[GroupEstimate] = []
    evals: list[_GroupEval] = []
    for gi, (g, n) in enumerate(zip(plan.groups, seqs, strict=True)):
        ev = _eval_group(plan, gi, g, catalog, mn, n, profiles)
        evals.append(ev)
        b = ev.best
        stages = []
        for si, st in enumerate(g.expanded_stages()):
            total = float(ev.costs["memory_gb"][si, b])
            cap = float(ev.costs["capacity_gb"][si, b])
            stages.append(StageMemory(
                accelerator=st.accelerator, tp=st.tp, layers=st.layers,
                weights_gb=float(ev.costs["weights_gb"][si, b]), grads_gb=float(ev.costs["grads_gb"][si, b]),
                optimizer_gb=float(ev.costs["optimizer_gb"][si, b]),
                activations_gb=float(ev.costs["activations_gb"][si, b]),
                total_gb=total, capacity_gb=cap, margin_gb=cap - total,
                flat_grad_segment_gb=float(ev.costs["flat_grad_segment_gb"][si, b])))
        parts = {name: float(ev.out[key][b]) for name, key in zip(
            PART_NAMES, ("compute_s", "memory_s", "tp_comm_s", "dp_comm_s", "pp_comm_s", "bubble_s"), strict=True)}
        fits = bool(ev.out["fits"][b])
        if not fits:
            worst = min(stages, key=lambda s: s.margin_gb)
            warnings.append(
                f"groups[{gi}] does not fit: a {worst.accelerator} device needs {worst.total_gb:.1f} GB of "
                f"{worst.capacity_gb:.1f} GB usable; use more tp/pp/replicas, a higher zero_stage, recompute "
                "or a smaller micro_batch")
        groups.append(GroupEstimate(
            index=gi, num_devices=g.num_devices, batch_share=n / plan.train.global_batch, sequences_per_step=n,
            micro_batch=int(ev.micro_batches[b]), num_micro_batches=int(ev.m[b]),
            schedule=ev.schedule, virtual_stages=ev.virtual_stages,
            step_time_s=float(ev.out["step_time_s"][b]), breakdown=parts, stages=stages, fits=fits))

    extra = _cross_group_s(plan, catalog, mn, evals) if len(groups) > 1 else np.zeros(1)
    slowest_i = int(np.argmax([g.step_time_s + float(x) for g, x in zip(groups, extra, strict=True)]))
    slowest = groups[slowest_i]
    breakdown = dict(slowest.breakdown)
    sync = float(extra[slowest_i])
    breakdown["cross_group_sync"] = sync
    step = slowest.step_time_s + sync
    tokens_per_s = plan.train.global_batch * plan.train.seq_len / step
    num_devices = plan.num_devices
    peak_sum = 0.0
    power_w = 0.0
    for g in plan.groups:
        for st in g.stages:
            acc = catalog.accelerator(st.accelerator)
            peak_sum += g.replicas * g.cp * st.tp * st.repeat * C.peak_tflops(acc, plan.train.precision)
            power_w += g.replicas * g.cp * st.tp * st.repeat * acc.tdp_w
    flops_per_token = mn.model_flops_per_token()
    model_tflops = flops_per_token * tokens_per_s / 1e12
    hw_tflops = _hardware_flops_per_token(mn, plan) * tokens_per_s / 1e12
    parts_for_bottleneck = {k: v for k, v in breakdown.items()}
    parts_for_bottleneck["dp_comm"] = parts_for_bottleneck["dp_comm"] + parts_for_bottleneck.pop("cross_group_sync")
    bottleneck = max(parts_for_bottleneck, key=lambda k: parts_for_bottleneck[k])

    cost_per_hour, currency = _cost_per_hour(plan, catalog, warnings)
    cost_per_mtok = None if cost_per_hour is None else cost_per_hour / (tokens_per_s * 3600.0) * 1e6
    all_stages = [s for g in groups for s in g.stages]
    worst = min(all_stages, key=lambda s: s.margin_gb)
    job_hours = None
    if plan.train.tokens is not None:
        job_hours = plan.train.tokens / tokens_per_s / 3600.0
    elif plan.train.steps is not None:
        job_hours = plan.train.steps * step / 3600.0
    job_cost = None if job_hours is None or cost_per_hour is None else job_hours * cost_per_hour
    return Estimate(
        step_time_s=step,
        tokens_per_s=tokens_per_s,
        mfu=model_tflops / peak_sum,
        model_tflops_per_device=model_tflops / num_devices,
        hardware_tflops_per_device=hw_tflops / num_devices,
        memory_gb=worst.total_gb,
        capacity_gb=worst.capacity_gb,
        margin_gb=worst.margin_gb,
        fits=all(g.fits for g in groups),
        cost_per_hour=cost_per_hour,
        cost_per_million_tokens=cost_per_mtok,
        currency=currency,
        power_kw=power_w / 1000.0,
        bottleneck=bottleneck,
        breakdown=breakdown,
        groups=groups,
        num_devices=num_devices,
        warnings=warnings,
        job_hours=job_hours,
        job_cost=job_cost,
    )


def _hardware_flops_per_token(mn: Any, plan: Plan) -> float:
    """Executed FLOPs per token: model FLOPs plus the recomputed forward (full: whole layers,
    selective, matmuls and dots: the attention core)."""
    layer = mn.layer_matmul_flops_per_token()
    attn = 4.0 * mn.q_dim * (mn.seq_len + 1.0) / 2.0
    extra = {"none": 0.0, "selective": attn, "matmuls": attn, "dots": attn, "full": layer}[plan.train.recompute]
    extra *= mn.num_layers
    return float(mn.model_flops_per_token() + extra)


def _cross_group_s(plan: Plan, catalog: Any, mn: Any, evals: list[_GroupEval]) -> np.ndarray:
    """Per group, the extra time of the gradient all-reduce between groups, as the planner charges it: with
    ZeRO-2/3 each rank's gradient shard across the groups (:func:`~starverse.costmodel.batch.sharded_sync_s`),
    else (:func:`~starverse.costmodel.batch.joint_sync_s`) each pipeline stage syncs
    its slice in parallel, each TP rank its shard, in one ring over every group's data- and
    context-parallel replicas; between groups at the slowest link between two groups' kinds (:func:`group_link_gbps`),
    inside a group at its slowest stage's own ring bus."""
    kinds = [{st.accelerator for st in g.stages} for g in plan.groups]
    gbps = min(group_link_gbps(plan, catalog, a, b)
               for i, ka in enumerate(kinds) for kb in kinds[i + 1:] for a in ka for b in kb)
    stages_min = min(g.num_stages for g in plan.groups)
    trainable = (mn.num_layers * (mn.params_per_layer if mn.mode == "full" else mn.adapter_params_per_layer)
                 + (mn.embedding_params + mn.lm_head_params if mn.mode == "full" else 0.0))
    # one ring per TP rank: each reduces its 1/tp shard of the stage's gradients
    tp = max(st.tp for g in plan.groups for st in g.stages)
    per_ring = trainable * mn.grad_bytes_per_value / stages_min / tp
    replicas = [g.replicas * g.cp for g in plan.groups]
    if plan.train.zero_stage >= 2:
        # each group's replicas shard the gradients: only each rank's shard crosses between the groups
        dpn = [float(max(plan.network.node_size(catalog.accelerator(st.accelerator)) for st in g.stages))
               for g in plan.groups]
        return sharded_sync_s(per_ring, replicas, dpn, gbps)
    bus = [float(np.min(ev.costs["dp_bus"][:, ev.best])) for ev in evals]
    share = [float(np.min(ev.costs["dp_share"][:, ev.best])) for ev in evals]
    return joint_sync_s(per_ring, replicas, bus, share, gbps)


def _cost_per_hour(plan: Plan, catalog: Any, warnings: list[str]) -> tuple[float | None, str]:
    """Plan pricing (converted to USD when the catalog knows the rate), else the cheapest catalog offer."""
    currency = "USD"
    total = 0.0
    for acc_id in plan.accelerators():
        count = sum(g.replicas * g.cp * st.tp * st.repeat for g in plan.groups for st in g.stages
                    if st.accelerator == acc_id)
        price: float | None = None
        if plan.pricing is not None and acc_id in plan.pricing.price_per_hour:
            price = plan.pricing.price_per_hour[acc_id]
            ccy = plan.pricing.currency
            if ccy.upper() != "USD":
                try:
                    price = float(catalog.convert(price, ccy, "USD"))
                except (StarverseError, AttributeError):
                    # no exchange rate: keep the plan's own currency if it is the only one
                    if len(plan.accelerators()) == 1:
                        currency = ccy
                    else:
                        price = None
        else:
            price = cheapest_price_per_hour(catalog, acc_id, "USD")
        if price is None:
            warnings.append(f"no price for '{acc_id}': add pricing.price_per_hour.{acc_id} to the plan")
            return None, currency
        total += count * price
    return total, currency
