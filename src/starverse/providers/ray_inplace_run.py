"""One in-place launch on Ray (:class:`~starverse.providers.ray_inplace.RayInplaceLauncher`): its replica actors,
warm spares, heartbeats, losses and replacements, watched until every live replica reported (the behaviour is
described in :mod:`starverse.providers.ray_inplace`)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from starverse.elastic.inplace import SPARE_SLOTS, Join, Loss, stopped_with_replica
from starverse.errors import LossCause, LostRankError
from starverse.providers.failures import code_error, lost_actor, lost_heartbeat, overrun, user_error
from starverse.providers.heartbeat import BeatWatch
from starverse.providers.ray import ROOT_CAUSE_WAIT_S, RayLauncher
from starverse.providers.ray_actor import actor_spec, rank_actor_class
from starverse.providers.ray_placement import actor_options, kill_hung, place_ranks, rank_bundle, release
from starverse.providers.ray_session import first_line
from starverse.runtime.ft_group import (
    EXTRA_JOINER,
    EXTRA_REPLICA_STORE,
    EXTRA_SPARE,
    JOINED_KEY,
    SPARE_KEY,
    announce_loss,
    ft_host,
)
from starverse.runtime.launch import RankEnv, RankError, RankSpec, store_server

log = logging.getLogger(__name__)


class RunOwner(Protocol):
    """What a run reads and updates on its launcher (a :class:`~starverse.providers.ray_inplace.RayInplaceLauncher`):
    its settings, the records the supervisor and the ledger read, its hooks, and what it reports as running."""

    ray: RayLauncher
    heartbeat_s: float
    heartbeat_timeout_s: float
    replace_after_s: float | None
    losses: list[Loss]
    joins: list[Join]
    spares: list[str]
    on_loss: Callable[[Loss], None] | None
    on_join: Callable[[Join, RankSpec], None] | None
    _live: dict[int, Any]
    _nodes: dict[int, str]
    _spare_nodes: dict[int, str]


@dataclass
class RayRun:
    """One launch's actors and bookkeeping."""

    launcher: RunOwner
    ray: Any
    ranks: list[RankSpec]
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    collective_timeout_s: float
    extra: dict[str, Any]
    members: dict[int, tuple[int, ...]]
    """Replica -> its ranks (several: a pipeline's stages, started, lost and replaced together)."""
    store: Any
    """The launcher's store (start barrier, spare activation, the joined signal)."""
    bind_node: bool = False
    """Each replica binds and advertises its node's IP (not 127.0.0.1)."""
    beats: BeatWatch | None = None
    """The actors' heartbeats, on the launcher's store (set at the start)."""
    beat_key: dict[int, str] = field(default_factory=dict)
    """Actor key (a rank, or a spare's slot) -> the heartbeat key of its current actor."""
    pg: Any = None
    actor_cls: Any = None
    bundles: list[dict[str, float]] = field(default_factory=list)
    placement: dict[int, tuple[Any, int, dict[str, float]]] = field(default_factory=dict)
    """Actor key (a rank, or a spare's slot from ``len(ranks)`` on) -> (placement group, bundle index, bundle) its
    actor runs in. An activated spare keeps its bundle; the lost rank's becomes the next spare's."""
    spare_pgs: list[Any] = field(default_factory=list)
    """The spares' placement groups (one bundle each), removed at the end."""
    spares: dict[str, int] = field(default_factory=dict)
    """Device kind -> slot of the spare actor waiting for that kind."""
    spare_refs: dict[Any, int] = field(default_factory=dict)
    """The ``run_replica`` ref of each spare not yet activated -> its slot."""
    refill: dict[int, tuple[str, tuple[Any, int, dict[str, float]]]] = field(default_factory=dict)
    """Rank of an activated spare not yet joined -> (its kind, the bundle freed for the next spare)."""
    next_slot: int = 0
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

    def __post_init__(self) -> None:
        launcher = self.launcher
        self.beats = BeatWatch(self.store, ft_host(self.extra), launcher.heartbeat_s, launcher.heartbeat_timeout_s)

    def place(self, wait_s: float) -> None:
        """Reserve one bundle per replica."""
        self.bundles = [rank_bundle(r, self.launcher.ray) for r in self.ranks]
        self.pg = place_ranks(self.ray, self.bundles, wait_s)
        self.placement = {r.rank: (self.pg, r.rank, self.bundles[r.rank]) for r in self.ranks}
        self.next_slot = len(self.ranks)
        self.actor_cls = rank_actor_class(self.ray)

    def start_replica(self, replica: int, *, joiner: bool) -> None:
        """Start the actor of every rank of ``replica`` (several: with a new store of their own, in the driver)."""
        ranks = self.members[replica]
        extra: dict[str, Any] = {}
        if len(ranks) > 1:
            store = store_server(ft_host(self.extra), len(ranks), self.collective_timeout_s)
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
        env = RankEnv(spec=actor_spec(spec), ranks=tuple(self.ranks), collective_timeout_s=self.collective_timeout_s,
                      extra={**self.extra, **extra, EXTRA_JOINER: joiner, "launcher": "ray"})
        self.running[self.new_actor(spec.rank, env)] = spec.rank

    def new_actor(self, key: int, env: RankEnv) -> Any:
        """Start an actor in the bundle of ``key`` (a rank or a spare's slot) running ``fn`` for ``env``; its ref."""
        pg, index, bundle = self.placement[key]
        actor = self.actor_cls.options(**actor_options(pg, index, bundle)).remote(list(sys.path))
        self.actors.append(actor)
        self.actor_of[key] = actor
        # an actor runs its calls one at a time, in order: ask where it runs before the replica's long call
        self.where[key] = (actor.where.remote(), actor.node_ip.remote())
        self.located.pop(key, None)
        assert self.beats is not None
        beat = self.beats.new_beat()
        self.beat_key[key] = beat.key
        return actor.run_replica.remote(self.fn, env, self.args, self.bind_node, beat)

    def spare_bundle(self, kind: str) -> tuple[Any, int, dict[str, float]]:
        """A placement group of its own (not waited for) with one bundle like a rank of ``kind``'s."""
        from ray.util.placement_group import placement_group

        bundle = self.bundles[next(r.rank for r in self.ranks if r.device_kind == kind)]
        pg = placement_group([bundle], strategy="PACK")
        self.spare_pgs.append(pg)
        return pg, 0, bundle

    def start_spare(self, kind: str, where: tuple[Any, int, dict[str, float]]) -> None:
        """A spare actor for ``kind`` in bundle ``where``: it runs as the first rank of that kind (as its own slot)
        until activated as the lost one."""
        if self.next_slot >= len(self.ranks) + SPARE_SLOTS:
            log.warning("in-place: no spare slot left; later replacements of %s start cold", kind)
            return
        slot, self.next_slot = self.next_slot, self.next_slot + 1
        like = next(r for r in self.ranks if r.device_kind == kind)
        self.placement[slot] = where
        mapped = tuple(actor_spec(r) for r in self.ranks)  # what the activated spare's rank sees in its actor
        env = RankEnv(spec=dataclasses.replace(mapped[like.rank], rank=slot), ranks=mapped,
                      collective_timeout_s=self.collective_timeout_s,
                      extra={**self.extra, EXTRA_JOINER: True, EXTRA_SPARE: True, "launcher": "ray"})
        self.spare_refs[self.new_actor(slot, env)] = slot
        self.spares[kind] = slot
        self.launcher.spares.append(kind)

    def activate_spare(self, spec: RankSpec) -> bool:
        """Replace ``spec`` by the running spare of its kind (then it is that rank: its ref, actor, bundle); the
        lost rank's bundle is kept for the next spare. False: no spare is running (it waits for room, or died)."""
        slot = self.spares.get(spec.device_kind)
        ref = next((r for r, s in self.spare_refs.items() if s == slot), None)
        if slot is None or ref is None or slot not in self.located:
            return False
        del self.spares[spec.device_kind], self.spare_refs[ref]
        self.store.delete_key(f"{JOINED_KEY}{spec.rank}")
        self.store.set(f"{SPARE_KEY}{slot}", str(spec.rank))
        self.running[ref] = spec.rank
        self.actor_of[spec.rank] = self.actor_of.pop(slot)
        self.located[spec.rank] = self.located.pop(slot)
        self.beat_key[spec.rank] = self.beat_key.pop(slot)
        self.refill[spec.rank] = (spec.device_kind, self.placement[spec.rank])
        self.placement[spec.rank] = self.placement.pop(slot)
        self.joined(spec, warm=True)
        log.info("in-place: activated the spare actor of slot %d as rank %d", slot, spec.rank)
        return True

    def refill_spares(self) -> None:
        """Start the next spare of a kind, in the lost rank's bundle, once its activated spare committed a step (or
        was lost before it did); none once a replica finished."""
        if self.finished:
            self.refill.clear()
        for rank, (kind, where) in list(self.refill.items()):
            if rank not in self.running.values() or self.store.check([f"{JOINED_KEY}{rank}"]):
                del self.refill[rank]
                self.start_spare(kind, where)

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
        ranks = {k: v for k, v in self.located.items() if k < len(self.ranks)}  # not the spares waiting
        self.launcher.ray._procs = [(n, p) for n, p, _ in ranks.values()]
        self.launcher._live = {rank: pid for rank, (_, pid, _) in ranks.items()}
        self.launcher._nodes = {rank: node for rank, (node, _, _) in ranks.items()}
        self.launcher._spare_nodes = {s: self.located[s][0] for s in self.spare_refs.values() if s in self.located}

    def collect(self, wait_s: float) -> None:
        """Take the results of finished replicas; record the lost ones (the job goes on)."""
        from ray.exceptions import RayActorError, RayTaskError

        self.collect_spares()
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

    def collect_spares(self) -> None:
        """A spare that ended before it was activated (its node lost, its start failed) is dropped, not replaced
        (as under the local launcher): the next replacement of its kind starts cold."""
        if not self.spare_refs:
            return
        done, _ = self.ray.wait(list(self.spare_refs), num_returns=len(self.spare_refs), timeout=0)
        for ref in done:
            slot = self.spare_refs.pop(ref)
            try:
                status, payload = self.ray.get(ref)
                why = f"{status}: {payload[0] if status == 'error' else payload}"
            except Exception as e:
                why = first_line(e)
            log.warning("in-place: the spare actor of slot %d ended before it was activated (%s)", slot, why)
            self.where.pop(slot, None)
            self.located.pop(slot, None)
            self.spares = {k: s for k, s in self.spares.items() if s != slot}

    def forget(self, rank: int) -> str | None:
        """Drop what is known of ``rank``'s actor; its node IP if it was known."""
        self.where.pop(rank, None)
        self.joining.discard(rank)  # a replacement lost before it got a node: it never joined
        return self.located.pop(rank, ("", 0, None))[2]

    def find_hung(self) -> None:
        """Lose the replicas whose heartbeat stood still for ``heartbeat_timeout_s`` (their actor is killed, its ref
        dropped: no actor death is reported for it again); a spare that hung is dropped."""
        assert self.beats is not None
        now = time.monotonic()
        for ref, key in [*[(r, k) for r, k in self.running.items()], *self.spare_refs.items()]:
            quiet = self.beats.silent_s(self.beat_key[key], now) if key in self.beat_key else None
            if quiet is None or (ref not in self.running and ref not in self.spare_refs):
                continue
            located = self.located.get(key)
            kill_hung(self.ray, self.actor_of[key], located[:2] if located else None)
            self.beats.forget(self.beat_key.pop(key))
            if self.spare_refs.pop(ref, None) is not None:
                log.warning("in-place: the spare actor of slot %d sent no heartbeat for %.0f s; dropped", key, quiet)
                self.forget(key)
                self.spares = {k: s for k, s in self.spares.items() if s != key}
                continue
            del self.running[ref]
            node = located[2] if located else None
            self.lose(key, error=lost_heartbeat(self.ranks[key], quiet, node=node, survived=True))

    def lose(self, rank: int, detail: str = "", error: LostRankError | None = None) -> None:
        """Record the loss of ``rank``'s actor (``error``: why; else its death, ``detail`` from Ray), stop the other
        ranks of its replica, tell the survivors (their collectives with it end now); schedule a replacement."""
        launcher = self.launcher
        node = self.forget(rank)
        lost = error or lost_actor(self.ranks[rank], detail, node=node, survived=True)
        announce_loss(self.store, self.replica_of(rank))
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
            if self.activate_spare(spec):
                continue
            replica = self.replica_of(spec.rank)
            self.start_replica(replica, joiner=True)
            log.info("in-place: started replacement actors for replica %d (ranks %s)", replica,
                     list(self.members[replica]))

    def joined(self, spec: RankSpec, *, warm: bool = False) -> None:
        """A replacement's actor was placed and runs (or a spare was activated): record the :class:`Join` and open
        its lease (``on_join``)."""
        launcher = self.launcher
        join = Join(spec.rank, spec.device_kind, time.time(), warm=warm)
        launcher.joins.append(join)
        if launcher.on_join is not None:
            launcher.on_join(join, spec)

    def watch(self, timeout_s: float) -> None:
        """Until every live replica reported (and no replacement is pending), absorbing losses."""
        deadline = time.monotonic() + timeout_s
        while self.running or self.pending:
            self.collect(0.05)
            self.locate()
            self.find_hung()
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
            self.refill_spares()
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
        self.launcher._spare_nodes = {}
        if self.pg is not None:
            release(self.ray, self.actors, self.pg)
        for pg in self.spare_pgs:
            release(self.ray, [], pg)
