"""Stage kinds of the heterogeneous-pipeline search (:mod:`.pipes`): the cost model's rows for a stage, the
per-layer time and memory caps by place of each (offer, TP) kind in one family (replicas, micro-batch, memory
setting), the capacity tables the bounds read (:mod:`.pipebound`), and the exact pipeline found."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from starverse.costmodel.group import attention_rates, measured_times, model_numbers
from starverse.costmodel.rows import ModelNumbers, StageRows
from starverse.costmodel.shapes import Candidates
from starverse.costmodel.stage import stage_costs
from starverse.planner.policy import checkpoint_seconds, spot_factor

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Pipeline:
    """An exactly evaluated heterogeneous pipeline."""

    setting: int
    replicas: int
    micro_batch: int
    blocks: tuple[tuple[int, int, int], ...]
    """(offer index, tp, stages) in pipeline order."""
    layers: tuple[int, ...]
    """Layers per stage."""
    step_time_s: float
    cost_per_hour: float
    power_kw: float
    hours: float
    total_cost: float
    value: float
    schedule: str = "1f1b"
    """1f1b or interleaved."""
    virtual_stages: int = 1
    """Model chunks per device (interleaved)."""

    def devices(self) -> dict[int, int]:
        """Devices per offer index."""
        return {o: self.replicas * t * k for o, t, k in self.blocks}


def stage_rows(ctx: Any, offer: IntArray, tp: FloatArray, layers: FloatArray, first: Any, last: Any,
               stage_index: FloatArray, pp: float, r: Any, mb: Any, m: Any, setting: Any, sp: bool) -> StageRows:
    """Cost-model rows of stages (``r``, ``mb``, ``m`` and the memory ``setting`` per row or for all)."""
    d = ctx.devices
    n = offer.shape[0]
    sets = ctx.settings
    if isinstance(setting, int | np.integer):
        st = sets[setting]
        zero, rc, off = st.zero_stage, st.recompute, st.offload
    else:
        zero, rc, off = (np.array([getattr(x, f) for x in sets])[setting]
                         for f in ("zero_stage", "recompute", "offload"))

    def full(x: Any) -> FloatArray:
        return np.array(np.broadcast_to(np.asarray(x, dtype=np.float64), (n,)))

    cand = Candidates.make(accelerator=offer, tp=tp.astype(np.int64), pp=int(pp), replicas=r, micro_batch=mb,
                           num_micro_batches=m)
    measured: dict[str, Any] = dict(measured_times(d, cand, ctx.train))
    if d.host_collectives is not None:  # CPU ranks: gloo collectives pay a per-call latency (costmodel.comm)
        measured["host_collectives"] = d.host_collectives[offer]
    return StageRows(
        **measured,
        peak_tflops=d.peak_tflops[offer], gemm_efficiency=d.gemm_efficiency[offer], memory_gb=d.memory_gb[offer],
        memory_bw_gb_per_s=d.memory_bw_gb_per_s[offer], intra_node_gb_per_s=d.intra_node_at(offer, tp),
        devices_per_node=d.devices_per_node[offer].astype(np.float64), inter_node_gbps=d.inter_node_gbps[offer],
        tp=tp, layers=layers, first=np.broadcast_to(np.asarray(first, dtype=bool), (n,)),
        last=np.broadcast_to(np.asarray(last, dtype=bool), (n,)), stage_index=stage_index, pp=full(pp),
        replicas=full(r), micro_batch=full(mb), num_micro_batches=full(m), zero_stage=full(zero),
        recompute=full(rc), offload=full(off), sequence_parallel=np.full(n, sp),
        pipeline_devices=full(1.0),
        flash_attention=np.ones(n, dtype=bool) if d.flash_attention is None else d.flash_attention[offer],
        attention_tflops=attention_rates(d, ctx.train.attention, offer),
        compiled_memory=None if d.compiled_memory is None else d.compiled_memory[offer],
        matrix_unit=None if d.matrix_unit is None else d.matrix_unit[offer],
    )


def interleave_options(total: int, m: int, p: int, most: int) -> list[int]:
    """The chunk counts ``v ≥ 2`` of the interleaved 1F1B schedule a ``p``-stage pipeline of ``total`` layers
    and ``m`` micro-batches can run: ``m`` a multiple of ``p`` (torch's ScheduleInterleaved1F1B) and ``v``
    dividing ``total`` with at least ``v`` layers per stage (the search gives every stage a multiple of
    ``v``; other splits are not searched), ``v ≤ most`` (``search.max_virtual_stages``)."""
    if p < 2 or m % p:
        return []
    return [v for v in range(2, min(total // p, most) + 1) if total % v == 0]


def interleave_vmax(total: int, m: int, pmin: int, most: int) -> int:
    """The largest ``v`` of :func:`interleave_options` over pipelines of at least ``pmin`` stages (1 if
    none): the bounds take the smallest bubble any searched schedule gives."""
    deep = [p for p in range(max(pmin, 2), min(m, total) + 1) if m % p == 0]
    return max([1, *interleave_options(total, m, deep[0], most)]) if deep else 1


def model_numbers_1f1b(ctx: Any) -> ModelNumbers:
    return replace(model_numbers(ctx.model, ctx.train), schedule="1f1b", virtual_stages=1.0)


@dataclass
class Kinds:
    """Stage kinds (offer, tp) of one family (r, mb, setting): per-layer time lower bound and memory caps."""

    offer: IntArray
    tp: IntArray
    a: FloatArray
    per: IntArray
    """(kinds, stages): ``cap_j``, the most layers a stage of the kind holds with the ``j``-th least number of
    micro-batches in flight a stage of a block can have (:func:`_kinds`); never grows with ``j``."""
    kmax: IntArray
    p2p: FloatArray
    """A stage's point-to-point time at its least (two stages, so as likely as it gets inside one node)."""
    opt: FloatArray
    """Optimizer step of a one-layer middle stage (the least any stage of the kind takes)."""
    opt_layer: FloatArray
    """Optimizer step per layer at least (``O(L) ≥ L · opt_layer``; ``O`` is affine in ``L``)."""


def family_kinds(ctx: Any, r: int, mb: int, setting: int, caps: list[int], tps: list[list[int]], total: int,
                 max_stages: int) -> Kinds:
    """The stage kinds of a family with their bounds (:func:`families_kinds` of one family)."""
    return families_kinds(ctx, [(r, mb, setting)], caps, tps, total, max_stages)[0]


def families_kinds(ctx: Any, fams: list[tuple[int, int, int]], caps: list[int], tps: list[list[int]], total: int,
                   max_stages: int) -> list[Kinds]:
    """The stage kinds of each family ``(r, mb, setting)`` with their bounds (one cost-model call for all).

    Memory caps by place: under 1F1B the stage ``i`` places from the end keeps ``min(i, m)`` micro-batches
    of activations, so the ``k`` stages of one kind, wherever they stand, keep at least ``min(1, m), …,
    min(k, m)`` (sorted); a middle stage's memory is affine in its layers ``L`` and in the micro-batches in
    flight ``j`` (``base + L (w + j · act)``, the cost model's own terms, first and last stages only add), so
    the ``k`` stages hold at most ``Σ_{j ≤ k} cap(min(j, m))`` layers, and no block is longer than the last
    ``k`` with ``cap(min(k, m)) ≥ 1``."""
    offer = np.array([o for o, ts in enumerate(tps) for _ in ts], dtype=np.int64)
    tp = np.array([t for ts in tps for t in ts], dtype=np.int64)
    if offer.size == 0 or not fams:
        z = np.zeros(0, dtype=np.int64)
        return [Kinds(z, z, np.zeros(0), np.zeros((0, 1), dtype=np.int64), z, np.zeros(0), np.zeros(0),
                      np.zeros(0)) for _ in fams]
    nf, n = len(fams), offer.size
    r, mb, si = (np.array([f[i] for f in fams], dtype=np.int64) for i in range(3))
    m = ctx.batch // (r * mb)
    sp = bool((tp > 1).any())
    lmax = total - 1
    # rows (family, row, kind); per family the rows (L, in flight) = (1, 1), (2, 1), (lmax, 1), (1, 2): a middle
    # stage (index 1) of a pp-deep pipeline
    shape = (nf, 4, n)
    lay = np.broadcast_to(np.array([1.0, 2.0, float(lmax), 1.0])[None, :, None], shape).ravel()
    pp = np.broadcast_to(np.array([2.0, 2.0, 2.0, 3.0])[None, :, None], shape).ravel()
    o3 = np.broadcast_to(offer, shape).ravel()
    t3 = np.broadcast_to(tp, shape).ravel().astype(np.float64)

    def per_family(x: IntArray) -> IntArray:
        return np.broadcast_to(x[:, None, None], shape).ravel()

    rows = stage_rows(ctx, o3, t3, lay, False, False, np.ones(o3.size), 2.0, per_family(r), per_family(mb),
                      per_family(m), per_family(si), sp)
    c = stage_costs(model_numbers_1f1b(ctx), replace(rows, pp=pp))
    s = c["stage_mb"].reshape(shape)
    mem = c["memory_gb"].reshape(shape)
    capacity = c["capacity_gb"].reshape(shape)[:, 0]
    a = np.minimum(s[:, 0], s[:, 2] / lmax)  # (families, kinds)
    act = np.where((m >= 2)[:, None], mem[:, 3] - mem[:, 0], 0.0)  # one more micro-batch in flight, per layer
    w = mem[:, 1] - mem[:, 0] - act  # per layer at no activation
    base = mem[:, 0] - w - act
    kk = np.minimum(np.arange(1, min(total, max_stages) + 1, dtype=np.float64)[None, :], m[:, None])  # in flight
    slope = w[:, :, None] + kk[:, None, :] * act[:, :, None]  # (families, kinds, stages)
    with np.errstate(divide="ignore", invalid="ignore"):
        room = (capacity - base)[:, :, None]
        cap_f = np.where(slope > 0, np.floor(room / np.where(slope > 0, slope, 1.0) + 1e-6),
                         np.where(room >= 0, lmax, 0))
    per = np.clip(np.nan_to_num(cap_f, nan=0.0, posinf=lmax, neginf=0.0), 0, lmax).astype(np.int64)
    longest = (per >= 1).cumprod(axis=2).sum(axis=2)  # caps never grow with j
    cnt = np.array([caps[o] for o in offer], dtype=np.int64)
    kmax = np.minimum(np.minimum(cnt[None, :] // (r[:, None] * tp[None, :]), min(total, max_stages)), longest)
    ok = (kmax >= 1) & np.isfinite(a) & (a > 0)
    p2p = c["p2p"].reshape(shape)[:, 0]
    o4 = c["optimizer_s"].reshape(shape)
    opt = o4[:, 0]
    opt_layer = np.minimum(o4[:, 0], o4[:, 2] / lmax)
    return [Kinds(offer[k], tp[k], a[f][k], per[f][k], kmax[f][k], p2p[f][k], opt[f][k], opt_layer[f][k])
            for f, k in enumerate(ok)]


def reach(kinds: Kinds) -> FloatArray:
    """Most layers each kind's longest block can hold."""
    capsum = np.cumsum(kinds.per, axis=1)
    return capsum[np.arange(kinds.kmax.size), kinds.kmax - 1].astype(np.float64)


def capacity_tables(kinds: Kinds, total: int) -> FloatArray:
    """(kinds, stages + 1, total + 1): ``T[κ, k, q] = Σ_{j ≤ k} min(q, cap_j)``, the most layers a block of
    ``k`` stages of kind ``κ`` holds when each stage may take ``q`` (:class:`.pipebound.Tables`)."""
    q = np.arange(total + 1, dtype=np.float64)
    per = np.minimum(q[None, None, :], kinds.per[:, :, None].astype(np.float64))
    n = kinds.per.shape[0]
    return np.concatenate([np.zeros((n, 1, total + 1)), np.cumsum(per, axis=1)], axis=1)


def spot_factor_of(ctx: Any, lam: Any, nodes: Any) -> FloatArray:
    """Young/Daly's wall-time factor of a device set (``lam`` interruptions/h over ``nodes`` nodes that
    write the checkpoint in parallel), as every stage of the search charges it."""
    ckpt = checkpoint_seconds(ctx.state_bytes, 1, ctx.job.search.checkpoint_gb_per_s) / np.maximum(nodes, 1)
    return np.asarray(spot_factor(lam, ckpt, ctx.job.search.restart_s), dtype=np.float64)
