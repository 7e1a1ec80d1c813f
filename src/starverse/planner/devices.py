"""``plan_for_devices``: the best plan on a fixed set of devices (this machine, or what survives a loss).

Where ``search`` chooses what to rent from a pool, here the devices are given (``{"cpu": 2}``,
``{"h100-80gb-sxm": 4, "rtx-4090": 2}``): they become a pool of **owned** offers (price 0, so
``cost-performance`` ranks by throughput; see :func:`~starverse.planner.policy.resolve_objective`), or of
rented ones where ``prices`` names a price. ``runtime_caps`` restricts the space to what the runtime that will
execute the plan can run: :data:`EXECUTABLE` is what ``starverse.runtime`` executes (TP, ZeRO 0-3, recompute,
offload, pipelines; ``accelerate()`` narrows it per cluster), :data:`RUNTIME_CAPS` the plain subset (data
parallelism and pipelines, TP 1, no ZeRO / recompute / offload).

Where the caps leave TP, ZeRO, recompute or offload open, the space is searched whole, then once per setting
simpler than the best plan's (the search keeps one plan per device set, so its ``top`` list never shows two
settings of the same devices; every setting when the runtime refuses the best plan), and
``plan_for_devices`` ranks the settings' best plans itself: plans the runtime refuses (``runnable``) are left
out, and among plans whose objective is within :data:`TIE_TOLERANCE` of the best the simplest setting wins
(:func:`simplicity`: no offload, TP 1, no recompute, the lowest ZeRO stage), so a setting the cost model prices
a few percent faster (ZeRO-1's sharded optimizer step) does not replace plain data parallelism.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from starverse.errors import CatalogError, ConfigError, InfeasiblePlanError, StarverseError
from starverse.planner.job import Objective, job_from_dict
from starverse.planner.pool import pool_from_dict
from starverse.planner.result import PlanResult
from starverse.planner.space import SEARCHED_RECOMPUTE


@dataclass(frozen=True)
class RuntimeCaps:
    """What a runtime can execute; the planner searches only plans within it (None: unrestricted)."""

    max_tp: int | None = 1
    """Largest tensor-parallel degree it runs."""
    max_pipeline_stages: int | None = 1
    """Deepest pipeline it runs."""
    zero_stage: int | None = 0
    """The ZeRO stage it applies (None: searched)."""
    recompute: Literal["none", "selective", "matmuls", "full"] | None = "none"
    """The activation recomputation it applies (None: searched)."""
    offload: Literal["none", "optimizer", "optimizer+params"] | None = "none"
    """The CPU offload it applies (None: searched)."""
    fine_tuning: bool = False
    """True when it can run LoRA/QLoRA (then proposed as alternatives when full training cannot fit)."""
    use_all_devices: bool = True
    """True when every given device becomes a rank (the plan must use them all)."""
    max_zero_stage: int = 3
    """Highest ZeRO stage searched when ``zero_stage`` is None."""
    sharded_replicas: bool = False
    """True when it also runs *sharded replicas*: a kind's devices split into equal replica groups (each plan
    group one replica), ZeRO 1 to ``max_zero_stage`` inside each (in-place recovery, ``runtime.ft_shard``; ZeRO-2/3
    on FSDP2); proposed beside the search's plans by :func:`~starverse.planner.replicas.sharded_replica_plans`
    whatever ``zero_stage`` says."""

    def search_options(self, num_kinds: int) -> dict[str, Any]:
        """The ``search:`` section of the job these caps give, for ``num_kinds`` device kinds."""
        return {
            "max_tp": self.max_tp, "max_pipeline_stages": self.max_pipeline_stages,
            "use_all_devices": self.use_all_devices, "alternatives": self.fine_tuning,
            # every kind is its own group when all devices are used; hetero pipelines need stages > 1
            "max_groups": min(max(num_kinds, 1), 4) if self.use_all_devices else 3,
            "hetero_pipelines": self.max_pipeline_stages is None or self.max_pipeline_stages > 1,
        }

    def describe(self) -> str:
        """What these caps allow, in words (``TP ≤ 1, 1 pipeline stage, ZeRO-0, ...``); empty when unrestricted."""
        parts = []
        if self.max_tp is not None:
            parts.append(f"TP ≤ {self.max_tp}")
        if self.max_pipeline_stages is not None:
            parts.append(f"≤ {self.max_pipeline_stages} pipeline stage{'s' if self.max_pipeline_stages > 1 else ''}")
        if self.zero_stage is not None:
            parts.append(f"ZeRO-{self.zero_stage}")
        elif self.max_zero_stage < 3:
            parts.append(f"ZeRO ≤ {self.max_zero_stage}")
        if self.recompute is not None:
            parts.append(f"recompute {self.recompute}")
        if self.offload is not None:
            parts.append(f"offload {self.offload}")
        if not self.fine_tuning:
            parts.append("full training")
        if self.use_all_devices:
            parts.append("every device used")
        if self.sharded_replicas:
            parts.append(f"or equal replica groups with ZeRO 1-{self.max_zero_stage} inside each")
        return ", ".join(parts)

    def train_fixes(self) -> dict[str, Any]:
        """The ``train:`` settings these caps fix."""
        fixes = {"zero_stage": self.zero_stage, "recompute": self.recompute, "offload": self.offload}
        return {k: v for k, v in fixes.items() if v is not None}


    @property
    def open_settings(self) -> bool:
        """True when TP, ZeRO, recompute or offload is left to the search, or sharded replicas are proposed too."""
        return (self.max_tp is None or self.max_tp > 1 or self.zero_stage is None or self.recompute is None
                or self.offload is None or self.sharded_replicas)

    def settings(self) -> list[RuntimeCaps]:
        """One caps per setting these allow (TP 1 or TP open, each ZeRO stage, recompute, offload), fixed."""
        zeros = [self.zero_stage] if self.zero_stage is not None else list(range(self.max_zero_stage + 1))
        rcs = [self.recompute] if self.recompute is not None else list(SEARCHED_RECOMPUTE)
        offs = [self.offload] if self.offload is not None else ["none", "optimizer", "optimizer+params"]
        tps = [self.max_tp] if self.max_tp == 1 else [1, self.max_tp]
        return [dataclasses.replace(self, max_tp=tp, zero_stage=z, recompute=rc, offload=off)  # type: ignore[arg-type]
                for off in offs for rc in rcs for tp in tps for z in zeros if off == "none" or z >= 1]


RUNTIME_CAPS = RuntimeCaps(max_pipeline_stages=None)
"""The plain subset of what ``starverse.runtime`` executes: data parallelism across (possibly mixed) device kinds
and pipelines (``torch.distributed.pipelining``, uneven splits, heterogeneous stages); TP 1, ZeRO-0, no
recompute or offload (what in-place recovery runs)."""
EXECUTABLE = RuntimeCaps(max_tp=None, max_pipeline_stages=None, zero_stage=None, recompute=None, offload=None)
"""Everything ``starverse.runtime`` executes (issue 10): TP (within a node; the plan's check refuses a TP that
does not divide the heads), ZeRO 0-3 (FSDP2; ZeRO-1 a sharded optimizer), recompute, offload, pipelines; full
training, every device used. ``accelerate()`` narrows it to the cluster (no offload on CPU ranks, plain for
in-place recovery) and filters the ranked plans by the runtime's own checks."""
TIE_TOLERANCE = 0.05
"""Plans whose objective is within this fraction of the best one are ties, won by the simplest setting."""

