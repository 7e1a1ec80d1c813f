"""A pool read from a running Ray cluster: ``--pool ray://ADDRESS`` and ``pool: {ray: auto}``.

What each live node offers is read from its Ray resources:

- a **custom resource named after a catalog accelerator id** (``ray start --resources '{"rtx-4090": 8}'``) is
  that many devices of that accelerator on that node;
- a node with no such resource is a **CPU node**: it offers one ``cpu`` device per CPU (one rank each, as the Ray
  launcher reserves one CPU per rank); a head started with ``--num-cpus=0`` offers nothing;
- Ray's own resources (``CPU``, ``GPU``, ``memory``, ``object_store_memory``, ``node:*``, ``accelerator_type:*``,
  TPU and placement-group ones) are not devices. Any other custom resource that is not a catalog id is an
  error naming it (with a did-you-mean), so a typo never silently drops a node's devices.

Prices come from the operator's price list: ``prices``, a pool file whose offers price accelerators (the first
offer of each id: pricing mode, price, currency, billing granularity, ``owned``); an accelerator it does not list
gets the catalog's cheapest on-demand price; a ``cpu`` device without a listed price is owned (price 0). The
counts are always the cluster's.

:class:`RayPoolSource` is also the supervisor's pool source (:class:`~starverse.elastic.supervisor.PoolSource`):
at each re-plan it reads the cluster again, so a node that joined or left changes the devices re-planned on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starverse.config import did_you_mean, read_yaml
from starverse.errors import ConfigError
from starverse.planner.pool import Pool, pool_from_dict
from starverse.runtime.launch import RankSpec

log = logging.getLogger(__name__)

SCHEME = "ray://"
AUTO = "auto"
"""``pool: {ray: auto}``: the cluster at ``$RAY_ADDRESS``, else the session this process already joined."""
_RAY_OWN = frozenset({"CPU", "GPU", "memory", "object_store_memory"})
_RAY_OWN_PREFIXES = ("node:", "accelerator_type:", "TPU", "bundle_group_")
CONNECT_TIMEOUT_S = 3.0
"""How long the address may take to accept a TCP connection before it is called unreachable."""


@dataclass(frozen=True)
class RayNode:
    """One live node of the cluster and the devices it offers."""

    node_id: str
    """Ray's node id."""
    ip: str
    """The node's IP address."""
    devices: Mapping[str, int]
    """Accelerator id -> devices on this node (``cpu`` for a CPU node)."""


def is_ray_pool(ref: object) -> bool:
    """True for ``ray://ADDRESS`` or a mapping with a ``ray`` key (``{ray: auto}``)."""
    return (isinstance(ref, str) and ref.startswith(SCHEME)) or (isinstance(ref, Mapping) and "ray" in ref)


def _is_ray_own(name: str) -> bool:
    return name in _RAY_OWN or name.startswith(_RAY_OWN_PREFIXES) or "_group_" in name


def nodes_from_ray(raw_nodes: Sequence[Mapping[str, Any]], accelerator_ids: Sequence[str], source: str) -> list[RayNode]:
    """The live nodes of ``ray.nodes()`` and their devices (see the module docstring); ConfigError for a custom
    resource that is not a catalog accelerator id."""
    known = set(accelerator_ids)
    out = []
    for n in raw_nodes:
        if not n.get("Alive"):
            continue
        res: Mapping[str, float] = n.get("Resources") or {}
        devices: dict[str, int] = {}
        for name, amount in sorted(res.items()):
            if _is_ray_own(name):
                continue
            if name not in known:
                raise ConfigError(
                    f"{source}: node {n.get('NodeManagerAddress', '?')} has resource '{name}', which is not an "
                    f"accelerator id of the catalog.{did_you_mean(name, sorted(known))} To fix: start the node with "
                    "--resources naming catalog ids (`starverse catalog` lists them), or add the accelerator to "
                    "the catalog (--catalog)"
                )
            if int(amount) > 0:
                devices[name] = int(amount)
        if not devices and int(res.get("CPU", 0)) > 0:
            devices["cpu"] = int(res["CPU"])
        if devices:
            out.append(RayNode(str(n.get("NodeID", "")), str(n.get("NodeManagerAddress", "")), devices))
    return out


