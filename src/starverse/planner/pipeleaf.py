"""Exact evaluation of one heterogeneous pipeline (a leaf of :mod:`.pipes`' branch and bound): the cost
model's stage costs for every stage and layer count, the exact integer layer split (:mod:`.pipesplit`), host
memory when offloading, the sends across kinds, the spot factor, the constraints and the objective — the same
terms ``costmodel.estimate`` charges the written plan (a test holds them equal)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np
import numpy.typing as npt

from starverse.costmodel import constants as C
from starverse.costmodel.comm import ring_allreduce_s
from starverse.costmodel.rows import ModelNumbers
from starverse.costmodel.stage import stage_costs
from starverse.planner import hostmem, pipesplit
from starverse.planner.build import NOMINAL_TOKENS
from starverse.planner.pipekinds import (
    Pipeline,
    interleave_options,
    model_numbers_1f1b,
    spot_factor_of,
    stage_rows,
)
from starverse.planner.policy import (
    Layout,
    billed_hours,
    note_layout_refusal,
    runtime_layout_rule,
    score,
    within,
)
from starverse.planner.result import SearchStats

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


class LeafEvaluator:
    """Prices, power, links of a pool and the exact evaluation of a pipeline on it; the best one found."""

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
        mn = model_numbers_1f1b(ctx)
        # a pipeline holds one offer per accelerator and at least two: at least one send crosses between
        # two offers of different accelerators, over their link (the fastest such link bounds it from below)
        offers = list(pool.offers)
        fastest = max([float(pool.link_gbps(a.name, b.name)) for i, a in enumerate(offers) for b in offers[i + 1:]
                       if a.accelerator != b.accelerator], default=float(pool.cross_offer_gbps))
        self.hop_s_per_sequence = mn.seq_len * mn.h * mn.bytes_per_value / (fastest / 8.0 * C.NETWORK_EFFICIENCY * 1e9)

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
        rows = stage_rows(ctx, offer[pos], tp[pos].astype(np.float64), lay, pos == 0, pos == p - 1,
                     pos.astype(np.float64), float(p), r, mb, m, setting, sp)
        mn = model_numbers_1f1b(ctx)
        limit = self._step_limit(r, blocks)
        if limit <= 0:
            return None
        host_ok = self._host_fits(offer, tp, pos, lay, p, r, setting, blocks).reshape(p, lmax) \
            if ctx.settings[setting].offload >= 1 else True
        # the runtime layout rule refuses a one-group pipeline whatever its layer split (different TP in its
        # stages): all that counts then is whether a split beats the limit (``_value`` counts the refusal),
        # not the best one; the first that does ends the search (the walk and its incumbent are unchanged)
        refused = self._refused_whatever_split(setting, blocks)
        best: tuple[float, IntArray, int] | None = None
        for v in [1, *interleave_options(total, m, p, ctx.job.search.max_virtual_stages)]:
            if refused and best is not None:
                break
            mn_v = mn if v == 1 else replace(mn, schedule="interleaved", virtual_stages=float(v))
            c = stage_costs(mn_v, rows)
            fits = (c["memory_gb"] <= c["capacity_gb"]).reshape(p, lmax) & host_ok
            s = np.where(fits, c["stage_mb"].reshape(p, lmax), np.inf)
            o = c["optimizer_s"].reshape(p, lmax)
            d = c["dp_exposed_s"].reshape(p, lmax)
            p2p = c["p2p"].reshape(p, lmax)[:, 0].copy()
            tied = c["tied_s"].reshape(p, lmax)[:, 0].copy()
            self._cross_node(mn, offer, tp, mb, p2p, tied)
            const = float(tied.max() + 2.0 * (m + p - 1.0) * v * p2p.max()) if p > 1 else 0.0
            # interleaved: every stage holds a multiple of v layers; in units of v layers the step
            # m S_max + (Σ S - S_max) / v is (m v - 1) max(S / v) + Σ (S / v), the 1F1B form
            cols = np.arange(v - 1, v * (total // v - p + 1), v)
            step, units = pipesplit.best_split(s[:, cols] / v, o[:, cols], d[:, cols], total // v, float(m * v),
                                               const, incumbent=limit if best is None else min(limit, best[0]),
                                               any_split=refused)
            if units is not None:
                best = (step, units * v, v)
        if best is None:
            return None
        return self._value(r, mb, setting, blocks, best[1], best[0], best[2])

    def _refused_whatever_split(self, setting: int, blocks: list[tuple[int, int, int]]) -> bool:
        """The runtime layout rule refuses this pipeline (one group) for every layer split: the rule reads a
        one-group plan's stage count, TPs, backends, ZeRO stage, offload and mode, never its layer counts."""
        return runtime_layout_rule(self._layout(setting, blocks, None)) is not None

    def _layout(self, setting: int, blocks: list[tuple[int, int, int]], layers: IntArray | None) -> Layout:
        """The one-group layout the runtime rule and the limits read: (layers, TP, backend) per stage (one layer
        each where ``layers`` is None)."""
        ctx = self.ctx
        st = ctx.settings[setting]
        backend = {o: ctx.catalog.accelerator(ctx.pool.offers[o].accelerator).backend for o, _, _ in blocks}
        stages = [(o, t) for o, t, k in blocks for _ in range(k)]
        counts = [1] * len(stages) if layers is None else [int(x) for x in layers]
        return Layout((tuple((n, t, backend[o]) for (o, t), n in zip(stages, counts, strict=True)),),
                      st.zero_stage, st.offload > 0, ctx.mode)

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
               step: float, v: int) -> Pipeline | None:
        ctx = self.ctx
        offers = ctx.pool.offers
        n, factor, price, power = self._terms(r, blocks)
        if not math.isfinite(factor):
            return None
        tps_eff = ctx.batch * ctx.seq_len / step / factor
        hours = self.tokens / tps_eff / 3600.0
        total = float(sum(k * self.price[o] * billed_hours(np.asarray(hours), offers[o].billing_granularity_s)
                          for o, k in n.items()))
        layout = self._layout(setting, blocks, layers)
        if not bool(within(ctx.limits, price, power, hours, total, layout)):
            note_layout_refusal(self.stats.layout_refused, layout)
            return None
        value = float(score(ctx.job.objective, np.asarray(tps_eff), np.asarray(price), np.asarray(total),
                            np.asarray(hours)))
        return Pipeline(setting, r, mb, tuple(blocks), tuple(int(x) for x in layers), step, price, power, hours,
                        total, value, "interleaved" if v > 1 else "1f1b", v)