_RECOMPUTE = {"none": 0, "selective": 1, "matmuls": 1, "full": 2}
_OFFLOAD = {"none": 0, "optimizer": 1, "optimizer+params": 2}


def simplicity(plan: Any) -> tuple[int, int, int, int]:
    """Sort key of a plan's setting, simplest first: no offload, TP 1, no recompute, the lowest ZeRO stage."""
    t = plan.train
    tp = max(s.tp for g in plan.groups for s in g.stages)
    return (_OFFLOAD.get(t.offload, 3), int(tp > 1), _RECOMPUTE.get(t.recompute, 3), int(t.zero_stage))


def _setting_key(caps: RuntimeCaps) -> tuple[int, int, int, int]:
    """:func:`simplicity` of the simplest plan a fixed setting can give (TP open may still give TP 1)."""
    return (_OFFLOAD.get(caps.offload or "none", 3), 0, _RECOMPUTE.get(caps.recompute or "none", 3),
            int(caps.zero_stage or 0))


def _refusal(plan: Any, runnable: Callable[[Any], None] | None) -> str | None:
    """Why ``runnable`` refuses ``plan`` (its StarverseError in one line); None when it runs (or no check)."""
    try:
        if runnable is not None:
            runnable(plan)
    except StarverseError as e:
        return " ".join(str(e).split())
    return None


