"""What one planner search shares, and the exact evaluation of a candidate (helpers of :mod:`~starverse.planner.search`).

:class:`SearchContext` holds the job, pool, model and cost tables of one search (one training mode);
:func:`evaluate_combo` values one combination of options exactly (integer batch split, cross-group sync, spot
overhead, constraints); :func:`combo_plan` and :func:`pipeline_plan` turn a result into a
:class:`~starverse.plan.Plan`. The bounds of the search use the same :func:`sync_s` and :func:`spot_factor`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from starverse.costmodel.batch import DeviceTable, ModelShape, TrainShape, joint_sync_s, sharded_sync_s
from starverse.costmodel.comm import dp_ring_bus
from starverse.costmodel.constants import BYTES_PER_VALUE
from starverse.costmodel.profile import check_profile_fits
from starverse.plan import Group, Plan
from starverse.planner import combine, hostmem, pipekinds, pipes, space
from starverse.planner.build import (
    NOMINAL_TOKENS,
    checkpoint_bytes,
    network_for,
    pricing_for,
    stages_even,
    train_spec,
    trainable_params,
)
from starverse.planner.job import Job
from starverse.planner.policy import Layout, Limits, billed_hours, note_layout_refusal, score, within
from starverse.planner.pool import Pool

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


@dataclass
class SearchContext:
    """Everything one search (one training mode) shares."""

    job: Job
    pool: Pool
    catalog: Any
    spec: Any
    mode: str
    model: ModelShape
    train: TrainShape
    devices: DeviceTable
    settings: list[space.Setting]
    limits: Limits
    tokens: float | None
    state_bytes: float
    grad_bytes: float

    @property
    def budget_per_hour(self) -> float | None:
        return self.limits.budget_per_hour

    @property
    def batch(self) -> int:
        return self.job.train.global_batch

    @property
    def seq_len(self) -> int:
        return self.job.train.seq_len


@dataclass(frozen=True)
class Combo:
    """An exactly evaluated combination (internal)."""

    setting: int
    options: tuple[int, ...]
    shares: tuple[int, ...]
    step_time_s: float
    tps: float
    tps_eff: float
    factor: float
    cost_per_hour: float
    power_kw: float
    hours: float
    total_cost: float
    value: float


def search_context(job: Job, pool: Pool, catalog: Any, spec: Any, mode: str) -> SearchContext:
    t = job.train
    train = TrainShape(seq_len=t.seq_len, precision=t.precision, mode=mode, lora_rank=t.lora_rank,
                       optimizer=t.optimizer)
    accs = [catalog.accelerator(o.accelerator) for o in pool.offers]
    shape = ModelShape.from_spec(spec)
    for o in pool.offers:
        if o.profile is not None:
            check_profile_fits(o.profile, o.accelerator, shape, o.profile_source)
    devices = DeviceTable.from_accelerators(
        accs, t.precision,
        devices_per_node=[o.devices_per_node for o in pool.offers],
        inter_node_gbps=[o.inter_node_gbps for o in pool.offers],
        price_per_hour=[o.price_per_hour for o in pool.offers],
        profiles=[o.profile for o in pool.offers],
        collective_gb_per_s=[dict(o.collective_gb_per_s) for o in pool.offers],
    )
    trainable = trainable_params(spec, mode, t.lora_rank)
    state_bytes = checkpoint_bytes(trainable, t.precision)
    grad_bytes = trainable * BYTES_PER_VALUE[t.precision]
    sets = space.settings(t.zero_stage, t.recompute, t.offload, pipeline=False,
                          max_virtual_stages=job.search.max_virtual_stages)
    return SearchContext(job, pool, catalog, spec, mode, shape, train, devices, sets,
                limits_of(job, pool, catalog), t.total_tokens, state_bytes, grad_bytes)


def limits_of(job: Job, pool: Pool, catalog: Any) -> Limits:
    """The job's constraints with its money limits converted to the pool's currency."""
    from starverse.catalog import convert

    c = job.constraints
    ccy = c.currency or pool.currency

    def money(x: float | None) -> float | None:
        return None if x is None else convert(x, ccy, pool.currency, catalog=catalog)

    return Limits(money(c.max_budget_per_hour), c.max_power_kw, c.deadline_hours, money(c.max_total_cost))


def host_fits(ctx: SearchContext, opts: space.Options) -> npt.NDArray[np.bool_]:
    """Options whose offloaded state fits their nodes' RAM (:mod:`~starverse.planner.hostmem`)."""
    z = np.array([st.zero_stage for st in ctx.settings], dtype=np.int64)[opts.setting]
    off = np.array([st.offload for st in ctx.settings], dtype=np.int64)[opts.setting]
    offers = ctx.pool.offers
    dpn = np.array([o.devices_per_node for o in offers], dtype=np.float64)[opts.offer]
    host = np.array([np.nan if o.host_memory_gb is None else o.host_memory_gb for o in offers])[opts.offer]
    need = hostmem.uniform_host_gb_per_node(ctx.model, ctx.train, opts.tp, opts.pp, opts.replicas, z, off, dpn)
    return hostmem.host_ok(need, host)


