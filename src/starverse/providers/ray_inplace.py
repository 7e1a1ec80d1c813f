"""In-place recovery on Ray: torchft replicas as Ray actors; a lost actor (its node removed, its process killed)
does not stop the job.

:class:`RayInplaceLauncher` is the Ray counterpart of :class:`starverse.elastic.inplace.InplaceLauncher` (and a
subclass of it, so the supervisor and the ledger read its ``losses`` and ``joins`` and call its ``on_loss`` /
``on_join`` hooks the same way). What is the same: the torchft ``Lighthouse`` runs in the launcher's process
(the driver), bound to 127.0.0.1; the launcher's store holds the start barrier; each replica runs the launched
function (:func:`starverse.runtime.ft.train_replica` for ``recovery: in-place``) without a ``torch.distributed``
world; survivors finish the step in flight with the lost replica's share redistributed. What differs:

- each replica is one Ray actor (:class:`starverse.providers.ray._RankActor`), its bundle of a placement group
  reserved like :class:`~starverse.providers.ray.RayLauncher`'s (CPUs, a GPU for a CUDA rank, a sliver of the
  node resource named after its device kind with ``kind_resources``);
- a replica of several ranks (a pipeline's stages, ``REPLICA_ENV``) is several actors meeting on a store of their
  own in the driver; losing one stage's actor loses the replica: the launcher kills its other actors (each a
  ``LostRankError`` with cause ``replica``) and replaces all of them together;
- a rank is lost when Ray reports its actor dead (``RayActorError``: the process was killed, or its node
  left the cluster): a :class:`~starverse.errors.LostRankError` with cause ``actor death`` and the node, decided
  on that type, never on a message;
- with ``replace_after_s``, the replacement is a new actor for the same bundle of the placement group: Ray
  re-reserves a lost node's bundles on a node that has the resources (a free one, or a node added back), and the
  actor starts there when it can; it joins at a step boundary with a peer's live state. It counts as a
  :class:`~starverse.elastic.inplace.Join` (``on_join``: its lease opens) once its actor runs on a node, not while
  it waits for one; one that never got a node is no join (the rank stays lost for good). Warm spares are not built
  on Ray (``warm_spares`` must stay False): the join pays the actor's start, imports and model load.

Not built: a hung actor (alive, not stepping) is only caught by the job's timeout (the local launcher's heartbeat
has no Ray counterpart here). The Lighthouse, the store and torchft's managers listen on 127.0.0.1
(:mod:`starverse.runtime.ft_group`): the replicas must share the driver's loopback, i.e. run on this machine's
raylets (``ray.cluster_utils.Cluster``, or ``ray start`` nodes on 127.0.0.1). Replicas on other hosts cannot
reach them; in-place recovery across hosts is not built.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from starverse.elastic.inplace import (
    InplaceLauncher,
    Join,
    Loss,
    replica_members,
    stopped_with_replica,
)
from starverse.errors import ConfigError, LossCause, LostRankError
from starverse.providers.failures import code_error, lost_actor, overrun, user_error
from starverse.providers.ray import (
    ROOT_CAUSE_WAIT_S,
    RayLauncher,
    actor_options,
    actor_spec,
    first_line,
    import_ray,
    place_ranks,
    rank_actor_class,
    rank_bundle,
    ray_session,
    release,
)
from starverse.runtime.ft_group import EXTRA_JOINER, EXTRA_REPLICA_STORE
from starverse.runtime.launch import (
    LOOPBACK,
    Launcher,
    RankEnv,
    RankError,
    RankSpec,
    store_server,
)

log = logging.getLogger(__name__)


@dataclass
class RayInplaceLauncher(InplaceLauncher):
    """Runs torchft replicas as Ray actors; survives lost actors (see the module docstring).

    ``heartbeat_s`` and ``heartbeat_timeout_s`` are not used (Ray reports a dead actor)."""

    ray: RayLauncher = field(default_factory=RayLauncher)
    """Where and how the actors run: ``address``, ``num_cpus_per_rank``, ``kind_resources``, ``placement_timeout_s``
    (a private single-node session when no cluster is named)."""
    warm_spares: bool = False
    """Not built on Ray: must be False."""
    _nodes: dict[int, str] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.warm_spares:
            raise ConfigError("RayInplaceLauncher: warm spares are not built on Ray (a replacement is a new actor). "
                              "To fix: leave warm_spares=False.")

    def notify(self, signum: int) -> int:
        """Forward ``signum`` to every running replica, on whatever node it runs."""
        return self.ray.notify(signum)

    def restart_launcher(self) -> Launcher:
        """The plain Ray launcher (its cluster and placement), for a plan in-place recovery does not run."""
        return self.ray

    def pids(self) -> dict[int, int]:
        """Rank -> process id of the replicas running now (those whose actor reported where it runs)."""
        return dict(self._live)

    def nodes(self) -> dict[int, str]:
        """Rank -> Ray node id of the replicas running now (tests and benchmarks remove their node)."""
        return dict(self._nodes)

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
        """Run ``fn(rank_env, *args)`` per replica actor; results in rank order (None: lost for good)."""
        ranks = self._begin(ranks)
        ray = import_ray()
        with ray_session(ray, self.ray, ranks):
            lighthouse, _barrier, extra = self._coordination(len(ranks), collective_timeout_s)
            run = _RayRun(self, ray, ranks, fn, args, collective_timeout_s, extra, replica_members(ranks))
            try:
                run.place(min(self.ray.placement_timeout_s, timeout_s))
                for replica in run.members:
                    run.start_replica(replica, joiner=False)
                log.info("in-place launch on Ray: %d replicas over %d actors, lighthouse %s", len(run.members),
                         len(ranks), lighthouse.address)
                run.watch(timeout_s)
            finally:
                run.stop()
                lighthouse.shutdown()
        return [run.values.get(r.rank) for r in ranks]


@dataclass
class _RayRun:
    """One launch's actors and bookkeeping."""

    launcher: RayInplaceLauncher
    ray: Any
    ranks: list[RankSpec]
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    collective_timeout_s: float
    extra: dict[str, Any]
    members: dict[int, tuple[int, ...]]
    """Replica -> its ranks (several: a pipeline's stages, started, lost and replaced together)."""
    pg: Any = None
    actor_cls: Any = None
    bundles: list[dict[str, float]] = field(default_factory=list)
    actors: list[Any] = field(default_factory=list)
    """Every actor started (killed at the end)."""
    running: dict[Any, int] = field(default_factory=dict)
    """The ``run_replica`` result ref of each live rank -> its rank."""
    actor_of: dict[int, Any] = field(default_factory=dict)
    """Rank -> its current actor."""
    replica_stores: dict[int, Any] = field(default_factory=dict)
    """Replica of several ranks -> the store its current actors meet on (a replacement replica gets a new one)."""
    where: dict[int, Any] = field(default_factory=dict)
    """Rank -> the ref of its actor's ``(node id, pid)`` and the ref of its node IP."""
    located: dict[int, tuple[str, int, str]] = field(default_factory=dict)
    """Rank -> (node id, pid, node IP) of its live actor, once known."""
    values: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, RankError] = field(default_factory=dict)
    pending: list[tuple[float, RankSpec]] = field(default_factory=list)
    """(when, rank) of replacements to start."""
    joining: set[int] = field(default_factory=set)
    """Ranks of replacement actors started but not yet placed on a node (no Join, no lease yet)."""
    done_at: float | None = None

    def place(self, wait_s: float) -> None:
        """Reserve one bundle per replica."""
        self.bundles = [rank_bundle(r, self.launcher.ray) for r in self.ranks]
        self.pg = place_ranks(self.ray, self.bundles, wait_s)
        self.actor_cls = rank_actor_class(self.ray)

    def start_replica(self, replica: int, *, joiner: bool) -> None:
        """Start the actor of every rank of ``replica`` (several: with a new store of their own, in the driver)."""
        ranks = self.members[replica]
        extra: dict[str, Any] = {}
        if len(ranks) > 1:
            store = store_server(LOOPBACK, len(ranks), self.collective_timeout_s)
            self.replica_stores[replica] = store
            extra[EXTRA_REPLICA_STORE] = store.port
        for rank in ranks:
            self.start(self.ranks[rank], joiner=joiner, extra=extra)
            if joiner:
                self.joining.add(rank)

    def replica_of(self, rank: int) -> int:
        """The replica ``rank`` belongs to."""
        return next(r for r, ranks in self.members.items() if rank in ranks)

    def start(self, spec: RankSpec, *, joiner: bool, extra: dict[str, Any]) -> None:
        """Start the actor of ``spec`` in its bundle (a replacement waits there until Ray re-reserved it)."""
        import sys

        actor = self.actor_cls.options(**actor_options(self.pg, spec.rank, self.bundles[spec.rank])).remote(
            list(sys.path))
        self.actors.append(actor)
        self.actor_of[spec.rank] = actor
        env = RankEnv(spec=actor_spec(spec), ranks=tuple(self.ranks), collective_timeout_s=self.collective_timeout_s,
                      extra={**self.extra, **extra, EXTRA_JOINER: joiner, "launcher": "ray"})
        # an actor runs its calls one at a time, in order: ask where it runs before the replica's long call
        self.where[spec.rank] = (actor.where.remote(), actor.node_ip.remote())
        self.running[actor.run_replica.remote(self.fn, env, self.args)] = spec.rank
        self.located.pop(spec.rank, None)

    def locate(self) -> None:
        """Note where newly started actors run (for :meth:`RayInplaceLauncher.notify` and a loss's node)."""
        for rank, (where, ip) in list(self.where.items()):
            ready, _ = self.ray.wait([where, ip], num_returns=2, timeout=0)
            if len(ready) < 2:
                continue
            del self.where[rank]
            try:
                (node, pid), node_ip = self.ray.get(where), self.ray.get(ip)
            except Exception:  # the actor died before it could tell: its run ref reports the loss
                continue
            self.located[rank] = (str(node), int(pid), str(node_ip))
            if rank in self.joining:  # a replacement runs now, on a node: its lease starts here
                self.joining.discard(rank)
                self.joined(self.ranks[rank])
        self.launcher.ray._procs = [(n, p) for n, p, _ in self.located.values()]
        self.launcher._live = {rank: pid for rank, (_, pid, _) in self.located.items()}
        self.launcher._nodes = {rank: node for rank, (node, _, _) in self.located.items()}

    def collect(self, wait_s: float) -> None:
        """Take the results of finished replicas; record the lost ones (the job goes on)."""
        from ray.exceptions import RayActorError, RayTaskError

        if not self.running:
            return
        done, _ = self.ray.wait(list(self.running), num_returns=len(self.running), timeout=wait_s)
        for ref in done:
            rank = self.running.pop(ref)
            try:
                status, payload = self.ray.get(ref)
            except RayActorError as e:
                self.lose(rank, first_line(e))
                continue
            except RayTaskError as e:  # the actor method failed outside fn (e.g. unpickling its arguments)
                self.errors[rank] = (first_line(e), str(e), None)
                continue
            if status == "ok":
                self.values[rank] = payload
            else:
                self.errors[rank] = payload

    def forget(self, rank: int) -> str | None:
        """Drop what is known of ``rank``'s actor; its node IP if it was known."""
        self.where.pop(rank, None)
        self.joining.discard(rank)  # a replacement lost before it got a node: it never joined
        return self.located.pop(rank, ("", 0, None))[2]

    def lose(self, rank: int, detail: str) -> None:
        """Record the loss of ``rank``'s actor (and stop the other ranks of its replica); schedule a replacement."""
        launcher = self.launcher
        node = self.forget(rank)
        lost: LostRankError = lost_actor(self.ranks[rank], detail, node=node, survived=True)
        for err in [lost, *self.stop_partners(lost)]:
            loss = Loss(err, time.time())
            launcher.losses.append(loss)
            log.warning("in-place: rank %d (%s) lost (%s, node %s); the other replicas go on", err.rank,
                        err.device_kind, err.cause.value, node)
            if launcher.on_loss is not None:
                launcher.on_loss(loss)
        if launcher.replace_after_s is not None and not self.finished:
            first = self.members[self.replica_of(rank)][0]
            self.pending.append((time.monotonic() + launcher.replace_after_s, self.ranks[first]))

    def stop_partners(self, lost: LostRankError) -> list[LostRankError]:
        """Kill the other live ranks of the lost rank's replica (a pipeline does not train without a stage); their
        errors (a collective that lost its peer) are consequences, not code errors."""
        out = []
        for rank in self.members[self.replica_of(lost.rank)]:
            refs = [ref for ref, r in self.running.items() if r == rank]
            if rank == lost.rank or not (refs or rank in self.errors):
                continue
            for ref in refs:
                del self.running[ref]
            with contextlib.suppress(Exception):  # already gone
                self.ray.kill(self.actor_of[rank], no_restart=True)
            self.errors.pop(rank, None)
            self.forget(rank)
            out.append(stopped_with_replica(self.ranks[rank], lost))
        return out

    @property
    def finished(self) -> bool:
        """A replica returned its result (a replacement that found no one to join returns None: not counted)."""
        return any(v is not None for v in self.values.values())

    def replace_due(self, now: float) -> None:
        """Start the replacements whose time came (each is a :class:`Join` once its actor runs on a node)."""
        for due, spec in list(self.pending):
            if now < due:
                continue
            self.pending.remove((due, spec))
            replica = self.replica_of(spec.rank)
            self.start_replica(replica, joiner=True)
            log.info("in-place: started replacement actors for replica %d (ranks %s)", replica,
                     list(self.members[replica]))

    def joined(self, spec: RankSpec) -> None:
        """A replacement's actor was placed and runs: record the :class:`Join` and open its lease (``on_join``)."""
        launcher = self.launcher
        join = Join(spec.rank, spec.device_kind, time.time(), warm=False)
        launcher.joins.append(join)
        if launcher.on_join is not None:
            launcher.on_join(join, spec)

    def watch(self, timeout_s: float) -> None:
        """Until every live replica reported (and no replacement is pending), absorbing losses."""
        deadline = time.monotonic() + timeout_s
        while self.running or self.pending:
            self.collect(0.05)
            self.locate()
            now = time.monotonic()
            if self.errors:
                # a stage's partners fail on the lost connection before Ray declares its actor dead: wait for that
                until = time.monotonic() + ROOT_CAUSE_WAIT_S
                while self.errors and time.monotonic() < until:
                    self.collect(0.1)
            if self.errors:
                user = user_error(self.errors)
                raise user if user is not None else code_error(self.ranks, self.errors)
            if not self.running and not self.finished:
                # every replica lost (a replacement that found no one returns None): nobody holds the live state
                raise next(x.error for x in reversed(self.launcher.losses) if x.error.cause != LossCause.REPLICA)
            if self.finished:
                self.pending.clear()  # the survivors finished: no one to join
                self.finish_joiners(now)
            self.replace_due(now)
            if now > deadline:
                raise overrun(timeout_s, len(self.values), len(self.ranks))

    def finish_joiners(self, now: float) -> None:
        """Once a replica finished, the others finish the same step within moments; an actor still running well
        after that is a replacement that never joined (say, still waiting for a node): it is stopped."""
        if self.done_at is None:
            self.done_at = now
        if self.running and now - self.done_at > self.collective_timeout_s / 4:
            for rank in sorted(self.running.values()):
                log.warning("in-place: rank %d did not finish with the others; stopping it", rank)
            self.running.clear()

    def stop(self) -> None:
        """Kill every actor of the launch and free the placement group."""
        self.launcher.ray._procs, self.launcher._live, self.launcher._nodes = [], {}, {}
        if self.pg is not None:
            release(self.ray, self.actors, self.pg)