def pick_simplest(result: PlanResult, runnable: Callable[[Any], None] | None = None,
                  tolerance: float = TIE_TOLERANCE) -> PlanResult:
    """``result`` with the plans ``runnable`` refuses (raises a StarverseError) left out and the simplest plan
    within ``tolerance`` of the best objective first (then by objective). InfeasiblePlanError when none is
    left, naming why each was refused."""
    kept, refused = [], []
    for rp in result.plans:
        why = _refusal(rp.plan, runnable)
        if why is not None:
            refused.append(f"{rp.layout()}: {why}")
        else:
            kept.append(rp)
    if not kept:
        raise InfeasiblePlanError("the runtime runs none of the planner's plans on these devices:", refused)
    best = max(rp.objective_value for rp in kept)
    ties = [rp for rp in kept if rp.objective_value >= best - tolerance * abs(best)]
    first = min(ties, key=lambda rp: simplicity(rp.plan))
    rest = sorted((rp for rp in kept if rp is not first), key=lambda rp: -rp.objective_value)
    notes = list(result.notes)
    if first.objective_value < best:
        notes.append(f"chose the simplest setting within {tolerance:.0%} of the best estimate: {first.layout()}")
    notes.extend(f"not run by the runtime: {r}" for r in refused[:3])
    return dataclasses.replace(result, plans=(first, *rest), notes=tuple(notes))
UNRESTRICTED = RuntimeCaps(max_tp=None, max_pipeline_stages=None, zero_stage=None, recompute=None, offload=None,
                           fine_tuning=True, use_all_devices=False)
"""The planner's whole space (TP, pipelines, ZeRO, offload, LoRA; any subset of the devices)."""


def plan_for_devices(
    model: str | Mapping[str, Any] | Any,
    devices: Mapping[str, int],
    *,
    policy: str | Objective = Objective.COST_PERFORMANCE,
    train: Mapping[str, Any],
    catalog: Any = None,
    prices: Mapping[str, float] | None = None,
    currency: str = "USD",
    runtime_caps: RuntimeCaps | None = RUNTIME_CAPS,
    max_budget_per_hour: float | None = None,
    model_name: str | None = None,
    cross_kind_gbps: float | None = None,
    top: int = 5,
    runnable: Callable[[Any], None] | None = None,
    cpu_threads: int | None = None,
) -> PlanResult:
    """Ranked plans for ``model`` on exactly these ``devices`` (accelerator id → count), within ``runtime_caps``.

    ``model``: registry id, HF id, config.json path, or a Hugging Face config as a dict (the runtime's
    scaled-down copy); ``model_name`` is what the plans' ``model:`` field says (default: ``model`` itself
    when it is a string; give the path of a saved config for a dict, so the plan can be estimated later).
    ``train``: ``seq_len``, ``global_batch``, ``precision`` and any other ``job.yaml`` train field.
    ``prices``: price per device-hour by accelerator (in ``currency``); devices without one are owned
    (price 0). All devices of one kind are taken as one node (a single machine). ``runtime_caps``: None
    searches the whole space. ``runnable``: the runtime's check of a plan (raises a StarverseError for one it
    does not run); when given, or when the caps leave settings open, the plans are ranked by
    :func:`pick_simplest` (see the module docstring). ``cpu_threads``: threads of each ``cpu`` rank, which
    scale the catalog's CPU compute figures (:func:`cpu_rank_catalog`; a probe's measured figures are kept).
    Raises ``ConfigError``/``InfeasiblePlanError`` (say what failed and why).
    """
    from starverse.catalog import load_catalog
    from starverse.models import load_model
    from starverse.planner.api import search

    if not devices or any(int(n) < 1 for n in devices.values()):
        raise ConfigError(f"plan_for_devices: devices must map accelerator ids to counts >= 1 (got {dict(devices)})")
    catalog = catalog if catalog is not None else load_catalog()
    if cpu_threads is not None and "cpu" in devices:
        catalog = cpu_rank_catalog(catalog, cpu_threads)
    for acc in devices:
        try:
            catalog.accelerator(acc)
        except CatalogError as e:
            raise CatalogError(f"plan_for_devices: devices: {e}") from None
    spec = load_model(model)
    if model_name is None:
        if not isinstance(model, str):
            model_name = str(spec.name) if getattr(spec, "name", None) else "<config dict>"
        else:
            model_name = model
    prices = dict(prices or {})
    unknown = sorted(set(prices) - set(devices))
    if unknown:
        raise ConfigError(f"plan_for_devices: prices given for {', '.join(unknown)}, which are not among the devices "
                          f"({', '.join(devices)})")
    offers = []
    for acc, n in devices.items():
        offer: dict[str, Any] = {"accelerator": acc, "count": int(n), "devices_per_node": int(n)}
        if acc in prices:
            offer["price_per_hour"] = prices[acc]
        else:
            offer["owned"] = True
        offers.append(offer)
    pool_d: dict[str, Any] = {"currency": currency, "offers": offers}
    if cross_kind_gbps is not None:
        pool_d["cross_offer_gbps"] = cross_kind_gbps
    pool = pool_from_dict(pool_d, catalog, source="<devices>")
    caps = runtime_caps if runtime_caps is not None else UNRESTRICTED

    def job_for(c: RuntimeCaps) -> Any:
        job_d: dict[str, Any] = {
            "model": model_name,
            "train": {**dict(train), **c.train_fixes()},  # what the runtime cannot change wins
            "objective": str(policy),
            "search": c.search_options(len(devices)),
        }
        if max_budget_per_hour is not None:
            job_d["constraints"] = {"max_budget_per_hour": max_budget_per_hour}
        return job_from_dict(job_d, "<plan_for_devices>")

    try:
        if runtime_caps is None or (runnable is None and not caps.open_settings):
            return search(job_for(caps), pool, catalog, top, spec=spec)
        # the widest search first: its best plan bounds the settings worth searching one by one (only the
        # simpler ones can win a tie), unless the runtime refuses it (then every setting is searched)
        try:
            widest: PlanResult | None = search(job_for(caps), pool, catalog, top, spec=spec)
            infeasible = None
        except InfeasiblePlanError as e:  # sharded replicas may still fit
            if not caps.sharded_replicas:
                raise
            widest, infeasible = None, e
        found: dict[str, Any] = {}
        if widest is not None:
            found.update((f"{rp.layout()} {rp.mode}", rp) for rp in widest.plans)
            bound = simplicity(widest.best.plan) if _refusal(widest.best.plan, runnable) is None else None
            for c in caps.settings():
                if bound is not None and _setting_key(c) >= bound:
                    continue
                try:
                    r = search(job_for(c), pool, catalog, top, spec=spec)
                except InfeasiblePlanError:
                    continue
                for rp in r.plans:
                    found.setdefault(f"{rp.layout()} {rp.mode}", rp)
        if caps.sharded_replicas:
            from starverse.planner.replicas import sharded_replica_plans

            recomputes = (caps.recompute,) if caps.recompute is not None else SEARCHED_RECOMPUTE
            zeros = range(1, caps.max_zero_stage + 1)
            for rp in sharded_replica_plans(
                    lambda z, rc: job_for(dataclasses.replace(caps, zero_stage=z, recompute=rc, offload="none")),  # type: ignore[arg-type]
                    pool, catalog, spec, devices, [(z, rc) for z in zeros for rc in recomputes]):
                found.setdefault(f"{rp.layout()} {rp.mode}", rp)
        if widest is None:
            assert infeasible is not None
            if not found:
                raise infeasible
            first = max(found.values(), key=lambda rp: rp.objective_value)
            widest = PlanResult(plans=(first,), objective=_resolved_objective(job_for(caps), pool), currency=currency,
                                model=model_name, per_job=job_for(caps).train.total_tokens is not None)
        ranked = sorted(found.values(), key=lambda rp: -rp.objective_value)
        picked = pick_simplest(dataclasses.replace(widest, plans=tuple(ranked)), runnable)
        return dataclasses.replace(picked, plans=picked.plans[:max(top, 1)])
    except InfeasiblePlanError as e:
        limits = caps.describe()
        if not limits:
            raise
        # say what was searched: the remedies the error lists may be beyond what the runtime executes
        err = InfeasiblePlanError(f"{e} (searched only what the runtime executes: {limits})")
        err.reasons = e.reasons
        raise err from None


