"""The Ray provider: run a job's ranks as Ray actors, on one machine or across a Ray cluster's nodes.

Each rank is one Ray actor (its own worker process) with its own ``torch.distributed`` rank, exactly as a
process of the local launcher (:class:`starverse.providers.local.LocalLauncher`): same ``RankEnv``, same
default process group, same fail-fast rules and the same typed errors (:mod:`starverse.providers.failures`):
``LostRankError`` with cause ``actor death`` and the node when an actor dies, ``RankCodeError`` when a rank
raises, ``JobTimeoutError`` when the job overruns ``timeout_s``.

What differs is where processes come from and where they meet:

* The ranks are gang-scheduled with a placement group (one bundle per rank: ``num_cpus_per_rank`` CPUs,
  plus one GPU for a CUDA rank); a cluster that cannot hold them all fails after ``placement_timeout_s``
  with what it lacks, instead of leaving half the ranks waiting.
* The rendezvous store lives in rank 0's actor, listening on rank 0's node IP only (``MASTER_ADDR``; 127.0.0.1
  for a session on this machine), so ranks on other nodes can reach it and nothing else is exposed; the port
  is chosen by the OS, so jobs never race for one.
* The actors belong to the job: they are killed when it ends, fails or is stopped, and each rank process
  dies with its Ray worker parent; a SIGTERM to the supervisor reaches every rank (:meth:`RayLauncher.notify`),
  which writes the emergency checkpoint as under the local launcher.
* ``address`` (else ``$RAY_ADDRESS``) joins an existing cluster; without one a private single-node Ray is
  started, bound to 127.0.0.1 only, and shut down when the job ends. A Ray session the caller had already
  initialised is left running; only this job's actors and placement group are removed.

``ray`` is an optional dependency (``pip install 'starverse[ray]'``); this module imports it lazily.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from starverse.errors import ConfigError, DistributedError, JobTimeoutError, LossCause, LostRankError
from starverse.providers.failures import code_error, lost_actor, lost_heartbeat, overrun, user_error
from starverse.providers.heartbeat import Beat, BeatWatch, driver_host, start_beating
from starverse.providers.reaper import start_reaper, stop_reaper
from starverse.runtime.launch import (
    LOOPBACK,
    RankEnv,
    RankError,
    RankSpec,
    error_report,
    join_world,
    ordered_ranks,
    rank_environ,
    set_rank_device,
    store_server,
)

log = logging.getLogger(__name__)

# Ray maps a node IP of 127.0.0.1 to the machine's outward address and binds its servers on every
# interface unless it believes clustering is off; this switch (Ray's own) keeps a private session on the
# loopback interface. It is only set for a session this module starts, never for a cluster it joins.
_RAY_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"

ROOT_CAUSE_WAIT_S = 3.0
"""After the first failure, how long to wait for the rank that caused it to report (peers fail first on a
closed connection, the dead rank's actor is declared dead by Ray a moment later)."""


def import_ray() -> Any:
    """Import Ray, or raise a ConfigError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "launcher='ray' needs Ray, which is not installed. To fix: pip install 'starverse[ray]' "
            "(or launcher='local' to run the ranks on this machine without Ray)."
        ) from None
    return ray


@contextlib.contextmanager
def _loopback_only(ray: Any) -> Iterator[None]:
    """While a private session runs, make Ray keep it on 127.0.0.1; restore the caller's setting after.

    Ray reads the switch at import (driver) and from the environment (its daemons and workers, which
    inherit ours), so both are set.
    """
    constants = getattr(getattr(ray, "_private", None), "ray_constants", None)
    old_env = os.environ.get(_RAY_LOOPBACK_ENV)
    old_const = getattr(constants, "ENABLE_RAY_CLUSTER", None)
    os.environ[_RAY_LOOPBACK_ENV] = "0"
    if old_const is not None:
        constants.ENABLE_RAY_CLUSTER = False  # type: ignore[union-attr]
    try:
        yield
    finally:
        if old_env is None:
            os.environ.pop(_RAY_LOOPBACK_ENV, None)
        else:
            os.environ[_RAY_LOOPBACK_ENV] = old_env
        if old_const is not None:
            constants.ENABLE_RAY_CLUSTER = old_const  # type: ignore[union-attr]


@dataclass
class RayLauncher:
    """Runs ``fn(rank_env, *args)`` in one Ray actor per rank (``Trainer(launcher=RayLauncher(...))``).

    ``Trainer(launcher="ray")`` is ``RayLauncher()`` with every default.
    """

    address: str | None = None
    """Ray cluster to join (``ray://host:10001`` or ``host:6379``); None: ``$RAY_ADDRESS``, else a private
    single-node session on 127.0.0.1 started for this job and shut down after it."""
    num_cpus_per_rank: float = 1.0
    """CPUs each rank's bundle reserves (CUDA ranks also reserve one GPU)."""
    placement_timeout_s: float = 60.0
    """Fail if the cluster cannot place every rank within this long (it lacks CPUs/GPUs)."""
    local_num_cpus: int | None = None
    """CPUs a private session advertises (None: this machine's cores, at least enough for every rank)."""
    object_store_memory_mb: int = 100
    """Object store of a private session: the ranks exchange tensors through torch.distributed, not Ray,
    so a small store is enough (Ray's minimum is 75 MB)."""
    runtime_env: dict[str, Any] | None = None
    """Ray ``runtime_env`` for the job (e.g. ``{"py_modules": [...]}`` on a cluster whose nodes lack the
    code); None: the nodes already have starverse and the user's modules installed."""

    kind_resources: dict[str, str] | None = None
    """Pin device kinds to nodes: device kind -> a Ray node resource only nodes with that kind have (what Ray
    detects, e.g. ``{"h100-80gb-sxm": "accelerator_type:H100"}``, or a label given at ``ray start
    --resources='{"rtx-4090": 8}'``). Each rank of that kind then reserves a sliver of it, so on a mixed
    cluster it lands on a node of its kind. None: any node with a free CPU (and GPU for CUDA ranks)."""
    heartbeat_s: float = 1.0
    """How often each rank's actor adds to its heartbeat counter in the driver's store."""
    heartbeat_timeout_s: float = 60.0
    """A rank whose actor lives but whose heartbeat stood still this long is lost (``LossCause.HEARTBEAT``): its
    process is killed and the job fails with that cause, as under the local launcher."""

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_s < self.heartbeat_timeout_s:
            raise ConfigError(f"RayLauncher: need 0 < heartbeat_s < heartbeat_timeout_s (got {self.heartbeat_s}, "
                              f"{self.heartbeat_timeout_s}).")
        if self.num_cpus_per_rank < 0:
            raise ConfigError(f"RayLauncher.num_cpus_per_rank must be >= 0 (got {self.num_cpus_per_rank}).")
        if self.placement_timeout_s <= 0:
            raise ConfigError(f"RayLauncher.placement_timeout_s must be > 0 (got {self.placement_timeout_s}).")
        if self.object_store_memory_mb < 75:
            raise ConfigError(
                f"RayLauncher.object_store_memory_mb must be >= 75, Ray's minimum (got {self.object_store_memory_mb})."
            )
        import_ray()  # a missing Ray fails here, before any data is prepared

    _procs: list[tuple[str, int]] = field(default_factory=list, init=False, repr=False, compare=False)
    """The running job's ranks as (Ray node id, process id), for :meth:`notify`."""

    def notify(self, signum: int) -> int:
        """Forward ``signum`` to every rank of the running job, on whatever node it runs (a job-wide
        preemption notice: SIGTERM); returns how many were reached.

        An actor runs one call at a time in its main thread (where Python handles signals, so the rank's
        notice handler sees it): the signal is sent to its process directly on this node, and by a
        zero-CPU task pinned to its node elsewhere."""
        return signal_ranks(import_ray(), list(self._procs), signum)

    def launch(
        self,
        fn: Callable[..., Any],
        ranks: Sequence[RankSpec],
        *,
        timeout_s: float,
        args: tuple[Any, ...] = (),
        collective_timeout_s: float = 120.0,
        grace_s: float = 3.0,
    ) -> list[Any]:
        """Run ``fn(rank_env, *args)`` on every rank; return the results in rank order.

        Same contract as :func:`starverse.runtime.launch.launch`: ``fn`` and ``args`` must be picklable;
        a ``StarverseError`` raised in a rank is re-raised as itself; a rank that raises, whose actor dies
        (killed, out of memory, node lost) or a job past ``timeout_s`` raises ``DistributedError`` with
        ``failed_rank`` (``rank_exitcode`` is None for a dead actor: Ray does not report the exit status).
        ``grace_s`` is accepted for the contract but unused: actors are killed at once (``ray.kill``).
        """
        ranks = ordered_ranks(ranks)
        ray = import_ray()
        with ray_session(ray, self, ranks):
            return _run_job(ray, self, fn, ranks, timeout_s, args, collective_timeout_s, grace_s)


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


@contextlib.contextmanager
def ray_session(ray: Any, opts: RayLauncher, ranks: Sequence[RankSpec]) -> Iterator[None]:
    """A Ray session for one job: the caller's if it already initialised one (left running), else the cluster at
    ``opts.address`` / ``$RAY_ADDRESS`` (this driver disconnects after), else a private one on 127.0.0.1 (shut
    down after)."""
    if ray.is_initialized():  # the caller's session: use it, leave it running
        yield
        return
    address = opts.address or os.environ.get("RAY_ADDRESS") or None
    if address is not None:
        # A cluster on this machine's loopback (a local `ray start --head --node-ip-address=127.0.0.1`)
        # must be joined as one: Ray would otherwise rewrite 127.0.0.1 to the outward address.
        loopback = _is_loopback(address)
        with _loopback_only(ray) if loopback else contextlib.nullcontext():
            _join(ray, opts, address)
            try:
                yield
            finally:
                ray.shutdown()  # disconnects this driver; the cluster keeps running
        return
    with _loopback_only(ray):
        # the session's daemons must not outlive this process, even when it is SIGKILLed
        reaper = start_reaper()
        try:
            _start_private(ray, opts, ranks)
            try:
                yield
            finally:
                ray.shutdown()  # stops the private session's daemons and workers
        finally:
            stop_reaper(reaper)


def _is_loopback(address: str) -> bool:
    """True for ``127.x.x.x:port``, ``localhost:port`` (optionally ``ray://``)."""
    host = address.split("://", 1)[-1].rsplit(":", 1)[0]
    return host == "localhost" or host.startswith("127.")


@contextlib.contextmanager
def _keep_sigterm_handler() -> Iterator[None]:
    """Keep this process's SIGTERM handler across ``ray.init``: Ray's core worker installs its own (it dumps a
    stack and aborts), which would turn the supervisor's SIGTERM -> emergency checkpoint -> exit 3 into a crash."""
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if in_main else None
    try:
        yield
    finally:
        if in_main and previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _join(ray: Any, opts: RayLauncher, address: str) -> None:
    """Connect this process to the Ray cluster at ``address`` as a driver."""
    log.info("joining the Ray cluster at %s", address)
    try:
        with _keep_sigterm_handler():
            ray.init(address=address, logging_level=logging.WARNING, runtime_env=opts.runtime_env)
    except Exception as e:
        raise DistributedError(
            f"cannot join the Ray cluster at {address}: {_root_cause(e)}. To fix: start it with `ray start --head` "
            "and pass its address (RAY_ADDRESS or RayLauncher(address=...)); if the cluster uses token "
            "authentication (Ray's default once a token exists), set RAY_AUTH_MODE=token with its token in "
            "~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN; or unset RAY_ADDRESS to run on this machine "
            "only."
        ) from e


def _start_private(ray: Any, opts: RayLauncher, ranks: Sequence[RankSpec]) -> None:
    """Start a single-node session on 127.0.0.1 big enough for ``ranks``."""
    want_cpus = math.ceil(opts.num_cpus_per_rank * len(ranks))
    num_cpus = opts.local_num_cpus or max(os.cpu_count() or 1, want_cpus)
    num_gpus = sum(1 for r in ranks if r.device.startswith("cuda"))
    log.info("starting a private Ray session on %s (%d CPUs, %d GPUs)", LOOPBACK, num_cpus, num_gpus)
    with _keep_sigterm_handler():
        _init_private(ray, opts, num_cpus, num_gpus)


def _init_private(ray: Any, opts: RayLauncher, num_cpus: int, num_gpus: int) -> None:
    ray.init(
        # "local": start a new session even where Ray would auto-join one (a `ray start` on this machine,
        # or a stale record of one in /tmp/ray); joining is only ever asked for with an address.
        address="local",
        _node_ip_address=LOOPBACK,
        include_dashboard=False,
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        object_store_memory=opts.object_store_memory_mb * 1024 * 1024,
        logging_level=logging.WARNING,
        runtime_env=opts.runtime_env,
    )


class _RankActor:
    """One rank's process. Methods run one at a time, in call order."""

    def __init__(self, sys_path: list[str]) -> None:
        # Like multiprocessing's spawn: let the rank import what the caller's process could (a test module
        # or script directory holding the model class), before any argument is unpickled.
        for p in reversed(sys_path):
            if p not in sys.path and os.path.isdir(p):
                sys.path.insert(0, p)
        self._store: Any = None

    def node_ip(self) -> str:
        """The IP of the node this actor runs on (how the other ranks reach it)."""
        import ray

        return str(ray.util.get_node_ip_address())

    def open_store(self, host: str, world: int, timeout_s: float) -> int:
        """Rank 0 only: own the rendezvous store for the job, listening on ``host`` only; returns its port."""
        self._store = store_server(host, world, timeout_s)
        return int(self._store.port)

    def where(self) -> tuple[str, int]:
        """(Ray node id, process id) of this rank."""
        import ray

        return str(ray.get_runtime_context().get_node_id()), os.getpid()

    def run(
        self, fn: Callable[..., Any], env: RankEnv, args: tuple[Any, ...], master_addr: str, port: int,
        beat: Beat | None = None,
    ) -> tuple[str, Any]:
        """Start the heartbeat (``beat``), set up the environment and process group, run ``fn``; report
        ``("ok", value)`` or ``("error", ...)``.

        Exceptions are caught and reported as data (text, traceback, the error itself if a StarverseError),
        the same triple the local launcher sends, so the driver applies the same rules to both.
        """
        try:
            if beat is not None:
                start_beating(beat, env.collective_timeout_s)
            return ("ok", _run_rank(fn, env, args, master_addr, port))
        except BaseException as e:
            return ("error", error_report(e))


    def run_replica(self, fn: Callable[..., Any], env: RankEnv, args: tuple[Any, ...],
                    bind_node: bool = False, beat: Beat | None = None) -> tuple[str, Any]:
        """Run ``fn`` without a ``torch.distributed`` world (an in-place replica forms its own torchft groups);
        report as :meth:`run`. ``bind_node``: the replica binds and advertises this node's IP (``bind_host``, replicas
        on several hosts), not 127.0.0.1. ``beat``: its heartbeat, as :meth:`run`."""
        try:
            if beat is not None:
                start_beating(beat, env.collective_timeout_s)
            host = LOOPBACK
            if bind_node:
                from starverse.runtime.ft_group import EXTRA_BIND_HOST

                host = self.node_ip()
                env = dataclasses.replace(env, extra={**env.extra, EXTRA_BIND_HOST: host})
            rank_environ(env, host, 0)
            set_rank_device(env)
            return ("ok", fn(env, *args))
        except BaseException as e:
            return ("error", error_report(e))


def _send_signal(pid: int, signum: int) -> int:
    """A Ray task on a rank's node: deliver ``signum`` to the rank's process; 1 if it was there."""
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        return 0
    return 1


def _run_rank(fn: Callable[..., Any], env: RankEnv, args: tuple[Any, ...], master_addr: str, port: int) -> Any:
    """Body of a rank inside its actor: the same set-up as the local launcher's ``_rank_entry``."""
    import torch.distributed as dist

    rank_environ(env, master_addr, port)
    join_world(env, master_addr, port)
    try:
        return fn(env, *args)
    finally:
        dist.destroy_process_group()


# A rank pinned to a node kind reserves this much of the kind's resource: enough to require it, small
# enough that any number of ranks fit on a node that has it (Ray resources have 1e-4 granularity).
_PIN_AMOUNT = 0.001


def rank_bundle(spec: RankSpec, opts: RayLauncher) -> dict[str, float]:
    """What one rank reserves: CPUs, a GPU for a CUDA rank, a sliver of its kind's node resource if pinned."""
    bundle = {"CPU": opts.num_cpus_per_rank}
    if spec.device.startswith("cuda"):
        bundle["GPU"] = 1.0
    resource = (opts.kind_resources or {}).get(spec.device_kind)
    if resource:
        bundle[resource] = _PIN_AMOUNT
    return bundle


def actor_spec(spec: RankSpec) -> RankSpec:
    """The spec as seen inside the actor: Ray shows a CUDA rank only its own GPU, as ``cuda:0``."""
    if spec.device.startswith("cuda"):
        return dataclasses.replace(spec, device="cuda:0")
    return spec


def _run_job(
    ray: Any,
    opts: RayLauncher,
    fn: Callable[..., Any],
    ranks: list[RankSpec],
    timeout_s: float,
    args: tuple[Any, ...],
    collective_timeout_s: float,
    grace_s: float,
) -> list[Any]:
    world = len(ranks)
    deadline = time.monotonic() + timeout_s
    bundles = [rank_bundle(r, opts) for r in ranks]
    pg = place_ranks(ray, bundles, min(opts.placement_timeout_s, timeout_s))
    actors: list[Any] = []
    try:
        actor_cls = rank_actor_class(ray)
        for i in range(world):
            actors.append(actor_cls.options(**actor_options(pg, i, bundles[i])).remote(list(sys.path)))
        where = _get_before(ray, [a.where.remote() for a in actors], ranks, deadline, timeout_s, "start its actors")
        opts._procs = [(str(node), int(pid)) for node, pid in where]
        node_ips = _get_before(ray, [a.node_ip.remote() for a in actors], ranks, deadline, timeout_s,
                               "start its actors")
        master_addr = node_ips[0]
        port = _get_before(
            ray, [actors[0].open_store.remote(master_addr, world, collective_timeout_s)], ranks, deadline,
            timeout_s, "open the rendezvous store",
        )[0]
        log.info("launched %d ranks as Ray actors (store %s:%d, nodes %s)", world, master_addr, port, sorted(set(node_ips)))
        beats = beat_watch(ray, collective_timeout_s, opts.heartbeat_s, opts.heartbeat_timeout_s)
        refs, keys = [], []
        for i, (spec, actor) in enumerate(zip(ranks, actors, strict=True)):
            local_rank = node_ips[:i].count(node_ips[i])
            env = RankEnv(
                spec=actor_spec(spec), ranks=tuple(ranks), collective_timeout_s=collective_timeout_s,
                extra={"launcher": "ray", "node_ip": node_ips[i], "local_rank": local_rank},
            )
            beat = beats.new_beat()
            keys.append(beat.key)
            refs.append(actor.run.remote(fn, env, args, master_addr, port, beat))
        hung = _Hung(ray, beats, keys, actors, opts._procs)
        values, errors, dead = _collect(ray, refs, ranks, deadline, timeout_s, hung)
    finally:
        opts._procs = []
        release(ray, actors, pg)
    if len(values) < world:
        raise _failure(ranks, node_ips, values, errors, dead, hung.silent)
    return [values[r] for r in range(world)]


@dataclass
class _Hung:
    """The restart launcher's heartbeat check: a rank whose counter stood still is silent, and its actor killed."""

    ray: Any
    beats: BeatWatch
    keys: list[str]
    """Rank -> its heartbeat key."""
    actors: list[Any]
    where: list[tuple[str, int]]
    """Rank -> (node id, pid) of its actor."""
    silent: dict[int, float] = field(default_factory=dict)
    """Rank -> how long it was silent (the ranks found hung)."""

    def check(self, pending: set[int]) -> bool:
        """Look at the heartbeats of the ranks still running; True if one stopped (its actor is killed)."""
        now = time.monotonic()
        for rank in sorted(pending):
            quiet = self.beats.silent_s(self.keys[rank], now)
            if quiet is not None:
                log.warning("rank %d sent no heartbeat for %.0f s; killing its actor", rank, quiet)
                self.silent[rank] = quiet
                kill_hung(self.ray, self.actors[rank], self.where[rank] if rank < len(self.where) else None)
        return bool(self.silent)


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


def rank_actor_class(ray: Any) -> Any:
    """The Ray actor class of a rank: never restarted by Ray (a lost rank is the launcher's to handle)."""
    return ray.remote(max_restarts=0, max_concurrency=1)(_RankActor)


def actor_options(pg: Any, index: int, bundle: dict[str, float]) -> dict[str, Any]:
    """``.options(...)`` of the actor of the rank whose reservation is ``pg``'s bundle ``index``."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {
        "num_cpus": bundle["CPU"],
        "num_gpus": bundle.get("GPU", 0.0),
        "resources": {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
        "scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index),
    }


def _get_before(ray: Any, refs: list[Any], ranks: list[RankSpec], deadline: float, timeout_s: float,
                what: str) -> list[Any]:
    """Rank by rank ``ray.get`` bounded by the job's deadline; a dead actor here is a start-up failure."""
    from ray.exceptions import GetTimeoutError, RayActorError

    out = []
    for rank, ref in enumerate(refs):
        try:
            out.append(ray.get(ref, timeout=max(0.1, deadline - time.monotonic())))
        except GetTimeoutError:
            raise JobTimeoutError(
                f"job did not finish within {timeout_s:g} s ({rank}/{len(refs)} ranks ready: Ray did not {what} in "
                "time); all ranks were stopped. To fix: raise the timeout, or check `ray status` for a busy cluster.",
                timeout_s=timeout_s, num_done=0, world_size=len(refs),
            ) from None
        except RayActorError as e:
            spec = ranks[rank]
            raise LostRankError(
                f"rank {rank}'s Ray actor died before training started (while trying to {what}): {first_line(e)}. "
                "To fix: check that starverse and torch import on its node (`ray logs`).",
                rank=rank, device_kind=spec.device_kind, device=spec.device, cause=LossCause.ACTOR_DIED,
            ) from e
    return out


def _collect(
    ray: Any, refs: list[Any], ranks: list[RankSpec], deadline: float, timeout_s: float, hung: _Hung | None = None,
) -> tuple[dict[int, Any], dict[int, RankError], dict[int, str]]:
    """Wait for every rank; stop waiting shortly after the first failure (see ``ROOT_CAUSE_WAIT_S``), at once
    when a rank's heartbeat stopped (``hung``: its peers wait on it in a collective)."""
    from ray.exceptions import RayActorError, RayTaskError

    values: dict[int, Any] = {}
    errors: dict[int, RankError] = {}
    dead: dict[int, str] = {}
    rank_of = {ref: spec.rank for ref, spec in zip(refs, ranks, strict=True)}
    pending = list(refs)
    failed_at: float | None = None
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=0.1)
        for ref in done:
            rank = rank_of[ref]
            try:
                status, payload = ray.get(ref)
            except RayActorError as e:
                dead[rank] = first_line(e)
                continue
            except RayTaskError as e:  # the actor method itself failed outside fn (e.g. unpickling args)
                named = [m.group(0).strip() for m in _ERROR_LINE.finditer(str(e))]
                errors[rank] = (named[-1] if named else first_line(e), str(e), None)
                continue
            if status == "ok":
                values[rank] = payload
            else:
                errors[rank] = payload
        if hung is not None and hung.check({rank_of[ref] for ref in pending}):
            break
        now = time.monotonic()
        if (errors or dead) and failed_at is None:
            failed_at = now
        if failed_at is not None and now - failed_at > ROOT_CAUSE_WAIT_S:
            break
        if now > deadline:
            raise overrun(timeout_s, len(values), len(refs))
    return values, errors, dead


def _failure(
    ranks: list[RankSpec],
    node_ips: list[str],
    values: dict[int, Any],
    errors: dict[int, RankError],
    dead: dict[int, str],
    silent: dict[int, float] | None = None,
) -> BaseException:
    """The error for a failed job, root cause first, with the local launcher's priorities.

    Bad input found in a rank (a ConfigError) is re-raised as itself; then a rank whose heartbeat stopped (it
    hung; its peers wait on it); then a rank whose actor died (its peers' errors, a failed checkpoint collective
    included, are only consequences of the lost connection); then another typed error raised in a rank, as
    itself; then the lowest rank that reported an exception.
    """
    user = user_error(errors, ConfigError)
    if user is not None:
        return user
    if silent:
        rank = min(silent)
        return lost_heartbeat(ranks[rank], silent[rank], node=node_ips[rank])
    if dead:
        rank = min(dead)
        return lost_actor(ranks[rank], dead[rank], node=node_ips[rank])
    raised = user_error(errors)
    if raised is not None:
        return raised
    if errors:
        return code_error(ranks, errors, node=node_ips[min(errors)])
    return DistributedError("a rank ended without a result; the other ranks were stopped.")


def first_line(e: BaseException) -> str:
    """The first non-empty line of an error (Ray's messages run to many lines of advice)."""
    for line in str(e).splitlines():
        if line.strip():
            return line.strip()[:300]
    return type(e).__name__


def _root_cause(e: BaseException) -> str:
    """The most specific error line of a chain: Ray wraps the useful one (say an ``AuthenticationError``) in
    generic ones, sometimes only as text inside their message."""
    chain = [e]
    while (inner := chain[-1].__cause__ or chain[-1].__context__) is not None and inner not in chain:
        chain.append(inner)
    for err in reversed(chain):
        named = [m.group(0) for m in _ERROR_LINE.finditer(str(err))]
        if named:
            return named[-1].strip()[:300]
    return f"{type(chain[-1]).__name__}: {first_line(chain[-1])}"


_ERROR_LINE = re.compile(r"^\s*[\w.]+(?:Error|Exception): .+$", re.MULTILINE)