def pool_dict(nodes: Sequence[RayNode], prices: Mapping[str, Any] | None, source: str) -> dict[str, Any]:
    """A ``pool.yaml`` mapping for these nodes: one offer per accelerator with the cluster's count and its
    largest per-node count, priced from ``prices`` (a pool mapping) else the catalog (``cpu``: owned)."""
    if not nodes:
        raise ConfigError(
            f"{source}: the Ray cluster offers no device: no live node has an accelerator resource or a CPU. To fix: "
            "start its nodes with --resources '{\"<accelerator id>\": <count>}' (or --num-cpus for CPU nodes)"
        )
    counts: Counter[str] = Counter()
    per_node: dict[str, int] = {}
    for node in nodes:
        for acc, num in node.devices.items():
            counts[acc] += num
            per_node[acc] = max(per_node.get(acc, 0), num)
    listed: dict[str, dict[str, Any]] = {}
    for offer in (prices or {}).get("offers") or []:
        if isinstance(offer, Mapping) and isinstance(offer.get("accelerator"), str):
            listed.setdefault(offer["accelerator"], dict(offer))
    offers = []
    for acc in sorted(counts):
        offer = {k: v for k, v in listed.get(acc, {}).items() if k not in ("count", "devices_per_node", "name")}
        if acc == "cpu" and not offer:
            offer = {"owned": True}
        offers.append({**offer, "accelerator": acc, "count": counts[acc], "devices_per_node": per_node[acc]})
    return {"currency": (prices or {}).get("currency", "USD"), "offers": offers}


def _check_reachable(address: str, source: str) -> None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"{source}: '{address}' is not HOST:PORT. To fix: give the cluster's GCS address, e.g. "
                          "ray://10.0.0.1:6379 (what `ray start --head` prints)")
    try:
        with socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as e:
        raise ConfigError(
            f"{source}: cannot reach the Ray cluster at {address} ({e.strerror or e}). To fix: start it "
            "(`ray start --head --port=6379`) and pass its head's address"
        ) from None


@contextlib.contextmanager
def ray_session(address: str, source: str) -> Iterator[Any]:
    """The ``ray`` module connected to the cluster: the session this process already has, else a driver joined
    to ``address`` (``auto``: ``$RAY_ADDRESS``) and disconnected after."""
    from starverse.providers.ray_session import import_ray, is_loopback, join_cluster, loopback_only

    ray = import_ray()
    if ray.is_initialized():
        yield ray
        return
    if address == AUTO:
        address = os.environ.get("RAY_ADDRESS", "")
        if not address:
            raise ConfigError(f"{source}: ray: auto, but RAY_ADDRESS is not set and no Ray session is running. "
                              "To fix: set RAY_ADDRESS=HOST:PORT, or give the address (ray: HOST:PORT)")
    address = address.removeprefix(SCHEME)
    _check_reachable(address, source)
    from starverse.providers.ray import RayLauncher

    with loopback_only(ray) if is_loopback(address) else contextlib.nullcontext():
        try:
            join_cluster(ray, RayLauncher(address=address), address)
        except Exception as e:  # a refused join (authentication) is the user's setting: one line
            raise ConfigError(f"{source}: {e}") from None
        try:
            yield ray
        finally:
            ray.shutdown()


def _load_prices(prices: str | Path | None) -> dict[str, Any] | None:
    if prices is None:
        return None
    data, _ = read_yaml(prices)
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prices}: a price list is a pool file (currency:, offers: [...]); got "
                          f"{type(data).__name__}")
    return dict(data)


