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

This module is the launcher and its driver loop (start the actors, collect results, decide the failure); the
session is :mod:`~starverse.providers.ray_session`, the actor :mod:`~starverse.providers.ray_actor`, placement,
signals and clean-up :mod:`~starverse.providers.ray_placement` (their public names are importable from here too).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from starverse.errors import ConfigError, DistributedError, JobTimeoutError, LossCause, LostRankError
from starverse.providers.failures import code_error, lost_actor, lost_heartbeat, overrun, user_error
from starverse.providers.heartbeat import BeatWatch
from starverse.providers.ray_actor import actor_spec, rank_actor_class
from starverse.providers.ray_placement import (
    actor_options,
    beat_watch,
    kill_hung,
    place_ranks,
    rank_bundle,
    release,
    signal_ranks,
)
from starverse.providers.ray_session import ERROR_LINE, first_line, import_ray, loopback_only, ray_session
from starverse.runtime.launch import RankEnv, RankError, RankSpec, ordered_ranks

log = logging.getLogger(__name__)

__all__ = [  # the launcher, and the names other modules and tests import from this path
    "ROOT_CAUSE_WAIT_S",
    "RayLauncher",
    "_loopback_only",
    "actor_options",
    "actor_spec",
    "beat_watch",
    "first_line",
    "import_ray",
    "kill_hung",
    "place_ranks",
    "rank_actor_class",
    "rank_bundle",
    "ray_session",
    "release",
    "signal_ranks",
]

_loopback_only = loopback_only

ROOT_CAUSE_WAIT_S = 3.0
"""After the first failure, how long to wait for the rank that caused it to report (peers fail first on a
closed connection, the dead rank's actor is declared dead by Ray a moment later)."""


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
                named = [m.group(0).strip() for m in ERROR_LINE.finditer(str(e))]
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
