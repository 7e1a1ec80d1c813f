"""Driver-side Ray helpers of the launchers (:mod:`starverse.providers.ray`, :mod:`starverse.providers.ray_inplace`):
what a rank reserves and where its actor is placed, signals to rank processes on any node, killing a hung actor,
the actors' heartbeat store, and the release of a job's actors and placement group."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Sequence
from typing import Any, Protocol

from starverse.errors import DistributedError
from starverse.providers.heartbeat import BeatWatch, driver_host
from starverse.runtime.launch import LOOPBACK, RankSpec, store_server

log = logging.getLogger(__name__)

# A rank pinned to a node kind reserves this much of the kind's resource: enough to require it, small
# enough that any number of ranks fit on a node that has it (Ray resources have 1e-4 granularity).
_PIN_AMOUNT = 0.001


class BundleOptions(Protocol):
    """What a rank's reservation is made of (:class:`~starverse.providers.ray.RayLauncher`'s fields)."""

    num_cpus_per_rank: float
    kind_resources: dict[str, str] | None


def rank_bundle(spec: RankSpec, opts: BundleOptions) -> dict[str, float]:
    """What one rank reserves: CPUs, a GPU for a CUDA rank, a sliver of its kind's node resource if pinned."""
    bundle = {"CPU": opts.num_cpus_per_rank}
    if spec.device.startswith("cuda"):
        bundle["GPU"] = 1.0
    resource = (opts.kind_resources or {}).get(spec.device_kind)
    if resource:
        bundle[resource] = _PIN_AMOUNT
    return bundle


def place_ranks(ray: Any, bundles: list[dict[str, float]], wait_s: float) -> Any:
    """Reserve one bundle per rank (a placement group, PACK: ranks share nodes where they fit, spread when they
    must); raise :class:`DistributedError` saying what the cluster lacks if it cannot within ``wait_s``."""
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group(bundles, strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=wait_s)
    if ready:
        return pg
    with contextlib.suppress(Exception):
        remove_placement_group(pg)
    need_cpu = sum(b["CPU"] for b in bundles)
    need_gpu = sum(b.get("GPU", 0.0) for b in bundles)
    have = ray.cluster_resources()
    pinned = sorted({k for b in bundles for k in b if k not in ("CPU", "GPU")})
    missing = [k for k in pinned if have.get(k, 0.0) <= 0]
    lacking = f" No node has the resource(s) {missing} that kind_resources pins ranks to." if missing else ""
    raise DistributedError(
        f"the Ray cluster cannot place {len(bundles)} ranks within {wait_s:g} s: "
        f"they need {need_cpu:g} CPUs and {need_gpu:g} GPUs, the cluster has "
        f"{have.get('CPU', 0):g} CPUs and {have.get('GPU', 0):g} GPUs (some may be in use).{lacking} To fix: "
        "add nodes (`ray start --address=...` on each), lower the number of ranks, lower "
        "RayLauncher.num_cpus_per_rank, or correct RayLauncher.kind_resources."
    )


def release(ray: Any, actors: Sequence[Any], pg: Any) -> None:
    """Kill a job's actors (those already gone are skipped) and free its placement group."""
    from ray.util.placement_group import remove_placement_group

    for a in actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception as e:  # already gone: nothing to stop
            log.debug("ray.kill: %s", e)
    try:
        remove_placement_group(pg)
    except Exception as e:
        log.debug("remove_placement_group: %s", e)


def actor_options(pg: Any, index: int, bundle: dict[str, float]) -> dict[str, Any]:
    """``.options(...)`` of the actor of the rank whose reservation is ``pg``'s bundle ``index``."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {
        "num_cpus": bundle["CPU"],
        "num_gpus": bundle.get("GPU", 0.0),
        "resources": {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
        "scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index),
    }


def signal_ranks(ray: Any, where: Sequence[tuple[str, int]], signum: int) -> int:
    """Send ``signum`` to the rank processes ``where`` ((Ray node id, pid) each): directly on this node, by a
    zero-CPU task pinned to the rank's node elsewhere; returns how many were reached."""
    if not where:
        return 0
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    n, refs = 0, []
    for node_id, pid in where:
        if node_id == here:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
                n += 1
        else:
            strategy = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
            refs.append(ray.remote(num_cpus=0)(_send_signal).options(scheduling_strategy=strategy)
                        .remote(pid, int(signum)))
    if refs:
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=10.0)
        for ref in ready:
            with contextlib.suppress(Exception):
                n += int(ray.get(ref))
    return n


def kill_hung(ray: Any, actor: Any, where: tuple[str, int] | None) -> None:
    """Kill the actor of a rank whose heartbeat stopped, at once: ``ray.kill`` asks its worker to exit, which a
    stopped process does not do until the raylet's grace period ends (seconds), so its process is SIGKILLed too
    (``where``: its (node id, pid), when known). It cannot come back: the actors are never restarted."""
    with contextlib.suppress(Exception):  # already gone
        ray.kill(actor, no_restart=True)
    if where is not None:
        signal_ranks(ray, [where], signal.SIGKILL)


def beat_watch(ray: Any, store_timeout_s: float, period_s: float, timeout_s: float) -> BeatWatch:
    """A heartbeat store for a job's actors, in the driver: on 127.0.0.1 when every live node is on 127.x, else on
    the driver's node IP (actors on other hosts reach it)."""
    host = driver_host("auto", [n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")],
                       str(ray.util.get_node_ip_address())) or LOOPBACK
    return BeatWatch(store_server(host, 1, store_timeout_s), host, period_s, timeout_s)


def _send_signal(pid: int, signum: int) -> int:
    """A Ray task on a rank's node: deliver ``signum`` to the rank's process; 1 if it was there."""
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        return 0
    return 1
