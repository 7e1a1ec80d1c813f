"""``pool.yaml``: what can be rented — offers of accelerators, each with a count, a price and its network.

A pool is read once, validated against the catalog (unknown accelerators get a did-you-mean with the file
line), and turned into :class:`Offer` value objects with every price in the pool's currency, so the search
never converts anything in its inner loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, model_validator

from starverse.config import (
    MAX_COUNT,
    MAX_GB_PER_S,
    MAX_GBPS,
    MAX_INTERRUPTIONS_PER_HOUR,
    MAX_MEMORY_GB,
    MAX_MONEY,
    MAX_SECONDS,
    FrozenModel,
    LocatedError,
    _line_of,
    format_loc,
    parse,
    read_yaml,
)
from starverse.errors import CatalogError, ConfigError
from starverse.planner.simulate import Trace, load_trace_events


class Pricing(StrEnum):
    """How an offer is billed."""

    ON_DEMAND = "on-demand"
    SPOT = "spot"


class OfferSpec(FrozenModel):
    """One offer in ``pool.yaml``: up to ``count`` devices of one accelerator at one price."""

    accelerator: str
    """Catalog id of the accelerator (``starverse catalog`` lists them)."""
    count: int = Field(gt=0, le=MAX_COUNT)
    """Devices available; the planner never rents more."""
    name: str | None = None
    """Label shown in tables (default: the accelerator id); must be unique in the pool."""
    provider: str | None = None
    """Who rents it (informative)."""
    devices_per_node: int | None = Field(default=None, gt=0, le=MAX_COUNT)
    """Devices per node (default: the catalog's); tensor parallelism stays inside one node."""
    price_per_hour: float | None = Field(default=None, ge=0, le=MAX_MONEY)
    """On-demand price per device-hour; omitted = the catalog's cheapest on-demand offer (0 for an ``owned``
    offer). 0 only with ``owned: true``."""
    spot_price_per_hour: float | None = Field(default=None, gt=0, le=MAX_MONEY)
    """Spot price per device-hour (needed when ``pricing: spot``; else the catalog's cheapest spot price)."""
    currency: str | None = None
    """Currency of this offer's prices (default: the pool's)."""
    pricing: Pricing = Pricing.ON_DEMAND
    """Which of the two prices is paid: ``on-demand`` or ``spot``."""
    interruptions_per_hour: float | None = Field(default=None, ge=0, le=MAX_INTERRUPTIONS_PER_HOUR)
    """Spot only: expected device losses per device-hour (see ``data/traces``); charged as checkpoint and
    lost-work overhead (Young/Daly). At most 3600 (``config.MAX_INTERRUPTIONS_PER_HOUR``)."""
    trace: str | None = None
    """Spot only: a preemption trace (``data/traces``; path relative to the pool file). It sets
    ``interruptions_per_hour`` when that is not given, and the planner checks its Young/Daly spot overhead
    against a simulation on it (:mod:`~starverse.planner.simulate`), using the simulated figure when the
    two differ by more than 10 %."""
    inter_node_gbps: float | None = Field(default=None, gt=0, le=MAX_GBPS)
    """NIC bandwidth per node in Gbit/s (default: the catalog's); at most 100,000 (``config.MAX_GBPS``)."""
    billing_granularity_s: int | None = Field(default=None, gt=0, le=MAX_SECONDS)
    """Billing unit in seconds (3600 = started hours are billed in full); used by the ``cost`` objective.
    Default: the catalog offer's when the price comes from the catalog, else 1 (per second)."""
    host_memory_gb: float | None = Field(default=None, gt=0, le=MAX_MEMORY_GB)
    """RAM per node, GB (default: the catalog's for the accelerator's default instance type). CPU offload
    keeps the optimizer state (and with ``optimizer+params`` the weights) of the node's devices there. At most
    100,000 (``config.MAX_MEMORY_GB``)."""
    owned: bool = False
    """Devices you already have (this machine, your own cluster): nothing is rented, the price defaults to 0
    (give ``price_per_hour`` for an amortised cost) and the catalog's prices are not used."""
    profile: str | None = None
    """A measured profile of the job's model on this offer's accelerator (``starverse probe``; path relative
    to the pool file): the search uses its measured layer times where it has an entry (docs/costmodel.md)."""
    collective_gb_per_s: dict[int, Annotated[float, Field(le=MAX_GB_PER_S)]] = Field(default_factory=dict)
    """Measured all-reduce bus bandwidth (nccl-tests' busbw, GB/s) inside one node of this offer, by group size
    (``{2: 35.8, 8: 1.35}``; sizes 2 to ``devices_per_node``): a TP group of that size runs at it instead of
    the catalog's link (docs/costmodel.md); the emitted plan carries it as ``network.collective_gb_per_s``. At
    most 12,500 GB/s each (``config.MAX_GB_PER_S``)."""

    @model_validator(mode="after")
    def _spot_fields(self) -> OfferSpec:
        if self.owned and self.pricing == Pricing.SPOT:
            raise ValueError("an owned offer cannot be priced as spot (nobody takes your own devices back); "
                             "remove pricing: spot, or owned: true")
        if self.price_per_hour == 0 and not self.owned:
            raise ValueError("price_per_hour is 0 but the offer is not owned; rented devices have a price. For "
                             "devices you own, add owned: true")
        if (self.spot_price_per_hour is not None and self.price_per_hour is not None
                and self.spot_price_per_hour > self.price_per_hour):
            raise ValueError(
                f"spot_price_per_hour ({self.spot_price_per_hour:g}) is above price_per_hour "
                f"({self.price_per_hour:g}); a spot price is a discount on the on-demand one. Check the two prices"
            )
        if self.trace and self.pricing != Pricing.SPOT:
            raise ValueError("trace is set but pricing is 'on-demand'; traces describe spot losses. Set "
                             "pricing: spot, or remove trace")
        if self.interruptions_per_hour and self.pricing != Pricing.SPOT:
            raise ValueError(
                "interruptions_per_hour is set but pricing is 'on-demand'; on-demand devices are not "
                "taken back. Set pricing: spot, or remove interruptions_per_hour"
            )
        return self


class PoolNetwork(FrozenModel):
    """``network:`` of a pool: measured bandwidths between pairs of offers."""

    links: dict[str, Annotated[float, Field(gt=0, le=MAX_GBPS)]] = Field(default_factory=dict)
    """Gbit/s between the nodes of two offers, keyed ``"offer-a/offer-b"`` (either order; offer names as in
    ``offers``); replaces ``cross_offer_gbps`` for that pair. At most 100,000 (``config.MAX_GBPS``)."""


class PoolSpec(FrozenModel):
    """``pool.yaml``: the offers the planner may rent from."""

    currency: str = "USD"
    """Currency of the prices (offers may override); results are reported in it."""
    offers: list[OfferSpec] = Field(min_length=1)
    """Offers; each may be used by at most one device group of a plan."""
    cross_offer_gbps: float = Field(default=100.0, gt=0, le=MAX_GBPS)
    """Bandwidth in Gbit/s between nodes of different offers (the slow link of a mixed plan); at most 100,000
    (``config.MAX_GBPS``, a physical bound: faster than any link a node has)."""
    network: PoolNetwork = Field(default_factory=lambda: PoolNetwork())
    """Measured links between offers."""

    @model_validator(mode="after")
    def _unique_names(self) -> PoolSpec:
        seen: set[str] = set()
        for i, o in enumerate(self.offers):
            key = o.name or o.accelerator
            if key in seen:
                raise LocatedError(f"two offers are called '{key}'. To fix: give each a distinct `name:` (e.g. "
                                   f"'{key}-spot')", ("offers", i, "name" if o.name else "accelerator"))
            seen.add(key)
        for pair in self.network.links:
            names = pair.split("/")
            if len(names) != 2 or any(n not in seen for n in names):
                raise LocatedError(f"'{pair}' must name two offers as 'a/b'. To fix: use offer names (offers: "
                                   f"{', '.join(sorted(seen))})", ("network", "links", pair))
        return self


@dataclass(frozen=True)
class Offer:
    """A resolved offer: catalog figures filled in, price in the pool currency."""

    name: str
    """Unique label within the pool."""
    accelerator: str
    """Catalog id."""
    count: int
    """Devices available."""
    devices_per_node: int
    """Devices per node."""
    price_per_hour: float
    """Price actually paid per device-hour (spot or on-demand), in the pool currency."""
    pricing: Pricing
    """Spot or on-demand."""
    interruptions_per_hour: float
    """Expected device losses per device-hour (0 for on-demand)."""
    inter_node_gbps: float
    """NIC bandwidth per node, Gbit/s."""
    billing_granularity_s: int
    """Billing unit, seconds."""
    memory_gb: float
    """Device memory, GB."""
    owned: bool = False
    """Devices already owned (price 0 unless an amortised cost was given)."""
    host_memory_gb: float | None = None
    """RAM per node, GB (None: unknown, so no CPU offload on this offer)."""
    host_memory_source: str = ""
    """Where ``host_memory_gb`` comes from (the pool file, or the catalog's default instance type)."""
    price_source: str = ""
    """Where ``price_per_hour`` comes from, with its date when it is the catalog's."""
    trace: Trace | None = None
    """Spot only: the preemption trace the spot overhead is simulated on (None: Young/Daly alone)."""
    profile: Any = None
    """A measured ``costmodel.profile.ModelProfile`` of this offer's accelerator (None: analytic); checked
    against the job's model when the search starts."""
    profile_source: str = ""
    """Where ``profile`` was named (``<pool>: offers[i].profile``), for error messages."""
    collective_gb_per_s: tuple[tuple[int, float], ...] = ()
    """Measured all-reduce bus bandwidth (GB/s) inside one node, as ``(group size, GB/s)`` pairs by size."""


@dataclass(frozen=True)
class Pool:
    """A validated pool: resolved offers and the cross-offer link."""

    currency: str
    """Currency of every price in ``offers``."""
    offers: tuple[Offer, ...]
    """Offers in file order."""
    cross_offer_gbps: float
    """Bandwidth between nodes of different offers, Gbit/s."""
    source: str = "<pool>"
    """Where the pool came from (for messages)."""
    links: tuple[tuple[str, str, float], ...] = ()
    """Measured Gbit/s between pairs of offers (``network.links``)."""

    def link_gbps(self, a: str, b: str) -> float:
        """Gbit/s between nodes of offers ``a`` and ``b`` (different offers): the measured link, else
        ``cross_offer_gbps``."""
        for x, y, gbps in self.links:
            if {x, y} == {a, b}:
                return gbps
        return self.cross_offer_gbps

    def slowest_link_gbps(self, names: Any) -> float:
        """The slowest link between any two of the named offers (``cross_offer_gbps`` for fewer than two)."""
        names = list(names)
        pairs = [self.link_gbps(a, b) for i, a in enumerate(names) for b in names[i + 1:] if a != b]
        return min(pairs) if pairs else self.cross_offer_gbps

    @property
    def fastest_link_gbps(self) -> float:
        """The fastest link between two offers (bounds the cross-group sync from below)."""
        return max([self.cross_offer_gbps, *(g for _, _, g in self.links)])

    @property
    def num_devices(self) -> int:
        """Devices over all offers."""
        return sum(o.count for o in self.offers)

    @property
    def free(self) -> bool:
        """True when no offer costs anything (every device owned, price 0)."""
        return all(o.price_per_hour == 0 for o in self.offers)

    def offer(self, name: str) -> Offer:
        """The offer called ``name``."""
        for o in self.offers:
            if o.name == name:
                return o
        raise ConfigError(f"{self.source}: no offer named '{name}' (offers: {', '.join(o.name for o in self.offers)})")


def _cheapest(catalog: Any, acc_id: str, currency: str, spot: bool) -> tuple[float, Any] | None:
    """Cheapest hourly catalog price of an accelerator in ``currency`` and its catalog offer (None if the catalog
    has none). Day and month packages are never a default: their per-hour figure is not rentable by the hour."""
    from starverse.catalog import convert

    off = catalog.cheapest_offer(acc_id, spot=spot, currency=currency)
    if off is None:
        return None
    p = off.spot_price_per_hour if spot else off.price_per_hour
    return convert(p, off.currency, currency, catalog=catalog), off


def resolve_pool(spec: PoolSpec, catalog: Any, source: str = "<pool>", node: Any = None) -> Pool:
    """Check a pool against the catalog and fill in defaults; errors name the file line and field."""
    from starverse.catalog import convert

    def fail(loc: tuple[int | str, ...], msg: str) -> ConfigError:
        line = _line_of(node, loc) if node is not None else None
        where = f"{source}:{line}" if line is not None else source
        return ConfigError(f"{where}: {format_loc(loc)}: {msg}")

    try:
        convert(1.0, spec.currency, "USD", catalog=catalog)
    except CatalogError as e:
        raise fail(("currency",), str(e)) from None
    offers = []
    for i, o in enumerate(spec.offers):
        try:
            acc = catalog.accelerator(o.accelerator)
        except CatalogError as e:
            raise fail(("offers", i, "accelerator"), str(e)) from None
        ccy = o.currency or spec.currency
        try:
            rate = convert(1.0, ccy, spec.currency, catalog=catalog)
        except CatalogError as e:
            raise fail(("offers", i, "currency"), str(e)) from None
        spot = o.pricing == Pricing.SPOT
        given = o.spot_price_per_hour if spot else o.price_per_hour
        if given is None and o.owned:
            given = 0.0
        field = "spot_price_per_hour" if spot else "price_per_hour"
        granularity = o.billing_granularity_s
        price_source = ""
        if given is not None:
            price: float | None = given * rate
            price_source = f"{source}: offers[{i}].{field}" if not o.owned or given else "owned (price 0)"
        else:
            found = _cheapest(catalog, acc.id, spec.currency, spot)
            price = None if found is None else found[0]
            if found is not None:
                off = found[1]
                price_source = f"catalog: {off.provider}, {off.as_of} ({off.source})"
                granularity = granularity or off.billing_granularity_s
        if price is None:
            raise fail(
                ("offers", i),
                f"no {field} given and the catalog has no {'spot' if spot else 'on-demand'} price for "
                f"'{acc.id}' billed by the hour; add {field}: to this offer",
            )
        trace = None
        if o.trace:
            path = Path(o.trace) if Path(o.trace).is_absolute() or source.startswith("<") else Path(source).parent / o.trace
            try:
                trace = load_trace_events(path)
            except ConfigError as e:
                raise fail(("offers", i, "trace"), str(e)) from None
        profile = None
        if o.profile:
            from starverse.costmodel.profile import load_profile

            path = Path(o.profile) if Path(o.profile).is_absolute() or source.startswith("<") \
                else Path(source).parent / o.profile
            try:
                profile = load_profile(path)
            except ConfigError as e:
                raise fail(("offers", i, "profile"), str(e)) from None
            if profile.accelerator != acc.id:
                raise fail(("offers", i, "profile"), f"{path} was measured on '{profile.accelerator}', not on this "
                           f"offer's '{acc.id}'; probe this accelerator or remove profile:")
        dpn = o.devices_per_node or acc.devices_per_node
        for size, gbps in o.collective_gb_per_s.items():
            if not 2 <= size <= dpn:
                raise fail(("offers", i, "collective_gb_per_s"),
                           f"group size {size} is not one TP can use here; give sizes from 2 to {dpn} (this "
                           f"offer's devices per node), e.g. {{2: 35.8}}")
            if not gbps > 0:
                raise fail(("offers", i, "collective_gb_per_s"),
                           f"{size}: {gbps:g} GB/s; give the measured all-reduce bus bandwidth of {size} GPUs, "
                           f"> 0 GB/s (nccl-tests' busbw), or remove the entry")
        host = o.host_memory_gb if o.host_memory_gb is not None else acc.host_memory_gb
        host_source = (f"{source}: offers[{i}].host_memory_gb" if o.host_memory_gb is not None
                       else f"catalog: {acc.sources.get('host_memory_gb', 'default instance type')}")
        offers.append(
            Offer(
                name=o.name or o.accelerator,
                accelerator=acc.id,
                count=o.count,
                devices_per_node=dpn,
                price_per_hour=float(price),
                pricing=o.pricing,
                interruptions_per_hour=float(o.interruptions_per_hour if o.interruptions_per_hour is not None
                                             else trace.removals_per_node_hour if trace is not None else 0.0),
                inter_node_gbps=o.inter_node_gbps or acc.inter_node_gbps,
                billing_granularity_s=granularity or 1,
                memory_gb=acc.memory_gb,
                owned=o.owned,
                host_memory_gb=host,
                host_memory_source=host_source if host is not None else "",
                price_source=price_source,
                trace=trace,
                profile=profile,
                profile_source=f"{source}: offers[{i}].profile",
                collective_gb_per_s=tuple(sorted((int(n), float(g)) for n, g in o.collective_gb_per_s.items())),
            )
        )
    links = tuple((a, b, float(g)) for pair, g in spec.network.links.items() for a, b in [pair.split("/")])
    return Pool(spec.currency, tuple(offers), spec.cross_offer_gbps, source, links)


def load_pool(path: str | Path, catalog: Any = None) -> Pool:
    """Read and validate ``pool.yaml`` (schema, then accelerators and currencies against the catalog)."""
    from starverse.catalog import load_catalog

    data, node = read_yaml(path)
    spec = parse(PoolSpec, data, str(path), node)
    return resolve_pool(spec, catalog if catalog is not None else load_catalog(), str(path), node)


def pool_from_dict(data: Any, catalog: Any = None, source: str = "<pool>") -> Pool:
    """Build a pool from a mapping (the Python API: ``plan_for(pool={...})``)."""
    from starverse.catalog import load_catalog

    spec = parse(PoolSpec, data, source)
    return resolve_pool(spec, catalog if catalog is not None else load_catalog(), source)
