"""``plan_for_devices``: the best plan on a fixed set of devices (this machine, or what survives a loss).

Where ``search`` chooses what to rent from a pool, here the devices are given (``{"cpu": 2}``,
``{"h100-80gb-sxm": 4, "rtx-4090": 2}``): they become a pool of **owned** offers (price 0, so
``cost-performance`` ranks by throughput; see :func:`~starverse.planner.policy.resolve_objective`), or of
rented ones where ``prices`` names a price. ``runtime_caps`` restricts the space to what the runtime that will
execute the plan can run; by default (:data:`RUNTIME_CAPS`) that is today's runtime: data parallelism and
pipelines (any depth, uneven layer splits, stages of different kinds), TP 1, no ZeRO / recompute / offload,
full training, every device used.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from starverse.errors import CatalogError, ConfigError, InfeasiblePlanError
from starverse.planner.job import Objective, job_from_dict
from starverse.planner.pool import pool_from_dict
from starverse.planner.result import PlanResult


@dataclass(frozen=True)
class RuntimeCaps:
    """What a runtime can execute; the planner searches only plans within it (None: unrestricted)."""

    max_tp: int | None = 1
    """Largest tensor-parallel degree it runs."""
    max_pipeline_stages: int | None = 1
    """Deepest pipeline it runs."""
    zero_stage: int | None = 0
    """The ZeRO stage it applies (None: searched)."""
    recompute: Literal["none", "selective", "full"] | None = "none"
    """The activation recomputation it applies (None: searched)."""
    offload: Literal["none", "optimizer", "optimizer+params"] | None = "none"
    """The CPU offload it applies (None: searched)."""
    fine_tuning: bool = False
    """True when it can run LoRA/QLoRA (then proposed as alternatives when full training cannot fit)."""
    use_all_devices: bool = True
    """True when every given device becomes a rank (the plan must use them all)."""

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
        if self.recompute is not None:
            parts.append(f"recompute {self.recompute}")
        if self.offload is not None:
            parts.append(f"offload {self.offload}")
        if not self.fine_tuning:
            parts.append("full training")
        if self.use_all_devices:
            parts.append("every device used")
        return ", ".join(parts)

    def train_fixes(self) -> dict[str, Any]:
        """The ``train:`` settings these caps fix."""
        fixes = {"zero_stage": self.zero_stage, "recompute": self.recompute, "offload": self.offload}
        return {k: v for k, v in fixes.items() if v is not None}


RUNTIME_CAPS = RuntimeCaps(max_pipeline_stages=None)
"""What ``starverse.runtime`` executes today: data parallelism across (possibly mixed) device kinds and pipelines
(``torch.distributed.pipelining``, uneven splits, heterogeneous stages); TP, ZeRO, recompute, offload not yet."""
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
) -> PlanResult:
    """Ranked plans for ``model`` on exactly these ``devices`` (accelerator id → count), within ``runtime_caps``.

    ``model``: registry id, HF id, config.json path, or a Hugging Face config as a dict (the runtime's
    scaled-down copy); ``model_name`` is what the plans' ``model:`` field says (default: ``model`` itself
    when it is a string; give the path of a saved config for a dict, so the plan can be estimated later).
    ``train``: ``seq_len``, ``global_batch``, ``precision`` and any other ``job.yaml`` train field.
    ``prices``: price per device-hour by accelerator (in ``currency``); devices without one are owned
    (price 0). All devices of one kind are taken as one node (a single machine). ``runtime_caps``: None
    searches the whole space. Raises ``ConfigError``/``InfeasiblePlanError`` (say what failed and why).
    """
    from starverse.catalog import load_catalog
    from starverse.models import load_model
    from starverse.planner.api import search

    if not devices or any(int(n) < 1 for n in devices.values()):
        raise ConfigError(f"plan_for_devices: devices must map accelerator ids to counts >= 1 (got {dict(devices)})")
    catalog = catalog if catalog is not None else load_catalog()
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
    job_d: dict[str, Any] = {
        "model": model_name,
        "train": {**dict(train), **caps.train_fixes()},  # what the runtime cannot change wins
        "objective": str(policy),
        "search": caps.search_options(len(devices)),
    }
    if max_budget_per_hour is not None:
        job_d["constraints"] = {"max_budget_per_hour": max_budget_per_hour}
    job = job_from_dict(job_d, "<plan_for_devices>")
    try:
        return search(job, pool, catalog, top, spec=spec)
    except InfeasiblePlanError as e:
        limits = caps.describe()
        if not limits:
            raise
        # say what was searched: the remedies the error lists may be beyond what the runtime executes
        err = InfeasiblePlanError(f"{e} (searched only what the runtime executes: {limits})")
        err.reasons = e.reasons
        raise err from None


__all__ = ["RUNTIME_CAPS", "UNRESTRICTED", "RuntimeCaps", "plan_for_devices"]