def spot_factor(ctx: SearchContext, lam: FloatArray, nodes: FloatArray) -> FloatArray:
    return pipekinds.spot_factor_of(ctx, lam, nodes)


def sync_s(ctx: SearchContext, num_groups: int, min_pp: int, gbps: float | None = None,
           opts: space.Options | None = None, members: Sequence[int] | None = None, zero_stage: int = 0) -> float:
    """Cross-group gradient all-reduce, as the scalar cost model charges it
    (:func:`~starverse.costmodel.batch.joint_sync_s`): each pipeline stage (the shallowest pipeline sets the
    slice) and TP rank syncs its shard in one ring over every member's replicas, over the link between the
    groups' offers (``gbps``: the slowest measured ``network.links`` among them, default
    ``cross_offer_gbps``); the largest per-member extra over the member's own ring. With ZeRO-2/3
    (``zero_stage``) only each rank's gradient shard is all-reduced across the members
    (:func:`~starverse.costmodel.batch.sharded_sync_s`). Without ``opts`` and ``members``: one replica per group
    on the full link (the ring of ``num_groups`` ranks)."""
    if num_groups <= 1:
        return 0.0
    link = ctx.pool.cross_offer_gbps if gbps is None else gbps
    stage_bytes = ctx.grad_bytes / max(min_pp, 1)
    if opts is None or members is None:
        ones = [1.0] * num_groups
        return float(joint_sync_s(stage_bytes, ones, [np.inf] * num_groups, ones, link).max())
    idx = np.asarray(members, dtype=np.int64)
    rows = opts.offer[idx]
    dev = ctx.devices
    if zero_stage >= 2:
        return float(sharded_sync_s(stage_bytes / float(opts.tp[idx].max()), opts.replicas[idx].tolist(),
                                    dev.devices_per_node[rows].tolist(), link).max())
    bus, share = dp_ring_bus(opts.replicas[idx], opts.tp[idx], dev.intra_node_at(rows, opts.tp[idx]),
                             dev.devices_per_node[rows], dev.inter_node_gbps[rows])
    return float(joint_sync_s(stage_bytes / float(opts.tp[idx].max()), opts.replicas[idx].tolist(),
                              bus.tolist(), share.tolist(), link).max())


def combo_layout(ctx: SearchContext, opts: space.Options, setting: int, members: Sequence[int]) -> Layout:
    """The shape of a combination's plan (its groups' even splits, tp, backends) for the runtime layout rule."""
    groups = []
    for i in members:
        acc = ctx.pool.offers[int(opts.offer[i])].accelerator
        backend = ctx.catalog.accelerator(acc).backend
        tp = int(opts.tp[i])
        groups.append(tuple((s.layers, tp, backend) for s in stages_even(acc, tp, int(opts.pp[i]),
                                                                          int(ctx.spec.num_layers))
                            for _ in range(s.repeat)))
    st = ctx.settings[setting]
    return Layout(tuple(groups), st.zero_stage, st.offload > 0, ctx.mode)