def _resolved_objective(job: Any, pool: Any) -> Objective:
    """The objective the search ranks ``job`` by on ``pool`` (``policy.resolve_objective``)."""
    from starverse.planner.policy import resolve_objective

    return resolve_objective(job, pool)[0].objective


CATALOG_CPU_CORES = 5
"""Cores the catalog's ``cpu`` compute figures assume (its source: "~5 cores" for fp32_tflops)."""


def cpu_rank_catalog(catalog: Any, threads: int) -> Any:
    """``catalog`` with the ``cpu`` accelerator's compute figures scaled to a rank of ``threads`` threads
    (``threads / CATALOG_CPU_CORES`` of the catalog's, at most all of it) while they are the bundled defaults;
    figures measured by ``starverse probe`` (a rank's own) are kept."""
    from starverse.catalog import bundled_catalog

    acc, default = catalog.accelerator("cpu"), bundled_catalog().accelerator("cpu")
    scale = min(max(int(threads), 1), CATALOG_CPU_CORES) / CATALOG_CPU_CORES
    fields = ("fp32_tflops", "bf16_tflops", "fp16_tflops")
    changes = {f: getattr(default, f) * scale for f in fields if getattr(acc, f) == getattr(default, f)}
    if not changes or scale == 1.0:
        return catalog
    source = f"catalog default x {threads}/{CATALOG_CPU_CORES} cores (a rank of {threads} threads)"
    return catalog.with_overrides({"cpu": {**changes, "sources": dict.fromkeys(changes, source)}})


__all__ = ["EXECUTABLE", "RUNTIME_CAPS", "TIE_TOLERANCE", "UNRESTRICTED", "RuntimeCaps", "cpu_rank_catalog",
           "pick_simplest", "plan_for_devices", "simplicity"]
