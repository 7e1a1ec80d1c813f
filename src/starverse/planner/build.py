"""Turning a chosen layout into a :class:`~starverse.plan.Plan`, and ranking a concrete plan by the scalar
cost model (the numbers the user sees, identical to ``starverse estimate`` on the written plan)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from starverse.costmodel.constants import BYTES_PER_VALUE
from starverse.plan import Network, Plan, Pricing, Stage, TrainSpec
from starverse.planner import hostmem, space, spotcheck
from starverse.planner.job import Job
from starverse.planner.policy import billed_hours, checkpoint_seconds, score, spot_factor, within
from starverse.planner.pool import Pool
from starverse.planner.result import RankedPlan

NOMINAL_TOKENS = 1e9
"""Without a job length, hours and costs are reported per this many tokens."""


def trainable_params(spec: Any, mode: str, lora_rank: int) -> float:
    """Parameters with gradients and optimizer state, as the cost model counts them: all of them, or the
    LoRA adapters of every transformer layer."""
    from starverse.costmodel.batch import ModelShape
    from starverse.costmodel.group import adapter_params_per_layer

    if mode == "full":
        # layers + embeddings + LM head (the final norm's few weights are left out, as in the cost model)
        return float(spec.num_layers * spec.params_per_layer + spec.embedding_params + spec.lm_head_params)
    return float(spec.num_layers) * float(adapter_params_per_layer(ModelShape.from_spec(spec), lora_rank))


def checkpoint_bytes(trainable: float, precision: str) -> float:
    """A checkpoint holds the trained weights and their fp32 master copy + Adam moments (12 B); a frozen base
    is reloaded from its original files, not re-written."""
    return trainable * (BYTES_PER_VALUE[precision] + 12.0)


def stages_even(acc: str, tp: int, pp: int, num_layers: int) -> list[Stage]:
    """Even split, the first ``L % pp`` stages one layer more (as the batch cost model assumes)."""
    base, extra = divmod(num_layers, pp)
    out = []
    if extra:
        out.append(Stage(accelerator=acc, tp=tp, layers=base + 1, repeat=extra))
    if pp - extra:
        out.append(Stage(accelerator=acc, tp=tp, layers=base, repeat=pp - extra))
    return out


def network_for(pool: Pool, offer_names: Sequence[str]) -> Network:
    """The plan's network section for the offers it uses."""
    used = [pool.offer(n) for n in offer_names]
    # measured links between the offers used, and their measured profiles (pool offers -> accelerator ids)
    links = {f"{a.accelerator}/{b.accelerator}": pool.link_gbps(a.name, b.name)
             for i, a in enumerate(used) for b in used[i + 1:]
             if a.accelerator != b.accelerator and pool.link_gbps(a.name, b.name) != pool.cross_offer_gbps}
    return Network(
        devices_per_node={o.accelerator: o.devices_per_node for o in used},
        inter_node_gbps={o.accelerator: o.inter_node_gbps for o in used},
        # a plan of one offer has no link between offers: its groups (sharded replicas) meet over their NICs
        cross_group_gbps=pool.cross_offer_gbps if len(used) > 1 else None,
        links=links,
        collective_gb_per_s={o.accelerator: dict(o.collective_gb_per_s) for o in used if o.collective_gb_per_s},
        profiles={o.accelerator: o.profile.path for o in used if o.profile is not None},
    )


def pricing_for(pool: Pool, offer_names: Sequence[str]) -> Pricing | None:
    """The plan's pricing section (prices paid, pool currency); None when every device used is free."""
    # The plan format has no zero price (it would read as a missing one): owned devices at 0 are left out.
    prices = {pool.offer(n).accelerator: pool.offer(n).price_per_hour for n in offer_names
              if pool.offer(n).price_per_hour > 0}
    return Pricing(currency=pool.currency, price_per_hour=prices) if prices else None


def train_spec(job: Job, mode: str, setting: space.Setting, sequence_parallel: bool, schedule: str = "1f1b",
               virtual_stages: int = 1) -> TrainSpec:
    """The plan's ``train:`` section (``schedule``: 1f1b, or interleaved with ``virtual_stages`` chunks)."""
    t = job.train
    return TrainSpec(
        seq_len=t.seq_len, global_batch=t.global_batch, precision=t.precision, mode=mode,  # type: ignore[arg-type]
        lora_rank=t.lora_rank, optimizer=t.optimizer,
        zero_stage=setting.zero_stage, recompute=space.RECOMPUTE_NAMES[setting.recompute],  # type: ignore[arg-type]
        offload=space.OFFLOAD_NAMES[setting.offload],  # type: ignore[arg-type]
        schedule=schedule, virtual_stages=virtual_stages,  # type: ignore[arg-type]
        sequence_parallel=sequence_parallel, tokens=t.tokens, steps=t.steps,
    )