@dataclass
class RayPoolSource:
    """Reads the pool of a running Ray cluster (see the module docstring); the supervisor's pool source."""

    address: str = AUTO
    """``HOST:PORT`` (``ray://`` optional) of the cluster's GCS, or ``auto``."""
    prices: str | Path | None = None
    """The operator's price list (a pool file); None: the catalog's prices."""
    catalog: Any = None
    """The catalog (None: the bundled one)."""
    _catalog: Any = field(default=None, init=False, repr=False)

    @property
    def source(self) -> str:
        """The pool's name in messages."""
        return self.address if self.address.startswith(SCHEME) or self.address == AUTO else SCHEME + self.address

    def _cat(self) -> Any:
        if self._catalog is None:
            from starverse.catalog import load_catalog

            self._catalog = self.catalog if self.catalog is not None else load_catalog()
        return self._catalog

    def nodes(self) -> list[RayNode]:
        """The cluster's live nodes and their devices, now."""
        with ray_session(self.address, self.source) as ray:
            raw = ray.nodes()
        return nodes_from_ray(raw, list(self._cat().accelerators), self.source)

    def pool(self) -> Pool:
        """The cluster's devices now, as a priced pool (what ``plan`` searches)."""
        data = pool_dict(self.nodes(), _load_prices(self.prices), self.source)
        return pool_from_dict(data, self._cat(), source=self.source)

    def ranks(self) -> list[RankSpec]:
        """One rank per device the cluster offers now (what a job on this pool starts on)."""
        return self.current_ranks([], [])

    def launcher(self) -> Any:
        """The Ray launcher for this cluster: ranks of an accelerator kind pinned to nodes carrying its resource."""
        from starverse.providers.ray import RayLauncher

        kinds = sorted({k for n in self.nodes() for k in n.devices if k != "cpu"})
        address = None if self.address == AUTO else self.address.removeprefix(SCHEME)
        return RayLauncher(address=address, kind_resources={k: k for k in kinds} or None)

    def current_ranks(self, survivors: Sequence[RankSpec], lost: Sequence[RankSpec]) -> list[RankSpec]:
        """The supervisor's re-plan hook: one rank per device the cluster offers now, the survivors first (they
        keep their device string and settings), then devices that joined. ``lost`` is what the launcher lost
        (its devices are gone from the cluster when their node left)."""
        now: Counter[str] = Counter()
        for node in self.nodes():
            now.update(node.devices)
        log.info("Ray pool at re-plan: %s (lost %d rank(s))", dict(now), len(lost))
        kept: list[RankSpec] = []
        for r in [*survivors, *lost]:
            if now[r.device_kind] > 0:
                now[r.device_kind] -= 1
                kept.append(r)
        template = {r.device_kind: r for r in [*survivors, *lost]}
        for kind, num in sorted(now.items()):
            like = template.get(kind)
            device = like.device if like is not None else ("cpu" if kind == "cpu" else "cuda:0")
            kept += [RankSpec(0, kind, device, like.num_threads if like else 1, like.env if like else ())
                     for _ in range(num)]
        return [RankSpec(i, r.device_kind, r.device, r.num_threads, r.env) for i, r in enumerate(kept)]


def pool_source_for(ref: str | Mapping[str, Any] | Any, *, catalog: Any = None, base: Path | None = None) -> RayPoolSource:
    """A :class:`RayPoolSource` for ``ray://ADDRESS`` or ``{ray: auto|ADDRESS, prices: FILE}`` (``prices``
    relative to ``base``)."""
    if isinstance(ref, str):
        return RayPoolSource(ref, catalog=catalog)
    if not isinstance(ref, Mapping):  # a job's RayPoolSettings (prices already absolute)
        return RayPoolSource(ref.ray, ref.prices, catalog=catalog)
    unknown = sorted(set(ref) - {"ray", "prices"})
    if unknown:
        raise ConfigError(f"pool: unknown field '{unknown[0]}'.{did_you_mean(unknown[0], ['ray', 'prices'])} "
                          "To fix: a Ray pool is {ray: auto | HOST:PORT, prices: PRICE_LIST.yaml}")
    address, prices = ref.get("ray"), ref.get("prices")
    if not isinstance(address, str) or not address:
        raise ConfigError(f"pool.ray: must be 'auto' or HOST:PORT (got {address!r})")
    if prices is not None and base is not None and not Path(str(prices)).is_absolute():
        prices = base / str(prices)
    return RayPoolSource(address, prices, catalog=catalog)


def load_pool_ref(ref: str | Path, catalog: Any = None) -> Pool:
    """The pool ``plan --pool`` names: ``ray://ADDRESS`` (the cluster's devices, catalog prices), a file holding a
    Ray pool (``ray: auto | HOST:PORT`` and an optional ``prices:`` price list, relative to the file), or a
    ``pool.yaml``."""
    from starverse.planner.pool import load_pool

    text = str(ref)
    if text.startswith(SCHEME):
        return RayPoolSource(text, catalog=catalog).pool()
    data, _ = read_yaml(text)
    if isinstance(data, Mapping) and "ray" in data:
        src = pool_source_for(data, catalog=catalog, base=Path(text).parent)
        return src.pool()
    return load_pool(text, catalog)
