"""The launcher side of in-place recovery: a torchft Lighthouse and replicas that may die without stopping the job.

:class:`InplaceLauncher` is a :class:`~starverse.runtime.launch.Launcher` for ``recovery: in-place`` on this
machine. It starts a torchft ``LighthouseServer`` in its own process (bound to 127.0.0.1), spawns one
process per replica like :class:`~starverse.providers.local.LocalLauncher` (same rank entry, heartbeat and
parent-death rules) but without a ``torch.distributed`` world: each replica runs
:func:`starverse.runtime.ft.train_replica`, whose torchft ``Manager`` finds the others through the
Lighthouse. Unlike the local launcher it does not fail fast on a lost replica:

- a replica killed (signal, exit without a result, heartbeat lost) is recorded as a :class:`Loss` (its
  :class:`~starverse.errors.LostRankError`, and when it happened); the survivors finish the step in flight
  without it; the job goes on;
- with ``replace_after_s`` set, a replacement for the same rank (same device) is started that long after the
  loss; it joins at a step boundary with the live state of a peer (a :class:`Join`). With ``warm_spares`` (the
  default) the replacement is a *warm spare*: one process per device kind started with the job, which has
  imported torch and torchft and loaded the model and waits, outside the quorum, on the launcher's store;
  "started" then means activated (``activate/<slot>`` set), so the process start-up is not on the join's path.
  The launcher starts the next spare of that kind once the activated one committed its first step (before, its
  start-up would slow the join on a busy host). Without a live spare the replacement is a fresh process
  (*cold*, :attr:`Join.warm` False);
- the job fails, with a typed error as the local launcher's, when a replica raises (a code error), when
  every replica is lost (the supervisor then restarts from the last checkpoint) or past ``timeout_s``.

``launch`` returns one result per rank; a rank lost for good (not replaced) has ``None``. ``losses`` and
``joins`` of the last launch stay readable on the launcher (the job layer bills the lost leases from them).
"""

from __future__ import annotations

import logging
import os
import queue
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from starverse.errors import ConfigError, LossCause, LostRankError
from starverse.providers.failures import code_error, lost_heartbeat, lost_process, overrun, user_error
from starverse.providers.local import (
    LocalLauncher,
    _main_reimport_guard,
    _rank_entry,
    _stop_all,
    rank_context,
    signal_processes,
)
from starverse.runtime.ft_group import (
    EXTRA_BARRIER_PORT,
    EXTRA_FT_HOST,
    EXTRA_JOINER,
    EXTRA_LIGHTHOUSE,
    EXTRA_REPLICA_STORE,
    EXTRA_SPARE,
    JOINED_KEY,
    REPLICA_ENV,
    SPARE_KEY,
    announce_loss,
    quiet_torchft,
)
from starverse.runtime.launch import (
    LOOPBACK,
    Launcher,
    RankEnv,
    RankError,
    RankSpec,
    ordered_ranks,
    store_server,
)

log = logging.getLogger(__name__)

SPARE_SLOTS = 16
"""Spare processes one launch may start (each activation starts the next one)."""


@dataclass(frozen=True)
class Loss:
    """A replica lost during an in-place run."""

    error: LostRankError
    """What the launcher saw (rank, device kind, cause)."""
    at: float
    """``time.time()`` when the launcher noticed."""


@dataclass(frozen=True)
class Join:
    """A replacement replica started during an in-place run."""

    rank: int
    """The rank (replica index) it replaces."""
    device_kind: str
    """Its accelerator id."""
    at: float
    """``time.time()`` when it was started (a warm spare: activated; its lease starts here)."""
    warm: bool = False
    """True: a warm spare was activated; False: a fresh process was spawned."""


class Lighthouse:
    """A torchft ``LighthouseServer`` on ``host`` (127.0.0.1; a free port), for one launch.

    ``heartbeat_timeout_ms``: a replica silent this long is out of the next quorum (how fast a SIGKILLed one is
    dropped); ``join_timeout_ms``: how long a quorum waits for a heartbeating replica that has not asked to join
    (the launcher uses the collective timeout: a short one leaves a replica that is merely slower than the others
    out of every other quorum).
    """

    def __init__(self, *, heartbeat_timeout_ms: int = 1000, join_timeout_ms: int = 1000, quorum_tick_ms: int = 20,
                 host: str = LOOPBACK):
        quiet_torchft()
        from torchft.coordination import LighthouseServer

        self._server = LighthouseServer(bind=f"{host}:0", min_replicas=1, join_timeout_ms=join_timeout_ms,
                                        quorum_tick_ms=quorum_tick_ms, heartbeat_timeout_ms=heartbeat_timeout_ms)
        # address() names the machine's hostname; the server listens on ``host`` only
        self.address = f"http://{host}:{self._server.address().rsplit(':', 1)[1]}"

    def shutdown(self) -> None:
        """Stop the server."""
        self._server.shutdown()


