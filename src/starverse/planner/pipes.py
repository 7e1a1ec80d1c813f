"""Heterogeneous pipelines inside the exact search: one pipeline whose stages run on different accelerators.

The space (every point of it is either evaluated exactly or cut by a proven bound):

- one pipeline, ``r`` data-parallel replicas, micro-batch ``mb`` (``r · mb`` divides the batch), 1F1B;
- its stages form *blocks*, one per offer used (at most one offer per accelerator kind, at least two kinds):
  block ``b`` has ``k_b`` stages of TP ``t_b`` (``r · t_b · k_b`` devices of the offer), in any order;
- any integer split of the layers over the stages (each within its memory: :mod:`.pipesplit`);
- every memory setting a pipeline can use (ZeRO ≤ 1, recompute, optimizer offload).

Branch and bound, per (``r``, ``mb``, setting): a depth-first walk over the offers decides for each whether it
is left out or which ``(t, k)`` block it contributes. The bound of a node: the bottleneck stage needs at least
``τ_lb``, the least ``τ`` at which the stages chosen (and, for the offers still open, the most any of their
blocks could hold) cover the model with ``L_i ≤ τ / a_i`` and ``L_i ≤`` the memory cap of the stage kind
(``a_i``: its per-layer time, a lower bound of ``S_i(L) / L``; integer layers per stage); ``(m - 1) max S + Σ S``
is then bounded by :func:`_core_lb` (the bubble included), the sends (at least one crosses two kinds) and the
optimizer step are added, and with the price and power of what is chosen (lower bounds: the open offers may
add nothing) every objective is bounded (``policy.score`` grows with throughput and falls with price, cost and
hours); the money objectives are also capped by tokens/s per unit of price (:func:`_per_price_ub`). A leaf is
evaluated exactly: every order of its blocks, the exact layer split, the cost model's stage costs
(``costmodel.stage.stage_costs``), the spot factor and the constraints — the same terms ``costmodel.estimate``
charges the written plan (a test holds them equal).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from starverse.costmodel import constants as C
from starverse.costmodel.comm import ring_allreduce_s
from starverse.costmodel.group import measured_times, model_numbers
from starverse.costmodel.shapes import Candidates
from starverse.costmodel.stage import ModelNumbers, StageRows, stage_costs
from starverse.planner import hostmem, pipebound, pipesplit, space
from starverse.planner.build import NOMINAL_TOKENS
from starverse.planner.policy import billed_hours, checkpoint_seconds, paid_cost, score, spot_factor, within
from starverse.planner.result import SearchStats

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

MAX_LEAVES = 3_000
"""Exact leaf evaluations (block orders) per search; when reached, the search stops with the bound gap
reported and ``SearchStats.pipelines_proven`` False."""
MAX_NODES = 100_000
"""Branch-and-bound children bounded per search; reaching it stops the search as ``MAX_LEAVES`` does."""


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

    def devices(self) -> dict[int, int]:
        """Devices per offer index."""
        return {o: self.replicas * t * k for o, t, k in self.blocks}


def _rows(ctx: Any, offer: IntArray, tp: FloatArray, layers: FloatArray, first: Any, last: Any,
          stage_index: FloatArray, pp: float, r: int, mb: int, m: int, setting: int, sp: bool) -> StageRows:
    d = ctx.devices
    n = offer.shape[0]
    st = ctx.settings[setting]

    def full(x: float) -> FloatArray:
        return np.full(n, float(x))

    cand = Candidates.make(accelerator=offer, tp=tp.astype(np.int64), pp=int(pp), replicas=r, micro_batch=mb,
                           num_micro_batches=m)
    measured: dict[str, Any] = dict(measured_times(d, cand, ctx.train))
    if d.host_collectives is not None:  # CPU ranks: gloo collectives pay a per-call latency (costmodel.comm)
        measured["host_collectives"] = d.host_collectives[offer]
    return StageRows(
        **measured,
        peak_tflops=d.peak_tflops[offer], gemm_efficiency=d.gemm_efficiency[offer], memory_gb=d.memory_gb[offer],
        memory_bw_gb_per_s=d.memory_bw_gb_per_s[offer], intra_node_gb_per_s=d.intra_node_gb_per_s[offer],
        devices_per_node=d.devices_per_node[offer].astype(np.float64), inter_node_gbps=d.inter_node_gbps[offer],
        tp=tp, layers=layers, first=np.broadcast_to(np.asarray(first, dtype=bool), (n,)),
        last=np.broadcast_to(np.asarray(last, dtype=bool), (n,)), stage_index=stage_index, pp=full(pp),
        replicas=full(r), micro_batch=full(mb), num_micro_batches=full(m), zero_stage=full(st.zero_stage),
        recompute=full(st.recompute), offload=full(st.offload), sequence_parallel=np.full(n, sp),
        pipeline_devices=full(1.0),
        flash_attention=np.ones(n, dtype=bool) if d.flash_attention is None else d.flash_attention[offer],
    )


def _mn(ctx: Any) -> ModelNumbers:
    return replace(model_numbers(ctx.model, ctx.train), schedule="1f1b", virtual_stages=1.0)


@dataclass
class _Kinds:
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


def _kinds(ctx: Any, r: int, mb: int, setting: int, caps: list[int], tps: list[list[int]], total: int,
           max_stages: int) -> _Kinds:
    """The stage kinds of a family with their bounds.

    Memory caps by place: under 1F1B the stage ``i`` places from the end keeps ``min(i, m)`` micro-batches
    of activations, so the ``k`` stages of one kind, wherever they stand, keep at least ``min(1, m), …,
    min(k, m)`` (sorted); a middle stage's memory is affine in its layers ``L`` and in the micro-batches in
    flight ``j`` (``base + L (w + j · act)``, the cost model's own terms, first and last stages only add), so
    the ``k`` stages hold at most ``Σ_{j ≤ k} cap(min(j, m))`` layers, and no block is longer than the last
    ``k`` with ``cap(min(k, m)) ≥ 1``."""
    offer = np.array([o for o, ts in enumerate(tps) for _ in ts], dtype=np.int64)
    tp = np.array([t for ts in tps for t in ts], dtype=np.int64)
    if offer.size == 0:
        z = np.zeros(0, dtype=np.int64)
        return _Kinds(z, z, np.zeros(0), np.zeros((0, 1), dtype=np.int64), z, np.zeros(0), np.zeros(0))
    m = ctx.batch // (r * mb)
    sp = bool((tp > 1).any())
    n = offer.size
    lmax = total - 1
    # rows: (L, in flight) = (1, 1), (2, 1), (lmax, 1), (1, 2): a middle stage (index 1) of a pp-deep pipeline
    three = np.repeat(np.array([1.0, 2.0, float(lmax), 1.0]), n)
    pp = np.repeat(np.array([2.0, 2.0, 2.0, 3.0]), n)
    o3, t3 = np.tile(offer, 4), np.tile(tp, 4).astype(np.float64)
    rows = _rows(ctx, o3, t3, three, False, False, np.ones(4 * n), 2.0, r, mb, m, setting, sp)
    rows = replace(rows, pp=pp)
    c = stage_costs(_mn(ctx), rows)
    s = c["stage_mb"].reshape(4, n)
    mem = c["memory_gb"].reshape(4, n)
    capacity = c["capacity_gb"][:n]
    a = np.minimum(s[0], s[2] / lmax)
    act = mem[3] - mem[0] if m >= 2 else np.zeros(n)  # one more micro-batch in flight, per layer
    w = mem[1] - mem[0] - act  # per layer at no activation
    base = mem[0] - w - act
    kk = np.minimum(np.arange(1, min(total, max_stages) + 1, dtype=np.float64), float(m))  # in flight
    slope = w[:, None] + kk[None, :] * act[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        room = capacity[:, None] - base[:, None]
        cap_f = np.where(slope > 0, np.floor(room / np.where(slope > 0, slope, 1.0) + 1e-6),
                         np.where(room >= 0, lmax, 0))
    per = np.clip(np.nan_to_num(cap_f, nan=0.0, posinf=lmax, neginf=0.0), 0, lmax).astype(np.int64)
    longest = (per >= 1).cumprod(axis=1).sum(axis=1)  # caps never grow with j
    cnt = np.array([caps[o] for o in offer], dtype=np.int64)
    kmax = np.minimum(np.minimum(cnt // (r * tp), min(total, max_stages)), longest)
    ok = (kmax >= 1) & np.isfinite(a) & (a > 0)
    p2p = c["p2p"][:n]
    opt = c["optimizer_s"][:n]
    return _Kinds(offer[ok], tp[ok], a[ok], per[ok], kmax[ok], p2p[ok], opt[ok])


def _reach(kinds: _Kinds) -> FloatArray:
    """Most layers each kind's longest block can hold."""
    capsum = np.cumsum(kinds.per, axis=1)
    return capsum[np.arange(kinds.kmax.size), kinds.kmax - 1].astype(np.float64)


def _tables(kinds: _Kinds, total: int) -> FloatArray:
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


class _Search:
    """One search over heterogeneous pipelines (shared incumbent across families)."""

    def __init__(self, ctx: Any, incumbent: float, stats: SearchStats) -> None:
        self.ctx = ctx
        self.best_value = incumbent
        self.best: Pipeline | None = None
        self.stats = stats
        self.leaves = 0
        self.nodes = 0
        self.gap_bound = -math.inf
        pool = ctx.pool
        self.total = int(ctx.spec.num_layers)
        self.tokens = ctx.tokens if ctx.tokens is not None else NOMINAL_TOKENS
        self.price = np.array([o.price_per_hour for o in pool.offers])
        self.power = np.array([a.tdp_w for a in (ctx.catalog.accelerator(o.accelerator) for o in pool.offers)]) / 1e3
        self.accs = [o.accelerator for o in pool.offers]
        mn = _mn(ctx)
        names = [o.name for o in pool.offers]
        fastest = max([float(pool.cross_offer_gbps)] + [float(pool.link_gbps(a, b)) for i, a in enumerate(names)
                                                       for b in names[i + 1:] if a != b])
        self.hop_s_per_sequence = mn.seq_len * mn.h * mn.bytes_per_value / (fastest / 8.0 * C.NETWORK_EFFICIENCY * 1e9)

    def full(self) -> bool:
        """The caps are reached: the search stops (and is not proven unless its bound closed)."""
        return self.leaves >= MAX_LEAVES or self.nodes >= MAX_NODES

    # ---- bounds -------------------------------------------------------------------------------------
    def bound(self, m: int, mb: int, core: FloatArray, stages: FloatArray, p2p: FloatArray, opt: FloatArray,
              price: FloatArray, power: FloatArray, per_price: FloatArray | None = None) -> FloatArray:
        """Objective bound from ``core`` (a lower bound of ``(m - 1) max S + Σ S``), the stages known to be in
        the pipeline, the largest point-to-point time and optimizer step known (lower bounds of the maxima),
        and for the money objectives ``per_price``, an upper bound of tokens/s per unit of price."""
        ctx = self.ctx
        # at least one send crosses between two kinds, each at least this long
        hop = np.maximum(mb * self.hop_s_per_sequence, p2p)
        p = np.maximum(stages, 2.0)
        step = core + 2.0 * (m + p - 1.0) * hop + opt
        with np.errstate(divide="ignore", invalid="ignore"):
            tps = np.where(np.isfinite(step) & (step > 0), ctx.batch * ctx.seq_len / step, 0.0)
            hours = self.tokens / tps / 3600.0
        total = paid_cost(price, hours)
        val = score(ctx.job.objective, tps, price, total, hours)
        if per_price is not None:
            obj = ctx.job.objective
            with np.errstate(divide="ignore", invalid="ignore"):
                if obj == "cost-performance":
                    val = np.minimum(val, per_price * 3600.0)
                elif obj == "cost":  # total ≥ price × hours = price × tokens / (tokens/s × 3600)
                    val = np.minimum(val, np.where(per_price > 0, -self.tokens / (3600.0 * per_price), -np.inf))
        ok = (tps > 0) & within(ctx.limits, price, power, hours, total)
        return np.where(ok, val, -np.inf)

    # ---- exact leaves ---------------------------------------------------------------------------------
    def leaf(self, r: int, mb: int, setting: int, blocks: list[tuple[int, int, int]], bound: float) -> None:
        """Every order of the blocks, exactly (``bound``: the node's, kept as the gap if the caps stop it)."""
        for order in itertools.permutations(blocks):
            if self.full():
                self.gap_bound = max(self.gap_bound, bound)
                return
            self.leaves += 1
            pipe = self.evaluate(r, mb, setting, list(order))
            if pipe is not None and pipe.value > self.best_value:
                self.best_value, self.best = pipe.value, pipe

    def evaluate(self, r: int, mb: int, setting: int, blocks: list[tuple[int, int, int]]) -> Pipeline | None:
        """Exact best split of one ordered pipeline and its objective (None if nothing fits or a limit fails)."""
        ctx = self.ctx
        total = self.total
        offer = np.array([o for o, _, k in blocks for _ in range(k)], dtype=np.int64)
        tp = np.array([t for _, t, k in blocks for _ in range(k)], dtype=np.int64)
        p = offer.size
        if p > total:
            return None
        lmax = total - p + 1
        m = ctx.batch // (r * mb)
        sp = bool((tp > 1).any())
        pos = np.repeat(np.arange(p), lmax)
        lay = np.tile(np.arange(1, lmax + 1), p).astype(np.float64)
        rows = _rows(ctx, offer[pos], tp[pos].astype(np.float64), lay, pos == 0, pos == p - 1,
                     pos.astype(np.float64), float(p), r, mb, m, setting, sp)
        mn = _mn(ctx)
        c = stage_costs(mn, rows)
        fits = (c["memory_gb"] <= c["capacity_gb"]).reshape(p, lmax)
        st = ctx.settings[setting]
        if st.offload >= 1:
            fits &= self._host_fits(offer, tp, pos, lay, p, r, setting, blocks).reshape(p, lmax)
        s = np.where(fits, c["stage_mb"].reshape(p, lmax), np.inf)
        o = c["optimizer_s"].reshape(p, lmax)
        d = c["dp_exposed_s"].reshape(p, lmax)
        p2p = c["p2p"].reshape(p, lmax)[:, 0].copy()
        tied = c["tied_s"].reshape(p, lmax)[:, 0].copy()
        self._cross_node(mn, offer, tp, mb, p2p, tied)
        const = float(tied.max() + 2.0 * (m + p - 1.0) * p2p.max()) if p > 1 else 0.0
        limit = self._step_limit(r, blocks)
        if limit <= 0:
            return None
        step, layers = pipesplit.best_split(s, o, d, total, float(m), const, incumbent=limit)
        if layers is None:
            return None
        return self._value(r, mb, setting, blocks, layers, step)

    def _terms(self, r: int, blocks: list[tuple[int, int, int]]) -> tuple[dict[int, int], float, float, float]:
        """Devices per offer, spot factor, price and power of a pipeline's devices."""
        offers = self.ctx.pool.offers
        n = {o: r * t * k for o, t, k in blocks}
        lam = sum(k * offers[o].interruptions_per_hour for o, k in n.items())
        nodes = sum(math.ceil(k / offers[o].devices_per_node) for o, k in n.items())
        factor = float(spot_factor_of(self.ctx, np.asarray(lam, dtype=float), np.asarray(nodes, dtype=float)))
        price = float(sum(k * self.price[o] for o, k in n.items()))
        power = float(sum(k * self.power[o] for o, k in n.items()))
        return n, factor, price, power

    def _step_limit(self, r: int, blocks: list[tuple[int, int, int]]) -> float:
        """The step a pipeline on these devices must undercut to beat the best plan known (the objective
        falls as the step grows; ``cost`` is bounded below by price × hours, billing rounds up)."""
        ctx = self.ctx
        best = self.best_value
        _, factor, price, _ = self._terms(r, blocks)
        if not math.isfinite(best) or not math.isfinite(factor):
            return math.inf if math.isfinite(factor) else 0.0
        work = ctx.batch * ctx.seq_len / factor  # tokens/s × step
        obj = ctx.job.objective
        slack = 1.0 + 1e-9
        if obj == "throughput":
            return work / best * slack if best > 0 else math.inf
        if obj == "cost-performance":
            return work * 3600.0 / (price * best) * slack if best > 0 and price > 0 else math.inf
        hours_max = -best if obj == "time" else (-best / price if price > 0 else math.inf)
        if not hours_max > 0:
            return 0.0
        return work * 3600.0 * hours_max / self.tokens * slack

    def _host_fits(self, offer: IntArray, tp: IntArray, pos: IntArray, lay: FloatArray, p: int, r: int,
                   setting: int, blocks: list[tuple[int, int, int]]) -> npt.NDArray[np.bool_]:
        ctx = self.ctx
        st = ctx.settings[setting]
        per_dev = hostmem.host_gb_per_device(
            ctx.model, ctx.train, lay, (pos == 0).astype(float), (pos == p - 1).astype(float),
            tp[pos].astype(float), np.full(lay.shape, float(p)), np.full(lay.shape, float(r)),
            np.full(lay.shape, float(st.zero_stage)), np.full(lay.shape, float(st.offload)))
        on_block = {o: r * t * k for o, t, k in blocks}
        offers = ctx.pool.offers
        dpn = np.array([min(offers[o].devices_per_node, on_block[o]) for o in offer[pos]], dtype=float)
        host = np.array([np.nan if offers[o].host_memory_gb is None else offers[o].host_memory_gb
                         for o in offer[pos]])
        return hostmem.host_ok(per_dev * dpn, host)

    def _cross_node(self, mn: ModelNumbers, offer: IntArray, tp: IntArray, mb: int, p2p: FloatArray,
                    tied: FloatArray) -> None:
        """Sends between stages on different accelerators cross the link between the two kinds (as
        ``costmodel.step._cross_node_costs`` charges them)."""
        pool = self.ctx.pool

        def gbps(a: int, b: int) -> float:
            return float(pool.link_gbps(pool.offers[a].name, pool.offers[b].name))

        p = offer.size
        for i in range(p - 1):
            a, b = int(offer[i]), int(offer[i + 1])
            if a == b:
                continue
            bw = gbps(a, b) / 8.0 * C.NETWORK_EFFICIENCY / max(int(tp[i]), int(tp[i + 1])) * 1e9
            send = mb * mn.seq_len * mn.h * mn.bytes_per_value / int(tp[i]) / bw + C.COLLECTIVE_LATENCY_S
            p2p[i] = max(p2p[i], send)
        if mn.tie and p > 1 and offer[0] != offer[-1]:
            bw = gbps(int(offer[0]), int(offer[-1])) / 8.0 * C.NETWORK_EFFICIENCY / max(int(tp[0]), int(tp[-1]))
            t = float(ring_allreduce_s(mn.vocab * mn.h / int(tp[-1]) * mn.grad_bytes_per_value, 2.0, bw))
            tied[-1] = max(tied[-1], t)

    def _value(self, r: int, mb: int, setting: int, blocks: list[tuple[int, int, int]], layers: IntArray,
               step: float) -> Pipeline | None:
        ctx = self.ctx
        offers = ctx.pool.offers
        n, factor, price, power = self._terms(r, blocks)
        if not math.isfinite(factor):
            return None
        tps_eff = ctx.batch * ctx.seq_len / step / factor
        hours = self.tokens / tps_eff / 3600.0
        total = float(sum(k * self.price[o] * billed_hours(np.asarray(hours), offers[o].billing_granularity_s)
                          for o, k in n.items()))
        if not bool(within(ctx.limits, price, power, hours, total)):
            return None
        value = float(score(ctx.job.objective, np.asarray(tps_eff), np.asarray(price), np.asarray(total),
                            np.asarray(hours)))
        return Pipeline(setting, r, mb, tuple(blocks), tuple(int(x) for x in layers), step, price, power, hours,
                        total, value)

    def _per_price_tables(self, m: int, mb: int, taus: FloatArray, steps: FloatArray, cap: pipebound.Tables,
                          n_fixed: int, stages: FloatArray, p2p: FloatArray, opt: FloatArray, price: FloatArray,
                          open_kinds: IntArray, a: FloatArray, ratio_tab: FloatArray) -> FloatArray:
        """Tokens/s per unit of price at most, from the memory-aware capacities (the first ``n_fixed``
        columns of ``cap`` are the blocks chosen; the open offers' kinds add capacity at no more than
        ``ratio_tab`` layers per unit of price; :func:`.pipebound.price_step_lb`)."""
        n, g1 = taus.shape
        rep = np.repeat(np.arange(n), g1)
        have = cap(taus.ravel(), rep)[:, :n_fixed].sum(axis=1).reshape(n, g1)
        if open_kinds.size:
            with np.errstate(invalid="ignore", divide="ignore"):
                q = np.floor(taus[:, :, None] / a[open_kinds][None, None, :] + 1e-9)
            q = np.clip(np.nan_to_num(q, nan=0.0, posinf=self.total), 0, self.total).astype(np.int64)
            ratio = ratio_tab[open_kinds[None, None, :], q].max(axis=2)
        else:
            ratio = np.zeros((n, g1))
        hop = np.maximum(mb * self.hop_s_per_sequence, p2p)
        extra = 2.0 * (m + np.maximum(stages, 2.0) - 1.0) * hop + opt
        ps = pipebound.price_step_lb(taus, steps, extra, price, have, self.total, ratio)
        with np.errstate(divide="ignore"):
            return np.asarray(np.where(ps > 0, self.ctx.batch * self.ctx.seq_len / ps, np.inf))

    # ---- the walk over offers ----------------------------------------------------------------------------
    def family(self, r: int, mb: int, setting: int, kinds: _Kinds) -> None:
        m = self.ctx.batch // (r * mb)
        offers = [int(o) for o in np.unique(kinds.offer)]
        # per open offer: its best layer rate (stages per unit τ) and most layers, over its kinds
        rate = {o: float((kinds.kmax / kinds.a)[kinds.offer == o].max()) for o in offers}
        amin_open = {o: float(kinds.a[kinds.offer == o].min()) for o in offers}
        # tokens/s per unit of price: the step is at least m L / Σ(1/a) over the stages, so tokens/s is at
        # most K Σ(1/a) with K = r mb seq / L, and a stage of kind (o, t) costs r t price_o
        k_rate = r * mb * self.ctx.seq_len / self.total
        a_least = float(kinds.a.min())
        with np.errstate(divide="ignore"):
            eff = {o: float((1.0 / (kinds.a * r * kinds.tp * self.price[o]))[kinds.offer == o].max()) for o in offers}
        max_stages = min(self.total, self.ctx.job.search.max_pipeline_stages or self.total)
        # the most promising offer is decided first (any order is exact; this one prunes soonest): per unit
        # of price for the money objectives, by layer rate otherwise
        money = self.ctx.job.objective in ("cost-performance", "cost")
        offers.sort(key=lambda o: -(eff[o] if money else rate[o]))

        tab = _tables(kinds, self.total)
        kinds_of = {o: np.flatnonzero(kinds.offer == o) for o in offers}
        # an open offer holds at most what its best block holds at the level of its fastest kind
        open_tab = {o: tab[kinds_of[o], kinds.kmax[kinds_of[o]], :].max(axis=0) for o in offers}
        zero = np.zeros(self.total + 1)
        # layers per unit of price of each kind's best block, per level q (the money objectives' bound)
        ks = np.arange(1, tab.shape[1], dtype=np.float64)
        kind_price = r * kinds.tp * self.price[kinds.offer]
        with np.errstate(divide="ignore", invalid="ignore"):
            per_unit = tab[:, 1:, :] / (kind_price[:, None, None] * ks[None, :, None])
        per_unit = np.where(np.isnan(per_unit), np.inf, per_unit)
        per_unit = np.where((ks[None, :] <= kinds.kmax[:, None])[:, :, None], per_unit, 0.0)
        ratio_tab = per_unit.max(axis=1)  # (kinds, levels)

        # a chosen block: (offer, tp, stages, per-layer time, kind index, p2p, optimizer step)
        def walk(level: int, chosen: list[tuple[int, int, int, float, int, float, float]], bound: float) -> None:
            accs = {self.accs[c[0]] for c in chosen}
            if level == len(offers):
                if len(accs) >= 2:
                    self.leaf(r, mb, setting, [(o, t, k) for o, t, k, *_ in chosen], bound)
                return
            o = offers[level]
            open_ = offers[level + 1:]
            used = sum(c[2] for c in chosen)
            # children: leave the offer out, or one of its (tp, k) blocks
            kid_t, kid_k, kid_a, kid_j = [0], [0], [np.inf], [0]
            if self.accs[o] not in accs:
                for j in kinds_of[o]:
                    for k in range(1, min(int(kinds.kmax[j]), max_stages - used) + 1):
                        kid_t.append(int(kinds.tp[j]))
                        kid_k.append(k)
                        kid_a.append(float(kinds.a[j]))
                        kid_j.append(int(j))
            kt, kk = np.array(kid_t), np.array(kid_k, dtype=np.float64)
            ka, kj = np.array(kid_a), np.array(kid_j)
            kp, ko = kinds.p2p[kid_j], kinds.opt[kid_j]
            nk = kt.size
            # columns: the chosen blocks, the child's block, the open offers' envelopes
            ch_k = np.array([float(c[2]) for c in chosen])
            ch_a = np.array([c[3] for c in chosen])
            op_a = np.array([amin_open[q] for q in open_])

            def cols(fixed: FloatArray, child: FloatArray, rest: FloatArray) -> FloatArray:
                """(children, columns): the chosen blocks, the child's block, the open offers."""
                return np.hstack([np.tile(fixed, (nk, 1)), np.asarray(child, dtype=np.float64)[:, None],
                                  np.tile(rest, (nk, 1))])

            child_a = np.where(kk > 0, ka, 1.0)
            kid_tab = np.where((kk > 0)[:, None], tab[kj, kk.astype(np.int64), :], zero[None, :])
            fixed_tab = np.stack([tab[c[4], c[2], :] for c in chosen] + [open_tab[q] for q in open_]) \
                if chosen or open_ else np.zeros((0, self.total + 1))
            nch = len(chosen)
            tables = np.concatenate([np.broadcast_to(fixed_tab[None, :nch], (nk, nch, self.total + 1)),
                                     kid_tab[:, None, :],
                                     np.broadcast_to(fixed_tab[None, nch:], (nk, len(open_), self.total + 1))],
                                    axis=1)
            cost = cols(ch_a, child_a, op_a)
            cap = pipebound.Tables(cost, tables)
            mand = cols(ch_k, kk, np.zeros(len(open_)))
            tau = pipebound.tau_lb(cap, self.total)
            a_chosen = max([c[3] for c in chosen], default=0.0)
            tau = np.maximum(tau, np.where(kk > 0, np.maximum(a_chosen, ka), a_chosen))
            taus, steps = pipebound.core_grid(m - 1.0, tau, cost, cap, mand, self.total)
            core = steps.min(axis=1)
            price0 = sum(r * t * k * self.price[q] for q, t, k, *_ in chosen)
            power0 = sum(r * t * k * self.power[q] for q, t, k, *_ in chosen)
            price = price0 + np.where(kk > 0, r * kt * kk * self.price[o], 0.0)
            power = power0 + np.where(kk > 0, r * kt * kk * self.power[o], 0.0)
            p2p = np.maximum(max([c[5] for c in chosen], default=0.0), np.where(kk > 0, kp, 0.0))
            opt = np.maximum(max([c[6] for c in chosen], default=0.0), np.where(kk > 0, ko, 0.0))
            rate_c = sum(c[2] / c[3] for c in chosen) + np.where(kk > 0, kk / child_a, 0.0)
            r_open = float(sum(rate[q] for q in open_))
            e_open = max([eff[q] for q in open_], default=0.0)
            fixed = self.total * a_least + opt + 2.0 * (m + np.maximum(used + kk, 2.0) - 1.0) * np.maximum(
                mb * self.hop_s_per_sequence, p2p)
            per_price = pipebound.per_price_ub(m, self.total, k_rate * self.total, rate_c, price, fixed, r_open, e_open)
            if money:
                per_price = np.minimum(per_price, self._per_price_tables(
                    m, mb, taus, steps, cap, len(chosen) + 1, used + kk, p2p, opt, price,
                    np.concatenate([kinds_of[q] for q in open_]) if open_ else np.zeros(0, dtype=np.int64),
                    kinds.a, ratio_tab))
            b = self.bound(m, mb, core, used + kk, p2p, opt, price, power, per_price)
            self.stats.pipeline_nodes += nk
            self.nodes += nk
            for i in np.argsort(-b, kind="stable"):
                if b[i] <= self.best_value:
                    break
                if self.full():
                    self.gap_bound = max(self.gap_bound, float(b[i]))
                    return
                nxt = chosen if kk[i] == 0 else [*chosen, (o, int(kt[i]), int(kk[i]), float(ka[i]), int(kj[i]),
                                                           float(kp[i]), float(ko[i]))]
                walk(level + 1, nxt, float(b[i]))

        walk(0, [], math.inf)


def search(ctx: Any, incumbent: float, stats: SearchStats) -> Pipeline | None:
    """The best heterogeneous pipeline whose objective beats ``incumbent`` (None if none does)."""
    job = ctx.job
    pool = ctx.pool
    so = job.search
    total = int(ctx.spec.num_layers)
    caps = space.offer_caps(pool.offers, ctx.budget_per_hour)
    if len({o.accelerator for o, c in zip(pool.offers, caps, strict=True) if c > 0}) < 2:
        return None
    tps = [[t for t in space.tp_degrees(ctx.spec, o.devices_per_node, max(c, 0))
            if so.max_tp is None or t <= so.max_tp] for o, c in zip(pool.offers, caps, strict=True)]
    mbs = [job.train.micro_batch] if job.train.micro_batch else [x for x in space.MICRO_BATCHES if x <= ctx.batch]
    sets = [i for i, st in enumerate(ctx.settings) if st.zero_stage <= 1]
    max_stages = min(total, so.max_pipeline_stages or total)
    s = _Search(ctx, incumbent, stats)
    fams: list[tuple[float, int, int, int, _Kinds]] = []
    for mb in mbs:
        for r in range(1, ctx.batch // mb + 1):
            if (ctx.batch // mb) % r or r > max(caps):
                continue
            for si in sets:
                kinds = _kinds(ctx, r, mb, si, caps, tps, total, max_stages)
                if len({s.accs[int(o)] for o in kinds.offer}) < 2:
                    continue
                # the family's bound: every offer at its best block
                offers = np.unique(kinds.offer)
                sl = np.array([[float((kinds.kmax / kinds.a)[kinds.offer == o].max()) for o in offers]])
                li = np.array([[float(_reach(kinds)[kinds.offer == o].max()) for o in offers]])
                env = pipebound.Envelope(sl, li, np.zeros_like(sl))
                tau = pipebound.tau_lb(env, total)
                cost = np.array([[float(kinds.a[kinds.offer == o].min()) for o in offers]])
                m = ctx.batch // (r * mb)
                core = pipebound.core_lb(m - 1.0, tau, cost, env, np.zeros_like(sl), total)
                with np.errstate(divide="ignore"):
                    per_price = r * mb * ctx.seq_len / total * float(
                        (1.0 / (kinds.a * r * kinds.tp * s.price[kinds.offer])).max())
                fb = s.bound(m, mb, core, np.zeros(1), np.zeros(1), np.zeros(1), np.zeros(1), np.zeros(1),
                             np.array([per_price]))
                fams.append((float(fb[0]), r, mb, si, kinds))
    stats.pipeline_families += len(fams)
    fams.sort(key=lambda f: -f[0])
    for bound, r, mb, si, kinds in fams:
        if bound <= s.best_value:
            break
        if s.full():
            s.gap_bound = max(s.gap_bound, bound)
            break
        s.family(r, mb, si, kinds)
    stats.pipeline_leaves += s.leaves
    if s.full() and s.gap_bound > s.best_value:
        stats.pipelines_proven = False
        ref = s.best_value
        stats.bound_gap = max(stats.bound_gap, abs(s.gap_bound - ref) / abs(ref) if ref and math.isfinite(ref)
                              else math.inf)
    return s.best
