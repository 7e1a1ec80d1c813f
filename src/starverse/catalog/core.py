"""Value objects of the hardware catalog: accelerators, offers, currencies, and the catalog itself.

These are frozen dataclasses built by :mod:`starverse.catalog.loader` from the YAML data files; nothing here
reads files. Change a value by copying (:func:`dataclasses.replace`, :meth:`Catalog.with_overrides`).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from starverse.errors import CatalogError

STACKS = ("cuda", "rocm", "xla", "npu", "mlu", "cpu")
"""Software stacks; each implies a collective backend (see :data:`BACKENDS`)."""

BACKENDS: Mapping[str, str] = {
    "cuda": "nccl", "rocm": "rccl", "xla": "xla", "npu": "hccl", "mlu": "cncl", "cpu": "gloo",
}
"""The torch.distributed (or XLA) collective backend of each stack."""

LINKS = ("nvlink", "pcie", "ici", "hccs", "infinity-fabric", "mlu-link", "none")
"""Kinds of intra-node device-to-device link."""

PRECISIONS = ("bf16", "fp16", "fp8", "fp32")
"""Matmul precisions a plan may ask for."""

FLOAT_FIELDS = (
    "bf16_tflops",
    "fp16_tflops",
    "fp32_tflops",
    "fp8_tflops",
    "memory_gb",
    "memory_bw_gb_per_s",
    "intra_node_gb_per_s",
    "inter_node_gbps",
    "tdp_w",
    "host_memory_gb",
)
"""Numeric accelerator fields a probe profile or ``with_overrides`` may replace."""

ADD_ACCELERATOR_HINT = (
    "To add one, describe it under 'accelerators:' in a catalog YAML file (same fields as "
    "`starverse catalog --json` shows) and pass it with --catalog FILE or STARVERSE_CATALOG."
)


class FrozenDict(dict[str, Any]):
    """A read-only dict: unlike ``MappingProxyType`` it pickles, deep-copies and hashes (runtime processes
    receive catalogs and specs by pickling)."""

    def _readonly(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{type(self).__name__} is read-only; copy it (dict(x)) to change it")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _readonly  # type: ignore[assignment]
    __ior__ = _readonly  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (dict(self),))

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(frozenset(self.items()))


def _frozen_map(m: Mapping[str, Any]) -> Mapping[str, Any]:
    return m if isinstance(m, FrozenDict) else FrozenDict(m)


@dataclass(frozen=True)
class Accelerator:
    """One accelerator model with its datasheet (or measured) figures; every figure has a source."""

    id: str
    """Stable catalog key, e.g. ``a100-80gb-sxm``."""
    name: str
    """Human-readable product name."""
    vendor: str
    """Maker: nvidia, amd, google, huawei, cambricon, generic."""
    stack: str
    """Software stack: cuda | rocm | xla | npu | mlu | cpu (see :data:`BACKENDS` for the collective backend)."""
    bf16_tflops: float
    """Dense BF16 matmul peak in TFLOP/s (never the 2:4-sparse figure); FP32 accumulate on GeForce cards."""
    fp16_tflops: float
    """Dense FP16 matmul peak in TFLOP/s with FP32 accumulate (what mixed-precision training uses)."""
    fp32_tflops: float
    """FP32 peak in TFLOP/s without TF32 (PyTorch's default for fp32 matmuls)."""
    fp8_tflops: float | None
    """Dense FP8 matmul peak in TFLOP/s, or None where the device has no FP8 path."""
    memory_gb: float
    """Device memory usable for training, GB (10^9 bytes)."""
    memory_bw_gb_per_s: float
    """Peak device-memory bandwidth, GB/s."""
    intra_node_link: str
    """nvlink | pcie | ici | hccs | infinity-fabric | mlu-link | none."""
    intra_node_gb_per_s: float
    """Device-to-device bandwidth inside a node, per device and one direction, GB/s (NVLink-3 A100: 300)."""
    devices_per_node: int
    """Default devices per node (a plan's ``network.devices_per_node`` overrides it)."""
    inter_node_gbps: float
    """Default NIC bandwidth per node, Gbit/s (a plan's ``network.inter_node_gbps`` overrides it)."""
    tdp_w: float
    """Board power, W (for power caps; TPUs: see the source, Google publishes none)."""
    sources: Mapping[str, str] = field(default_factory=dict)
    """Field name -> where the figure comes from."""
    host_memory_gb: float | None = None
    """RAM of one node of the default instance type, GB (CPU offload keeps optimizer state there); None when
    unknown (a user's accelerator without it: offloaded plans on it need the pool's ``host_memory_gb``)."""
    matrix_unit: int | None = None
    """Edge of the device's systolic matrix unit in elements (TPU MXU: 128 x 128; v6e: 256 x 256), or None (GPUs):
    a matmul on such a unit is a roofline of its FLOPs and bytes with each axis under the edge padded up to it
    (``costmodel.matmul.gemm_time_s``), where a GPU's pays for tiles and waves."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "sources", _frozen_map(self.sources))

    @property
    def backend(self) -> str:
        """Collective backend of this accelerator's stack (nccl, rccl, xla, hccl, cncl, gloo)."""
        return BACKENDS[self.stack]

    def peak_tflops(self, precision: str) -> float:
        """Dense peak TFLOP/s for ``precision`` (bf16 | fp16 | fp8 | fp32); fp8 falls back to bf16 if absent."""
        if precision == "bf16":
            return self.bf16_tflops
        if precision == "fp16":
            return self.fp16_tflops
        if precision == "fp32":
            return self.fp32_tflops
        if precision == "fp8":
            return self.fp8_tflops if self.fp8_tflops is not None else self.bf16_tflops
        raise CatalogError(
            f"unknown precision '{precision}' for accelerator '{self.id}'; use one of {', '.join(PRECISIONS)}"
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-ready), ``sources`` included."""
        d = dataclasses.asdict(self)
        d["sources"] = dict(self.sources)
        return d


@dataclass(frozen=True)
class Offer:
    """A price at which one accelerator can be rented, per device-hour."""

    provider: str
    """Who rents it (cloud, marketplace, or the product brief)."""
    accelerator: str
    """Catalog id of the accelerator."""
    price_per_hour: float
    """On-demand price per device-hour, in ``currency``."""
    spot_price_per_hour: float | None
    """Spot / interruptible price per device-hour, or None if not offered."""
    currency: str
    """ISO 4217 code (USD, CNY, EUR...)."""
    billing_granularity_s: int
    """Billing increment in seconds (1 = per second, 3600 = per started hour)."""
    as_of: str
    """When the price was observed (YYYY-MM or YYYY-MM-DD)."""
    source: str
    """Where the price comes from (and any arithmetic that derived it)."""
    region: str | None = None
    """Region or zone, where the price depends on it."""

    @property
    def billing_unit(self) -> str:
        """What one bill covers: ``hour`` (per second, minute or hour), ``day`` or ``month`` (packages and
        reserved blocks: their per-hour figure is derived, not a price anyone rents one hour at)."""
        return billing_unit(self.billing_granularity_s)

    @property
    def hourly(self) -> bool:
        """True when the device can be rented by the hour (or finer) at this price."""
        return self.billing_granularity_s <= HOUR_S

    def price_per_unit(self, spot: bool = False) -> float | None:
        """Price of one billing unit per device (an hour, a day or a month), in ``currency``."""
        p = self.spot_price_per_hour if spot else self.price_per_hour
        if p is None:
            return None
        return p * max(self.billing_granularity_s, HOUR_S) / HOUR_S


HOUR_S = 3600
"""Offers billed by at most this many seconds are hourly offers (what "per device-hour" compares)."""
DAY_S = 86_400
"""Billing granularity of day-long packages and reserved blocks."""


def billing_unit(granularity_s: int) -> str:
    """``hour`` for granularities up to an hour, ``day`` up to a day, else ``month``."""
    if granularity_s <= HOUR_S:
        return "hour"
    return "day" if granularity_s <= DAY_S else "month"


@dataclass(frozen=True)
class Currency:
    """An exchange rate against the US dollar."""

    code: str
    """ISO 4217 code."""
    usd_per_unit: float
    """US dollars for one unit of this currency."""
    as_of: str
    """Date of the rate."""
    source: str
    """Where the rate comes from."""


@dataclass(frozen=True)
class Catalog:
    """Accelerators, offers and exchange rates: the bundled data plus the user's catalog and probe profile."""

    accelerators: Mapping[str, Accelerator]
    """Accelerator id -> accelerator."""
    offers: tuple[Offer, ...]
    """Every known offer."""
    currencies: Mapping[str, Currency] = field(default_factory=dict)
    """ISO code -> exchange rate against USD."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "accelerators", _frozen_map(self.accelerators))
        object.__setattr__(self, "currencies", _frozen_map(self.currencies))
        object.__setattr__(self, "offers", tuple(self.offers))

    def accelerator(self, acc_id: str) -> Accelerator:
        """The accelerator ``acc_id``; a CatalogError with close matches and how to add one if unknown."""
        try:
            return self.accelerators[acc_id]
        except KeyError:
            raise CatalogError(unknown_accelerator_message(acc_id, list(self.accelerators))) from None

    def offers_for(self, acc_id: str) -> tuple[Offer, ...]:
        """Offers for one accelerator (checks the id)."""
        self.accelerator(acc_id)
        return tuple(o for o in self.offers if o.accelerator == acc_id)

    def cheapest_offer(self, acc_id: str, *, spot: bool = False, currency: str = "USD",
                       unit: str = "hour") -> Offer | None:
        """The offer with the lowest (spot if ``spot``) price once converted to ``currency``, among offers of
        one billing ``unit`` (``hour`` by default: a monthly package's derived per-hour figure is not a price
        one can rent an hour at, so it never competes with hourly prices); None if none."""
        best: tuple[float, Offer] | None = None
        for o in self.offers_for(acc_id):
            if o.billing_unit != unit:
                continue
            price = o.spot_price_per_hour if spot else o.price_per_hour
            if price is None:
                continue
            value = self.convert(price, o.currency, currency)
            if best is None or value < best[0]:
                best = (value, o)
        return None if best is None else best[1]

    def convert(self, amount: float, from_ccy: str, to_ccy: str) -> float:
        """Convert ``amount`` between currencies via USD; CatalogError for an unknown code."""
        if from_ccy.upper() == to_ccy.upper():
            self._currency(from_ccy)
            return amount
        return amount * self._currency(from_ccy).usd_per_unit / self._currency(to_ccy).usd_per_unit

    def _currency(self, code: str) -> Currency:
        try:
            return self.currencies[code.upper()]
        except KeyError:
            raise CatalogError(unknown_currency_message(code, list(self.currencies))) from None

    def with_overrides(self, accelerators: Mapping[str, Mapping[str, float]]) -> Catalog:
        """A copy with some numeric accelerator figures replaced (e.g. measured by ``starverse probe``).

        ``accelerators`` maps id -> {field: value}; fields are those of :data:`FLOAT_FIELDS` (and
        ``devices_per_node``). The replaced figures' sources become ``"override"`` unless the mapping
        carries a ``sources`` entry of its own.
        """
        return self._with_overrides(accelerators, "override")

    def _with_overrides(self, accelerators: Mapping[str, Mapping[str, Any]], source: str) -> Catalog:
        new = dict(self.accelerators)
        for acc_id, fields in accelerators.items():
            acc = self.accelerator(acc_id)
            changes: dict[str, Any] = {}
            sources = dict(acc.sources)
            extra_sources = fields.get("sources", {})
            for name, value in fields.items():
                if name == "sources":
                    continue
                if name not in FLOAT_FIELDS and name != "devices_per_node":
                    allowed = ", ".join((*FLOAT_FIELDS, "devices_per_node"))
                    raise CatalogError(
                        f"override of accelerator '{acc_id}': unknown field '{name}'; fields that can be "
                        f"overridden: {allowed}"
                    )
                if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                    raise CatalogError(
                        f"override of accelerator '{acc_id}': {name} must be a number > 0 (got {value!r})"
                    )
                changes[name] = int(value) if name == "devices_per_node" else float(value)
                sources[name] = extra_sources.get(name, source)
            new[acc_id] = dataclasses.replace(acc, sources=sources, **changes)
        return dataclasses.replace(self, accelerators=new)


def unknown_accelerator_message(acc_id: str, known: list[str]) -> str:
    """``unknown accelerator 'x'; did you mean ...? To add one: ...``."""
    close = difflib.get_close_matches(acc_id, known, n=3, cutoff=0.5)
    if close:
        hint = f"did you mean {', '.join(repr(c) for c in close)}?"
    else:
        hint = f"known: {', '.join(sorted(known))}."
    return f"unknown accelerator '{acc_id}'; {hint} {ADD_ACCELERATOR_HINT}"


def unknown_currency_message(code: str, known: list[str]) -> str:
    """``unknown currency 'x'; known: ...`` with how to add a rate."""
    close = difflib.get_close_matches(code.upper(), known, n=1)
    hint = f"did you mean '{close[0]}'? " if close and close[0] != code else ""
    shown = code if len(code) <= 40 else code[:37] + "..."  # a 5000-character --currency is not echoed whole
    return (
        f"unknown currency '{shown}'; {hint}known: {', '.join(sorted(known))}. To add one, give its "
        "usd_per_unit, as_of and source under 'currencies:' in a catalog file (--catalog FILE)."
    )
