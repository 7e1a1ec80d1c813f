"""Heterogeneous pipelines inside the exact search: one pipeline whose stages run on different accelerators.

The space (every point of it is either evaluated exactly or cut by a proven bound):

- one pipeline, ``r`` data-parallel replicas, micro-batch ``mb`` (``r · mb`` divides the batch), 1F1B or
  interleaved 1F1B with ``v`` chunks where the runtime runs it (:func:`.pipekinds.interleave_options`; the
  bounds take the smallest bubble any of them gives);
- its stages form *blocks*, one per offer used (at most one offer per accelerator kind, at least two kinds):
  block ``b`` has ``k_b`` stages of TP ``t_b`` (``r · t_b · k_b`` devices of the offer), in any order;
- any integer split of the layers over the stages (each within its memory: :mod:`.pipesplit`);
- every memory setting a pipeline can use (ZeRO ≤ 1, recompute, optimizer offload).

Branch and bound, per (``r``, ``mb``, setting) family: a depth-first walk over the offers (the most promising
first) decides for each whether it is left out or which ``(t, k)`` block it contributes; all of a node's
children (every kind at every stage count) are bounded in one vectorised call, on what they share set up
once (:class:`.pipebound.Shared`), and walked best first while their bound beats the best plan known. The
bound of a node (:mod:`.pipebound`): each stage kind has a per-layer time ``a`` (a lower bound of ``S(L) / L``)
and memory caps *by place* — under 1F1B the ``k`` stages of a block keep at least ``1, 2, …, k`` micro-batches
of activations in flight, so together they hold at most ``Σ_{j ≤ k} min(⌊τ / a⌋, cap_j)`` layers under a
bottleneck ``τ`` (:func:`.pipekinds.family_kinds`); an open offer holds at most what its best block holds.
From these capacities come the least bottleneck ``τ_lb`` (exactly, from their breakpoints) and a bound of ``(m - 1) max S + Σ S`` per interval
of ``τ`` (the bubble included); the sends (at least one crosses two kinds) and the optimizer step
(``max O ≥ L / Σ 1/o``) are added, and with the price and power of what is chosen (lower bounds) every
objective is bounded (``policy.score`` grows with throughput and falls with price, cost and hours). The money
objectives are also capped by tokens/s per unit of price, twice: from layer rates per price, and per interval
of ``τ`` from the layers the open offers must still hold at their best layers per unit of price
(:func:`.pipebound.price_step_lb`), and, tighter, from the least price of blocks holding the model with one
block per offer (a multiple-choice knapsack: :mod:`.pipeprice`; per family when it comes up best on the
cheaper bounds). A child's bound is never above its parent's. A leaf is evaluated exactly (:mod:`.pipeleaf`): every order of its blocks, the exact layer split, the cost model's stage costs, the spot
factor and the constraints.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from starverse.planner import pipebound, pipeprice, space
from starverse.planner.pipekinds import (
    Kinds,
    Pipeline,
    capacity_tables,
    families_kinds,
    interleave_vmax,
    reach,
)
from starverse.planner.pipeleaf import LeafEvaluator
from starverse.planner.policy import Layout, paid_cost, runtime_layout_rule, score, within
from starverse.planner.result import SearchStats

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

MAX_LEAVES = 8_000
"""Exact leaf evaluations (block orders) per search; when reached, the search stops with the bound gap
reported and ``SearchStats.pipelines_proven`` False."""
MAX_NODES = 400_000
"""Branch-and-bound children bounded per search (every stage count of every kind of a node's offer: a few
hundred per node, a few microseconds each); reaching it stops the search as ``MAX_LEAVES`` does."""

class _Search(LeafEvaluator):
    """One search over heterogeneous pipelines (shared incumbent across families)."""

    def full(self) -> bool:
        """The caps are reached: the search stops (and is not proven unless its bound closed)."""
        return self.leaves >= MAX_LEAVES or self.nodes >= MAX_NODES

    # ---- bounds -------------------------------------------------------------------------------------
    def bound(self, m: Any, mb: Any, core: FloatArray, stages: FloatArray, p2p: FloatArray, opt: FloatArray,
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

    @property
    def money(self) -> bool:
        """The objective falls with the price (tokens per unit of price, or total cost)."""
        return self.ctx.job.objective in ("cost-performance", "cost")

    def family_price_ub(self, r: int, mb: int, m: int, kinds: Kinds, tau0: float
                        ) -> tuple[float, FloatArray, FloatArray, FloatArray | None]:
        """Tokens/s per unit of price at most for a family (``tau0``: a lower bound of its bottleneck):
        :func:`.pipeprice.per_price_ub` over every offer, at least two blocks (the knapsack), its intervals
        of bottlenecks, and :func:`.pipeprice.suffix_tables` of the walk's offers at their upper ends when
        the knapsack gave them on the way (None otherwise)."""
        # (the rows it needs only: most families never build their full capacity tables)
        kt = pipeprice.KindTables(kinds.a, None, r * kinds.tp * self.price[kinds.offer], kinds.per, self.total + 1)
        groups = [pipeprice.Group(ks, np.ones(ks.size, dtype=np.int64), kinds.kmax[ks])
                  for ks in (np.flatnonzero(kinds.offer == o) for o in self.walk_order(r, kinds))]
        extra = 2.0 * (m + 1.0) * mb * self.hop_s_per_sequence
        # Σ S ≥ L · min a, and interleaved 1F1B with v chunks counts Σ S / v in its core (at most vmax)
        vmax = interleave_vmax(self.total, m, 2, self.ctx.job.search.max_virtual_stages)
        suffix: list[FloatArray] = []
        ub, lo, hi = pipeprice.per_price_ub(self.ctx.batch * self.ctx.seq_len, m, tau0,
                                            float(kinds.a.min()) * self.total / vmax,
                                            extra, kt, groups, self.total, 2, self.per_price_target(), suffix=suffix)
        return ub, lo, hi, suffix[0] if suffix else None

    def walk_order(self, r: int, kinds: Kinds) -> list[int]:
        """The family's offers in the order the walk decides them (any order is exact; this one prunes
        soonest): the most promising first, per unit of price for the money objectives, by layer rate
        otherwise."""
        offers = [int(o) for o in np.unique(kinds.offer)]
        with np.errstate(divide="ignore"):
            key = (1.0 / (kinds.a * r * kinds.tp * self.price[kinds.offer])) if self.money else kinds.kmax / kinds.a
        best = {o: float(key[kinds.offer == o].max()) for o in offers}
        return sorted(offers, key=lambda o: -best[o])

    def family_bounds(self, fams: list[tuple[tuple[int, int, int], Kinds]]) -> tuple[FloatArray, FloatArray]:
        """Each family's bound (every offer at its best block) and least bottleneck, all families at once:
        rows of offers' envelopes (an offer a family lacks holds nothing), the core grid per micro-batch count."""
        n, n_off, total = len(fams), self.price.size, self.total
        if not n:
            return np.zeros(0), np.zeros(0)
        sl, li, cost = np.zeros((n, n_off)), np.zeros((n, n_off)), np.full((n, n_off), 1e300)
        per_price = np.zeros(n)
        for i, ((ri, _, _), kinds) in enumerate(fams):
            np.maximum.at(sl[i], kinds.offer, kinds.kmax / kinds.a)
            np.maximum.at(li[i], kinds.offer, reach(kinds))
            np.minimum.at(cost[i], kinds.offer, kinds.a)
            with np.errstate(divide="ignore"):
                per_price[i] = float((1.0 / (kinds.a * ri * kinds.tp * self.price[kinds.offer])).max())
        r, mb = (np.array([key[j] for key, _ in fams]) for j in (0, 1))
        m = self.ctx.batch // (r * mb)
        per_price *= r * mb * self.ctx.seq_len / total
        env = pipebound.Envelope(sl, li, np.zeros_like(sl))
        tau = pipebound.tau_lb(env, total)
        core = np.zeros(n)
        for mi in np.unique(m):
            rows = np.flatnonzero(m == mi)
            vmax = interleave_vmax(total, int(mi), 2, self.ctx.job.search.max_virtual_stages)
            sub = pipebound.Envelope(sl[rows], li[rows], np.zeros((rows.size, n_off)))
            core[rows] = pipebound.core_grid_schedules(int(mi), vmax, tau[rows], cost[rows], sub,
                                                       np.zeros((rows.size, n_off)), total)[1].min(axis=1)
        z = np.zeros(n)
        return self.bound(m, mb, core, z, z, z, z, z, per_price), tau

    def tables(self, kinds: Kinds) -> FloatArray:
        """:func:`.pipekinds.capacity_tables` of a family's kinds, computed once per search."""
        cache: dict[int, tuple[Kinds, FloatArray]] = self.__dict__.setdefault("_tables", {})
        if id(kinds) not in cache:
            cache[id(kinds)] = (kinds, capacity_tables(kinds, self.total))
        return cache[id(kinds)][1]

    def per_price_target(self) -> float:
        """Tokens/s per unit of price a plan must exceed to beat the best plan known (inf: none known)."""
        v = self.best_value
        if not math.isfinite(v):
            return math.inf
        if self.ctx.job.objective == "cost-performance":
            return v / 3600.0 if v > 0 else 0.0
        return self.tokens / (3600.0 * -v) if v < 0 else math.inf

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

    def _per_pricecapacity_tables(self, m: int, mb: int, taus: FloatArray, steps: FloatArray, cap: pipebound.Tables,
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
    def family(self, r: int, mb: int, setting: int, kinds: Kinds, bound: float = math.inf,
               grid: tuple[FloatArray, FloatArray, FloatArray | None] | None = None) -> None:
        """Branch and bound over one family (``bound``: the family's own, which caps every node's; ``grid``:
        :meth:`family_price_ub`'s intervals and suffix tables)."""
        m = self.ctx.batch // (r * mb)
        offers = self.walk_order(r, kinds)
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
        money = self.money

        tab = self.tables(kinds)
        kinds_of = {o: np.flatnonzero(kinds.offer == o) for o in offers}
        # an open offer holds at most what its best block holds at the level of its fastest kind
        open_tab = {o: tab[kinds_of[o], kinds.kmax[kinds_of[o]], :].max(axis=0) for o in offers}
        # layers per unit of price of each kind's best block, per level q (the money objectives' bound)
        ks = np.arange(1, tab.shape[1], dtype=np.float64)
        kind_price = r * kinds.tp * self.price[kinds.offer]
        with np.errstate(divide="ignore", invalid="ignore"):
            per_unit = tab[:, 1:, :] / (kind_price[:, None, None] * ks[None, :, None])
        per_unit = np.where(np.isnan(per_unit), np.inf, per_unit)
        per_unit = np.where((ks[None, :] <= kinds.kmax[:, None])[:, :, None], per_unit, 0.0)
        ratio_tab = per_unit.max(axis=1)  # (kinds, levels)
        # max_i O_i ≥ L / Σ_i (1 / o_i) (O_i ≥ o_i L_i): the stages' inverse optimizer rates, at most
        with np.errstate(divide="ignore"):
            inv_o = np.where(kinds.opt_layer > 0, 1.0 / kinds.opt_layer, np.inf)
        inv_open = {o: float((kinds.kmax * inv_o)[kinds_of[o]].max()) for o in offers}
        # the money objectives: the least price of the open offers' blocks holding what the chosen ones
        # cannot, per interval of bottlenecks shared by the family's nodes (:mod:`.pipeprice`)
        kt = pipeprice.KindTables(kinds.a, tab, r * kinds.tp * self.price[kinds.offer])
        groups = [pipeprice.Group(kinds_of[o], np.ones(kinds_of[o].size, dtype=np.int64), kinds.kmax[kinds_of[o]])
                  for o in offers]
        if money:
            lo_t, hi_t, given = grid if grid is not None else (np.zeros(0), np.zeros(0), None)
            suffix = given if given is not None else pipeprice.suffix_tables(hi_t, kt, groups, self.total)
            with np.errstate(divide="ignore", invalid="ignore"):
                q_hi = np.minimum(np.nan_to_num(hi_t[None, :] / kinds.a[:, None] + 1e-9, posinf=self.total),
                                  self.total).astype(np.int64)  # (kinds, intervals)

        # a chosen block: (offer, tp, stages, per-layer time, kind index, p2p, optimizer step)
        Chosen = list[tuple[int, int, int, float, int, float, float]]
        knap = money and lo_t.size > 0
        vmax_of = functools.lru_cache(maxsize=None)(
            lambda p: interleave_vmax(self.total, m, p, self.ctx.job.search.max_virtual_stages))

        def node(level: int, chosen: Chosen) -> Callable[[IntArray, IntArray], FloatArray]:
            """The bounds of a node's children (what they share is set up once, here)."""
            o = offers[level]
            open_ = offers[level + 1:]
            used = sum(c[2] for c in chosen)
            nch = len(chosen)
            # columns: the chosen blocks, the child's block, the open offers' envelopes
            ch_k = np.array([float(c[2]) for c in chosen])
            ch_a = np.array([c[3] for c in chosen])
            op_a = np.array([amin_open[q] for q in open_])
            fixed_tab = np.stack([tab[c[4], c[2], :] for c in chosen] + [open_tab[q] for q in open_]) \
                if chosen or open_ else np.zeros((0, self.total + 1))
            shared = pipebound.Shared.of(np.concatenate([ch_a, op_a]), fixed_tab, self.total)
            a_chosen = max([c[3] for c in chosen], default=0.0)
            price0 = sum(r * t * k * self.price[q] for q, t, k, *_ in chosen)
            power0 = sum(r * t * k * self.power[q] for q, t, k, *_ in chosen)
            p2p0 = max([c[5] for c in chosen], default=0.0)
            opt0 = max([c[6] for c in chosen], default=0.0)
            inv0 = sum(c[2] * float(inv_o[c[4]]) for c in chosen) + sum(inv_open[q] for q in open_)
            rate0 = sum(c[2] / c[3] for c in chosen)
            r_open = float(sum(rate[q] for q in open_))
            e_open = max([eff[q] for q in open_], default=0.0)
            if knap:
                have0 = sum((tab[c[4], c[2], q_hi[c[4]]] for c in chosen), np.zeros(lo_t.size))[None, :]
                open_kinds = np.zeros(0, dtype=np.int64)
            else:
                open_kinds = np.concatenate([kinds_of[q] for q in open_]) if open_ else np.zeros(0, dtype=np.int64)

            def bounds(kj: IntArray, k: IntArray) -> FloatArray:
                """Bounds of the children: a block of kind ``kj[i]`` with ``k[i]`` stages (0: the offer left
                out)."""
                nk = kj.size
                on = k > 0
                kk = k.astype(np.float64)
                jj = np.where(on, kj, 0)
                kt = np.where(on, kinds.tp[jj], 0)
                ka = np.where(on, kinds.a[jj], np.inf)
                kp, ko = np.where(on, kinds.p2p[jj], 0.0), np.where(on, kinds.opt[jj], 0.0)
                child_a = np.where(on, ka, 1.0)
                kid_tab = np.where(on[:, None], tab[jj, k, :], 0.0)
                tau = shared.least_tau(child_a, kid_tab, self.total)
                tau = np.maximum(tau, np.where(on, np.maximum(a_chosen, ka), a_chosen))
                # the smallest bubble of any schedule the leaves may take (at least max(used + k, 2) stages)
                vmax = vmax_of(used + int(k.min()))
                if not knap:
                    cost = np.hstack([np.tile(ch_a, (nk, 1)), child_a[:, None], np.tile(op_a, (nk, 1))])
                    tables = np.concatenate([np.broadcast_to(fixed_tab[None, :nch], (nk, nch, self.total + 1)),
                                             kid_tab[:, None, :], np.broadcast_to(
                                                 fixed_tab[None, nch:], (nk, len(open_), self.total + 1))], axis=1)
                    cap = pipebound.Tables(cost, tables)
                    mand = np.hstack([np.tile(ch_k, (nk, 1)), kk[:, None], np.zeros((nk, len(open_)))])
                    taus, steps = pipebound.core_grid_schedules(m, vmax, tau, cost, cap, mand, self.total)
                    core = steps.min(axis=1)
                else:
                    # the money objectives with the knapsack's intervals: its bound replaces the core grid's;
                    # every schedule's core is at least (m - 1) τ + max(τ, Σ S / v) (:func:`.pipeprice.per_price_ub`)
                    core = pipeprice.fill_steps(m, tau) + np.maximum(tau, self.total * a_least / vmax)
                price = price0 + np.where(on, r * kt * kk * self.price[o], 0.0)
                power = power0 + np.where(on, r * kt * kk * self.power[o], 0.0)
                p2p = np.maximum(p2p0, kp)
                opt = np.maximum(opt0, ko)
                inv = inv0 + np.where(on, kk * inv_o[jj], 0.0)
                with np.errstate(divide="ignore", invalid="ignore"):
                    opt = np.maximum(opt, np.where(np.isfinite(inv) & (inv > 0), self.total / inv, 0.0))
                rate_c = rate0 + np.where(on, kk / child_a, 0.0)
                rest = opt + 2.0 * (m + np.maximum(used + kk, 2.0) - 1.0) * np.maximum(
                    mb * self.hop_s_per_sequence, p2p)
                # 1F1B and interleaved with vmax chunks: the bound is linear in 1 / v, so the ends cover every v
                per_price = np.maximum.reduce([pipebound.per_price_ub(
                    m, self.total, k_rate * self.total, rate_c, price, self.total * a_least / v + rest, r_open,
                    e_open, m - 1.0 / v) for v in {1, vmax}])
                if knap:
                    have = have0 + np.where(on[:, None], tab[jj[:, None], k[:, None], q_hi[jj]], 0.0)
                    per_price = np.minimum(per_price, pipeprice.node_per_price(
                        self.ctx.batch * self.ctx.seq_len, m, lo_t, hi_t, suffix[level + 1], tau,
                        self.total * a_least / vmax, rest, price, have, self.total,
                        np.maximum(2 - nch - on.astype(np.int64), 0), core))
                elif money:
                    per_price = np.minimum(per_price, self._per_pricecapacity_tables(
                        m, mb, taus, steps, cap, nch + 1, used + kk, p2p, opt, price, open_kinds, kinds.a, ratio_tab))
                self.stats.pipeline_nodes += nk
                self.nodes += nk
                return self.bound(m, mb, core, used + kk, p2p, opt, price, power, per_price)
            return bounds

        def walk(level: int, chosen: Chosen, bound: float) -> None:
            accs = {self.accs[c[0]] for c in chosen}
            if level == len(offers):
                if len(accs) >= 2:
                    self.leaf(r, mb, setting, [(o, t, k) for o, t, k, *_ in chosen], bound)
                return
            o = offers[level]
            used = sum(c[2] for c in chosen)
            # children: leave the offer out, or one of its blocks: every kind at every stage count, at once
            kj, kk = [-1], [0]
            if self.accs[o] not in accs:
                for j in kinds_of[o]:
                    most = min(int(kinds.kmax[j]), max_stages - used)
                    kj += [int(j)] * max(most, 0)
                    kk += range(1, most + 1)
            # a child's bound never exceeds its parent's (both are valid for all it leads to)
            got = np.minimum(node(level, chosen)(np.array(kj), np.array(kk)), bound)
            for i in np.argsort(-got, kind="stable"):  # best first
                if got[i] <= self.best_value:
                    break
                if self.full():
                    self.gap_bound = max(self.gap_bound, float(got[i]))
                    return
                j, k = kj[i], kk[i]
                nxt = chosen if k == 0 else [*chosen, (o, int(kinds.tp[j]), k, float(kinds.a[j]), j,
                                                       float(kinds.p2p[j]), float(kinds.opt[j]))]
                walk(level + 1, nxt, float(got[i]))

        walk(0, [], bound)


def search(ctx: Any, incumbent: float, stats: SearchStats) -> Pipeline | None:
    """The best heterogeneous pipeline whose objective beats ``incumbent`` (None if none does)."""
    job = ctx.job
    pool = ctx.pool
    so = job.search
    total = int(ctx.spec.num_layers)
    caps = space.offer_caps(pool.offers, ctx.budget_per_hour)
    if len({o.accelerator for o, c in zip(pool.offers, caps, strict=True) if c > 0}) < 2:
        return None
    if runtime_layout_rule(Layout((((1, 1, "nccl"), (1, 1, "nccl")),), 0, False, ctx.mode)) is not None:
        # the rule refuses even the most permissive pipeline (two CUDA stages of TP 1, no ZeRO, no offload) in
        # this mode (QLoRA: one stage per group), so it refuses every heterogeneous pipeline: none is evaluated
        # (their exact evaluation is most of a QLoRA search's time, for plans the rule would leave out)
        return None
    tps = [[t for t in space.tp_degrees(ctx.spec, o.devices_per_node, max(c, 0))
            if so.max_tp is None or t <= so.max_tp] for o, c in zip(pool.offers, caps, strict=True)]
    mbs = [job.train.micro_batch] if job.train.micro_batch else [x for x in space.MICRO_BATCHES if x <= ctx.batch]
    # (the chunk count is searched per pipeline: :func:`.pipekinds.interleave_options`)
    sets = [i for i, st in enumerate(ctx.settings) if st.zero_stage <= 1 and st.virtual_stages == 1]
    max_stages = min(total, so.max_pipeline_stages or total)
    s = _Search(ctx, incumbent, stats)
    keys = [(r, mb, si) for mb in mbs for r in range(1, ctx.batch // mb + 1)
            if not (ctx.batch // mb) % r and r <= max(caps) for si in sets]
    found = [(key, kinds) for key, kinds in zip(keys, families_kinds(ctx, keys, caps, tps, total, max_stages),
                                                 strict=True) if len({s.accs[int(o)] for o in kinds.offer}) >= 2]
    bounds, taus = s.family_bounds(found)
    fams: list[tuple[float, int, tuple[FloatArray, FloatArray, FloatArray | None] | None, int, int, int, float,
                     Kinds]] = [
        (-float(fb), i, None, r, mb, si, float(tau), kinds)
        for i, (((r, mb, si), kinds), fb, tau) in enumerate(zip(found, bounds, taus, strict=True))]
    stats.pipeline_families += len(fams)
    # best bound first; for the money objectives a family's bound is first the cheap one above, tightened
    # by the least price of its blocks (:mod:`.pipeprice`) when it comes up, then put back (the knapsack's
    # fractional relaxation as a tier between them would cost more than the knapsacks it saves)
    heapq.heapify(fams)
    while fams:
        neg, i, grid, r, mb, si, tau0, kinds = heapq.heappop(fams)
        bound = -neg
        if bound <= s.best_value:
            break
        if s.full():
            s.gap_bound = max(s.gap_bound, bound)
            break
        if s.money and grid is None:
            m = ctx.batch // (r * mb)
            per_price, lo, hi, suffix = s.family_price_ub(r, mb, m, kinds, tau0)
            limit = per_price * 3600.0 if job.objective == "cost-performance" else (
                -s.tokens / (3600.0 * per_price) if per_price > 0 else -math.inf)
            keep = suffix if min(bound, limit) > s.best_value else None  # (a family cut here is never walked)
            heapq.heappush(fams, (-min(bound, limit), i, (lo, hi, keep), r, mb, si, tau0, kinds))
            continue
        s.family(r, mb, si, kinds, bound, grid)
    stats.pipeline_leaves += s.leaves
    if s.full() and s.gap_bound > s.best_value:
        stats.pipelines_proven = False
        ref = s.best_value
        stats.bound_gap = max(stats.bound_gap, abs(s.gap_bound - ref) / abs(ref) if ref and math.isfinite(ref)
                              else math.inf)
    return s.best