def rank_plan(job: Job, pool: Pool, catalog: Any, spec: Any, plan: Plan, devices: dict[str, int], kind: str,
              alternative: bool, notes: Sequence[str] = ()) -> RankedPlan | None:
    """Estimate a concrete plan with the scalar cost model and score it (None if it breaks a constraint)."""
    from starverse.costmodel import estimate

    est = estimate(plan, catalog, spec)
    if not est.fits:
        return None
    offers = [pool.offer(n) for n in devices]
    lam = sum(devices[o.name] * o.interruptions_per_hour for o in offers)
    nodes = sum(math.ceil(devices[o.name] / o.devices_per_node) for o in offers)
    mode = plan.train.mode
    trainable = trainable_params(spec, mode, plan.train.lora_rank)
    ckpt = checkpoint_seconds(checkpoint_bytes(trainable, plan.train.precision), nodes, job.search.checkpoint_gb_per_s)
    formula = float(spot_factor(lam, ckpt, job.search.restart_s))
    if not math.isfinite(formula):
        return None
    tps = float(est.tokens_per_s)
    price = sum(devices[o.name] * o.price_per_hour for o in offers)
    tokens = job.train.total_tokens
    work_s = (tokens if tokens is not None else NOMINAL_TOKENS) / tps
    checked, _ = spotcheck.checked_factor(
        formula, spotcheck.sim_job(work_s, sum(devices.values()), lam, ckpt, job.search.restart_s,
                                   float(est.step_time_s), price),
        spotcheck.traced(offers, devices))
    factor = checked.factor
    if not math.isfinite(factor):
        return None
    tps_eff = tps / factor
    hours = (tokens if tokens is not None else NOMINAL_TOKENS) / tps_eff / 3600.0
    total = float(sum(devices[o.name] * o.price_per_hour * billed_hours(np.asarray(hours), o.billing_granularity_s)
                      for o in offers))
    from starverse.planner.search import limits_of

    if not within(limits_of(job, pool, catalog), price, float(est.power_kw), hours, total):
        return None
    host_need = hostmem.plan_host_gb_per_node(plan, spec, {o.accelerator: o.devices_per_node for o in offers})
    host_per_offer = {o.name: host_need.get(o.accelerator, 0.0) for o in offers}
    for o in offers:
        need = np.asarray(host_per_offer[o.name])
        have = np.asarray(np.nan if o.host_memory_gb is None else o.host_memory_gb)
        if not bool(hostmem.host_ok(need, have)):
            return None
    value = float(score(job.objective, np.asarray(tps_eff), np.asarray(price), np.asarray(total),
                        np.asarray(hours)))
    all_notes = list(notes)
    if checked.simulated is not None:
        used = "used" if checked.source == "simulated" else "within 10 %, Young/Daly kept"
        all_notes.append(f"spot overhead ×{factor:.3f}: Young/Daly says ×{formula:.3f} ({lam:.2g} interruptions/h), "
                         f"the trace-driven simulation ×{checked.simulated:.3f} ({used})")
    elif factor > 1:
        all_notes.append(f"spot overhead ×{factor:.3f} (Young/Daly, {lam:.2g} interruptions/h)")
    stacks = {catalog.accelerator(a).stack for a in plan.accelerators()}
    if len(stacks) > 1:
        all_notes.append(f"mixes software stacks ({', '.join(sorted(stacks))}): cross-group sync goes through "
                         "the host network")
    owned_free = {o.accelerator for o in offers if o.owned and o.price_per_hour == 0}
    # "no price for X" is expected for owned devices at 0: the pool, not the catalog, prices them
    all_notes.extend(w for w in (getattr(est, "warnings", ()) or ())
                     if not any(w.startswith(f"no price for '{a}'") for a in owned_free))
    return RankedPlan(
        plan=plan, estimate=est, kind=kind, mode=mode, alternative=alternative, devices=dict(devices),
        cost_per_hour=price, tokens_per_s=tps, effective_tokens_per_s=tps_eff, spot_factor=factor,
        power_kw=float(est.power_kw), hours=hours if tokens is not None else None,
        total_cost=total if tokens is not None else None, objective_value=value, notes=tuple(all_notes),
        host_memory_gb_per_node={k: v for k, v in host_per_offer.items() if v > 0},
        spot_factor_formula=formula, spot_factor_simulated=checked.simulated,
        price_sources={o.name: o.price_source for o in offers},
    )