@dataclass
class InplaceLauncher:
    """Runs torchft replicas on this machine; survives lost replicas (see the module docstring)."""

    replace_after_s: float | None = None
    """Start a replacement for a lost replica this long after the loss (None: the survivors go on alone)."""
    heartbeat_s: float = 1.0
    """How often each replica stamps its heartbeat (and checks that its parent is alive)."""
    heartbeat_timeout_s: float = 60.0
    """A replica whose process lives but whose heartbeat is older than this is lost (and stopped)."""
    lighthouse_heartbeat_ms: int = 1000
    """The Lighthouse's heartbeat timeout (see :class:`Lighthouse`)."""
    warm_spares: bool = True
    """With ``replace_after_s``: keep one pre-started spare process per device kind (see the module docstring)."""
    losses: list[Loss] = field(default_factory=list, init=False)
    """Replicas lost in the last launch."""
    joins: list[Join] = field(default_factory=list, init=False)
    """Replacements started in the last launch."""
    spares: list[str] = field(default_factory=list, init=False)
    """Device kind of each warm spare process started in the last launch, in order."""
    on_loss: Callable[[Loss], None] | None = field(default=None, repr=False, compare=False)
    """Called (in the launcher's thread) when a replica is lost: the job layer ends its lease there."""
    on_join: Callable[[Join, RankSpec], None] | None = field(default=None, repr=False, compare=False)
    """Called when a replacement is started: the job layer opens its lease."""
    _procs: list[Any] = field(default_factory=list, init=False, repr=False, compare=False)
    _live: dict[int, Any] = field(default_factory=dict, init=False, repr=False, compare=False)
    _restart: LocalLauncher = field(default_factory=LocalLauncher, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.replace_after_s is not None and self.replace_after_s < 0:
            raise ConfigError(f"InplaceLauncher: replace_after_s must be >= 0 (got {self.replace_after_s}).")
        if not 0 < self.heartbeat_s < self.heartbeat_timeout_s:
            raise ConfigError(f"InplaceLauncher: need 0 < heartbeat_s < heartbeat_timeout_s (got {self.heartbeat_s}, "
                              f"{self.heartbeat_timeout_s}).")
        self._restart = LocalLauncher(heartbeat_s=self.heartbeat_s, heartbeat_timeout_s=self.heartbeat_timeout_s)

    def notify(self, signum: int) -> int:
        """Send ``signum`` to every replica process still running (and to the ranks of a plan run on
        :meth:`restart_launcher`)."""
        return signal_processes(self._procs, signum) + self._restart.notify(signum)

    def restart_launcher(self) -> Launcher:
        """The plain local launcher, for a plan in-place recovery does not run (``Trainer.fit`` says why)."""
        return self._restart

    def _begin(self, ranks: Sequence[RankSpec]) -> list[RankSpec]:
        """A launch's ranks in rank order, with the last launch's losses, joins and spares forgotten."""
        self.losses, self.joins, self.spares = [], [], []
        return ordered_ranks(ranks)

    def _coordination(self, world: int, collective_timeout_s: float,
                      host: str = LOOPBACK) -> tuple[Lighthouse, Any, dict[str, Any]]:
        """A launch's torchft Lighthouse and start-barrier store (both on ``host``: 127.0.0.1, or the driver's
        address for replicas on other hosts), and the ``RankEnv.extra`` entries that tell a replica where they are."""
        # a healthy replica late to a step is waited for (as a collective would): only a silent one is dropped
        lighthouse = Lighthouse(heartbeat_timeout_ms=self.lighthouse_heartbeat_ms,
                                join_timeout_ms=int(collective_timeout_s * 1000), host=host)
        barrier = store_server(host, world + 1, collective_timeout_s)
        return lighthouse, barrier, {EXTRA_LIGHTHOUSE: lighthouse.address, EXTRA_BARRIER_PORT: barrier.port,
                                     EXTRA_FT_HOST: host}

    def pids(self) -> dict[int, int]:
        """Rank -> process id of the replicas running now (tests and benchmarks kill them)."""
        return {rank: p.pid for rank, p in list(self._live.items()) if p.exitcode is None and p.pid is not None}

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
        """Run ``fn(rank_env, *args)`` per replica; results in rank order (None: lost for good)."""
        ranks = self._begin(ranks)
        members = replica_members(ranks)
        lighthouse, barrier, extra = self._coordination(len(ranks), collective_timeout_s)
        run = _Run(self, ranks, fn, args, collective_timeout_s, rank_context(), extra, barrier, members)
        multi = any(len(m) > 1 for m in members.values())
        try:
            with _main_reimport_guard():
                for replica in members:
                    run.start_replica(replica, joiner=False)
                # warm spares stand in for one rank: a replica of several ranks is replaced by new processes
                if self.replace_after_s is not None and self.warm_spares and not multi:
                    for kind in dict.fromkeys(r.device_kind for r in ranks):
                        run.start_spare(kind)
            log.info("in-place launch: %d replicas over %d ranks, lighthouse %s", len(members), len(ranks), lighthouse.address)
            run.watch(timeout_s)
        finally:
            _stop_all(run.procs, grace_s if run.failed else 0.0)
            for q in run.queues.values():
                q.close()
            self._procs, self._live = [], {}
            lighthouse.shutdown()
        return [run.values.get(r.rank) for r in ranks]


def replica_members(ranks: Sequence[RankSpec]) -> dict[int, tuple[int, ...]]:
    """Replica -> its ranks, in rank order, from each rank's ``REPLICA_ENV`` (absent: a replica of its own)."""
    out: dict[int, list[int]] = {}
    for spec in ranks:
        out.setdefault(int(dict(spec.env).get(REPLICA_ENV, spec.rank)), []).append(spec.rank)
    return {r: tuple(v) for r, v in sorted(out.items())}


def stopped_with_replica(spec: RankSpec, lost: LostRankError) -> LostRankError:
    """A rank the launcher stopped because another rank of its replica was lost."""
    return LostRankError(
        f"rank {spec.rank} ({spec.device_kind}, {spec.device}) was stopped: rank {lost.rank} of its replica was lost "
        f"({lost.cause.value}) and a replica does not train without one of its stages. The other replicas go on.",
        rank=spec.rank, device_kind=spec.device_kind, device=spec.device, cause=LossCause.REPLICA,
    )


@dataclass
class _Run:
    """One launch's processes and bookkeeping."""

    launcher: InplaceLauncher
    ranks: list[RankSpec]
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    collective_timeout_s: float
    mp_ctx: Any
    extra: dict[str, Any]
    store: Any
    """The launcher's store (start barrier, spare activation)."""
    members: dict[int, tuple[int, ...]]
    """Replica -> its ranks (several: a pipeline's stages, started, lost and replaced together)."""
    procs: list[Any] = field(default_factory=list)
    spares: dict[str, tuple[int, Any]] = field(default_factory=dict)
    """Device kind -> (slot, process) of the warm spare waiting for that kind."""
    slot_rank: dict[int, int] = field(default_factory=dict)
    """An activated spare's slot -> the rank it became (its reports come under the slot)."""
    beat_slot: dict[int, int] = field(default_factory=dict)
    """Rank -> the heartbeat slot of the activated spare now running it."""
    refill: dict[int, str] = field(default_factory=dict)
    """Rank of an activated spare not yet joined -> its device kind (the next spare starts once it joined)."""
    live: dict[int, Any] = field(default_factory=dict)
    values: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, RankError] = field(default_factory=dict)
    pending: list[tuple[float, RankSpec]] = field(default_factory=list)
    """Replacements due: (when, the first rank of the replica to start again)."""
    replica_stores: dict[int, Any] = field(default_factory=dict)
    """Replica of several ranks -> the store of its current processes (their world and torchft Manager meet
    there; a replacement replica gets a new one)."""
    failed: bool = False
    done_at: float | None = None

    def __post_init__(self) -> None:
        # one result queue per process: a process killed while it writes (a lost rank's partner, stopped while it
        # reports its failed collective) holds its queue's write lock for ever; on a shared queue every other rank
        # then blocks at exit behind that lock and the job runs into its timeout
        self.queues: dict[Any, Any] = {}
        # heartbeat slots: one per rank, then one per spare process ever started (at most SPARE_SLOTS)
        self.beats = self.mp_ctx.Array("d", len(self.ranks) + SPARE_SLOTS, lock=False)
        self.next_slot = len(self.ranks)
        self.launcher._procs, self.launcher._live = self.procs, self.live

    def spawn(self, spec: RankSpec, extra: dict[str, Any], name: str) -> Any:
        env = RankEnv(spec=spec, ranks=tuple(self.ranks), collective_timeout_s=self.collective_timeout_s,
                      extra={**self.extra, **extra})
        self.beats[spec.rank] = 0.0
        results = self.mp_ctx.Queue()
        p = self.mp_ctx.Process(
            target=_rank_entry,
            args=(self.fn, env, self.args, None, results, self.beats, os.getpid(), self.launcher.heartbeat_s),
            name=name,
        )
        p.start()
        self.procs.append(p)
        self.queues[p] = results
        return p

    def start(self, spec: RankSpec, *, joiner: bool, extra: dict[str, Any] | None = None) -> None:
        self.beat_slot.pop(spec.rank, None)
        self.live[spec.rank] = self.spawn(spec, {EXTRA_JOINER: joiner, **(extra or {})},
                                          f"starverse-replica-rank{spec.rank}")

    def replica_of(self, rank: int) -> int:
        """The replica ``rank`` belongs to."""
        return next(r for r, ranks in self.members.items() if rank in ranks)

    def start_replica(self, replica: int, *, joiner: bool) -> None:
        """Start every rank of ``replica`` (several: with a new store of their own)."""
        ranks = self.members[replica]
        if len(ranks) == 1:
            self.start(self.ranks[ranks[0]], joiner=joiner)
            return
        store = store_server(LOOPBACK, len(ranks), self.collective_timeout_s)
        self.replica_stores[replica] = store
        for rank in ranks:
            self.start(self.ranks[rank], joiner=joiner, extra={EXTRA_REPLICA_STORE: store.port})

    def stop_partners(self, lost: LostRankError) -> list[LostRankError]:
        """Stop the other ranks of the lost rank's replica (their errors are consequences, not code errors)."""
        out = []
        for rank in self.members[self.replica_of(lost.rank)]:
            p = self.live.pop(rank, None)
            if rank == lost.rank or p is None:
                continue
            if p.exitcode is None:
                p.kill()
            self.errors.pop(rank, None)
            out.append(stopped_with_replica(self.ranks[rank], lost))
        return out

    def start_spare(self, kind: str) -> None:
        """A warm spare for ``kind`` (it runs as the first rank of that kind until activated as the lost one)."""
        if self.next_slot >= len(self.beats):
            log.warning("in-place: no spare slot left; later replacements of %s start cold", kind)
            return
        slot, self.next_slot = self.next_slot, self.next_slot + 1
        like = next(r for r in self.ranks if r.device_kind == kind)
        p = self.spawn(replace(like, rank=slot), {EXTRA_JOINER: True, EXTRA_SPARE: True}, f"starverse-spare{slot}")
        self.spares[kind] = (slot, p)
        self.launcher.spares.append(kind)

    def replace_rank(self, spec: RankSpec) -> bool:
        """Start the replacement of ``spec``: activate the warm spare of its kind (then start the next spare);
        a fresh process if there is none. True: it was a warm spare."""
        slot, p = self.spares.pop(spec.device_kind, (-1, None))
        if p is None or p.exitcode is not None:
            self.start_replica(self.replica_of(spec.rank), joiner=True)
            return False
        self.store.delete_key(f"{JOINED_KEY}{spec.rank}")
        self.store.set(f"{SPARE_KEY}{slot}", str(spec.rank))
        self.slot_rank[slot], self.beat_slot[spec.rank] = spec.rank, slot
        self.live[spec.rank] = p
        self.refill[spec.rank] = spec.device_kind
        return True

    def refill_spares(self, lost: set[int]) -> None:
        """Start the next spare of a kind once its activated spare joined (or was lost before it did)."""
        if self.finished:  # the survivors finished: no more spares
            self.refill.clear()
        for rank, kind in list(self.refill.items()):
            if rank in lost or self.store.check([f"{JOINED_KEY}{rank}"]):
                del self.refill[rank]
                with _main_reimport_guard():
                    self.start_spare(kind)

    def drain(self, wait_s: float) -> None:
        """Read what the replicas reported (waiting up to ``wait_s`` for the first message). A process ended by
        a signal is not read: it may have died in the middle of a message."""
        deadline = time.monotonic() + wait_s
        while True:
            got = False
            for p, q in list(self.queues.items()):
                if p.exitcode is not None and p.exitcode < 0:
                    continue
                try:
                    while True:
                        self.take(*q.get_nowait())
                        got = True
                except queue.Empty:
                    pass
            if got or time.monotonic() >= deadline:
                return
            time.sleep(0.01)

    def take(self, rank: int, status: str, payload: Any) -> None:
        """One report of a process (its result or its error)."""
        if rank >= len(self.ranks):  # a spare: activated (reports as its slot) or not (ignored)
            if rank not in self.slot_rank:
                log.warning("in-place: a spare process ended before it was activated (%s)", status)
                return
            rank = self.slot_rank[rank]
        if status == "ok":
            self.values[rank] = payload
            self.live.pop(rank, None)
        else:
            self.errors[rank] = payload

    @property
    def finished(self) -> bool:
        """A replica returned its result (a replacement that found no one to join returns None: not counted)."""
        return any(v is not None for v in self.values.values())

    def finish_joiners(self, now: float) -> None:
        """Once a replica finished, the others finish the same step within moments; a process still running
        well after that is a replacement that never joined: it is stopped (its result is None)."""
        if self.done_at is None:
            self.done_at = now
        if self.live and now - self.done_at > self.collective_timeout_s / 4:
            for rank, p in list(self.live.items()):
                log.warning("in-place: rank %d did not finish with the others; stopping it", rank)
                p.kill()
                self.live.pop(rank)

    def absorb_losses(self, now: float) -> set[int]:
        """Record the replicas lost since the last look (the job goes on); their ranks."""
        launcher, gone = self.launcher, set[int]()
        for rank, p in list(self.live.items()):
            if rank not in self.live:  # stopped with its replica in this pass
                continue
            last = self.beats[self.beat_slot.get(rank, rank)]
            lost: LostRankError | None = None
            if p.exitcode is not None:
                self.drain(0.2)  # its result may still be on the way
                if rank in self.values or rank in self.errors:
                    continue
                lost = lost_process(self.ranks[rank], p.exitcode)
            elif p.exitcode is None and last > 0 and now - last > launcher.heartbeat_timeout_s:
                p.kill()
                lost = lost_heartbeat(self.ranks[rank], now - last, survived=True)
            if lost is None:
                continue
            # the survivors give up their collectives with it now: its connections may stay open (a stopped process
            # whose sockets another holds, a host off the network), and gloo would wait for the collective timeout
            announce_loss(self.store, self.replica_of(rank))
            for err in [lost, *self.stop_partners(lost)]:
                gone.add(err.rank)
                loss = Loss(err, time.time())
                launcher.losses.append(loss)
                log.warning("in-place: rank %d (%s) lost (%s%s); the other replicas go on", err.rank, err.device_kind,
                            err.cause.value, f", signal {err.signal}" if err.signal is not None else "")
                if launcher.on_loss is not None:
                    launcher.on_loss(loss)
            if launcher.replace_after_s is not None:
                first = self.members[self.replica_of(rank)][0]
                self.pending.append((now + launcher.replace_after_s, self.ranks[first]))
        return gone

    def watch(self, timeout_s: float) -> None:
        """Until every live replica reported (and no replacement is pending), absorbing losses."""
        launcher = self.launcher
        deadline = time.monotonic() + timeout_s
        while self.live or self.pending:
            self.drain(0.05)
            now = time.monotonic()
            if self.errors:
                time.sleep(0.5)  # let a root cause report too
                self.refill_spares(self.absorb_losses(time.monotonic()))  # a lost stage's partners fail with it
            if self.errors:
                self.failed = True
                user = user_error(self.errors)
                raise user if user is not None else code_error(self.ranks, self.errors)
            self.refill_spares(self.absorb_losses(now))
            if not self.live and not self.finished:
                # every replica lost (a replacement that found no one returns None): nobody holds the live state
                self.failed = True
                raise next(x.error for x in reversed(launcher.losses) if x.error.cause != LossCause.REPLICA)
            if self.finished:
                self.pending.clear()  # the survivors finished: no one to join
                self.finish_joiners(now)
            for due, spec in list(self.pending):
                if now >= due:
                    self.pending.remove((due, spec))
                    at = time.time()
                    with _main_reimport_guard():
                        warm = self.replace_rank(replace(spec))
                    for rank in self.members[self.replica_of(spec.rank)]:  # every rank of the replica
                        member = self.ranks[rank]
                        join = Join(rank, member.device_kind, at, warm)
                        launcher.joins.append(join)
                        if launcher.on_join is not None:
                            launcher.on_join(join, member)
                        log.info("in-place: started a replacement for rank %d (%s)", rank,
                                 "warm spare" if warm else "new process")
            if now > deadline:
                self.failed = True
                raise overrun(timeout_s, len(self.values), len(self.ranks))