def evaluate_combo(ctx: SearchContext, opts: space.Options, tables: FloatArray, power: FloatArray, setting: int,
              members: Sequence[int], layout_refused: dict[str, int] | None = None) -> Combo | None:
    """Exact value of one combination (None if no integer split exists or a constraint fails; ``layout_refused``
    counts those the runtime layout rule leaves out)."""
    t_star, shares = combine.best_split([tables[i] for i in members], ctx.batch)
    if not math.isfinite(t_star):
        return None
    offers = [ctx.pool.offers[int(opts.offer[i])] for i in members]
    n = [int(opts.num_devices[i]) for i in members]
    step = t_star + sync_s(ctx, len(members), min(int(opts.pp[i]) for i in members),
                            ctx.pool.slowest_link_gbps(o.name for o in offers), opts, members,
                            ctx.settings[setting].zero_stage)
    lam = sum(k * o.interruptions_per_hour for k, o in zip(n, offers, strict=True))
    nodes = sum(math.ceil(k / o.devices_per_node) for k, o in zip(n, offers, strict=True))
    factor = float(spot_factor(ctx, np.asarray(lam, dtype=float), np.asarray(nodes, dtype=float)))
    if not math.isfinite(factor):
        return None
    tps = ctx.batch * ctx.seq_len / step
    tps_eff = tps / factor
    price = sum(k * o.price_per_hour for k, o in zip(n, offers, strict=True))
    pw = float(sum(power[i] for i in members))
    tokens = ctx.tokens if ctx.tokens is not None else NOMINAL_TOKENS
    hours = tokens / tps_eff / 3600.0
    total = float(sum(k * o.price_per_hour * billed_hours(np.asarray(hours), o.billing_granularity_s)
                      for k, o in zip(n, offers, strict=True)))
    layout = combo_layout(ctx, opts, setting, members)
    if not within(ctx.limits, price, pw, hours, total, layout):
        note_layout_refusal(layout_refused if layout_refused is not None else {}, layout)
        return None
    value = float(score(ctx.job.objective, np.asarray(tps_eff), np.asarray(price), np.asarray(total),
                        np.asarray(hours)))
    return Combo(setting, tuple(int(i) for i in members), shares, step, tps, tps_eff, factor, price, pw,
                  hours, total, value)


def combo_plan(ctx: SearchContext, opts: space.Options, combo: Combo) -> tuple[Plan, dict[str, int]]:
    groups = []
    devices: dict[str, int] = {}
    for i, s in zip(combo.options, combo.shares, strict=True):
        offer = ctx.pool.offers[int(opts.offer[i])]
        groups.append(Group(
            replicas=int(opts.replicas[i]), micro_batch=int(opts.micro_batch[i]),
            batch_share=s / ctx.batch if len(combo.options) > 1 else None,
            stages=stages_even(offer.accelerator, int(opts.tp[i]), int(opts.pp[i]), int(ctx.spec.num_layers)),
        ))
        devices[offer.name] = int(opts.num_devices[i])
    sp = any(int(opts.tp[i]) > 1 for i in combo.options)
    st = ctx.settings[combo.setting]
    plan = Plan(
        model=ctx.job.model, train=train_spec(ctx.job, ctx.mode, st, sp, "interleaved" if st.virtual_stages > 1
                                              else "1f1b", st.virtual_stages),
        groups=groups, network=network_for(ctx.pool, list(devices)), pricing=pricing_for(ctx.pool, list(devices)),
    )
    return plan, devices


def pipe_devices(ctx: SearchContext, pipe: pipes.Pipeline) -> dict[str, int]:
    return {ctx.pool.offers[o].name: n for o, n in pipe.devices().items()}


def pipeline_plan(ctx: SearchContext, pipe: pipes.Pipeline) -> Plan:
    """The :class:`~starverse.plan.Plan` of a heterogeneous pipeline found by :mod:`~starverse.planner.pipes`."""
    from starverse.planner.hetero import stage_runs

    offers = ctx.pool.offers
    accs = [offers[o].accelerator for o, _, k in pipe.blocks for _ in range(k)]
    tps = [t for _, t, k in pipe.blocks for _ in range(k)]
    names = [offers[o].name for o, _, _ in pipe.blocks]
    return Plan(
        model=ctx.job.model,
        train=train_spec(ctx.job, ctx.mode, ctx.settings[pipe.setting], any(t > 1 for t in tps), pipe.schedule,
                         pipe.virtual_stages),
        groups=[Group(replicas=pipe.replicas, micro_batch=pipe.micro_batch,
                      stages=stage_runs(accs, tps, list(pipe.layers)))],
        network=network_for(ctx.pool, names), pricing=pricing_for(ctx.pool, names),
    )
