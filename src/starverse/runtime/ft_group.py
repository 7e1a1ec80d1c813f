"""The torchft side of in-place recovery: each replica's ``Manager`` and reconfigurable gloo group, on loopback.

:class:`TorchftSync` is the :class:`ReplicaSync` the replica loop (:mod:`starverse.runtime.ft`) steps with: the
quorum of a step (a late replica is healed there), the summing all-reduce and the commit vote.

Loopback by default: torchft 0.2.0's ``Manager`` hard-codes its ``ManagerServer`` bind to ``[::]:PORT`` and its
default ``HTTPTransport`` serves on every interface. :func:`loopback_manager_server` replaces the
``ManagerServer`` class torchft's manager module uses by one that binds and advertises one address, ``127.0.0.1``
(:func:`patch_manager_bind`), and the state transfer uses ``PGTransport``; nothing of a replica listens
beyond 127.0.0.1 (``tests/e2e`` lists the job's sockets). A launcher whose replicas run on several hosts (Ray)
names other addresses in ``RankEnv.extra`` (:data:`EXTRA_BIND_HOST`: this replica's node IP; :data:`EXTRA_FT_HOST`:
the driver's), and the replica binds and advertises exactly those.

**Loss notices.** A survivor blocked in an all-reduce with a peer that stopped without closing its connections (a
SIGSTOPped or hung process, a host lost off the network) would wait for the collective timeout: a gloo operation
cannot be interrupted (the gloo backend's ``abort`` is a no-op in torch 2.13). The launcher announces every loss it
sees on its store (:func:`announce_loss`: ``lost/<n>`` = the lost replica's index); each replica's
:class:`LossWatch` thread reads them, and when the lost replica is in the group of this replica's current quorum,
:class:`TorchftSync` gives up its collective in flight at once (the step fails as with a dead peer:
``should_commit`` says no, the step is redone in the next quorum without it). The abandoned gloo operation ends by
itself later (the peer's sockets close, or gloo's own timeout); it is kept referenced until then, so that its
group is not torn down under it.

Also the ``RankEnv.extra`` keys and store keys the launcher (``starverse.elastic.inplace``) and the replicas share.
This module imports only torch, torchft and the runtime.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch

from starverse.errors import ConfigError, DistributedError
from starverse.runtime.launch import LOOPBACK, store_server

log = logging.getLogger(__name__)

EXTRA_LIGHTHOUSE = "lighthouse"
"""``RankEnv.extra`` key: the Lighthouse address (``http://127.0.0.1:PORT``)."""
EXTRA_BARRIER_PORT = "start_barrier_port"
"""``RankEnv.extra`` key: the launcher's store port where the initial replicas meet before the first quorum."""
EXTRA_JOINER = "joiner"
"""``RankEnv.extra`` key: True for a replica started after the job began (it heals from a peer)."""
EXTRA_SPARE = "spare"
"""``RankEnv.extra`` key: True for a warm spare: a process that imports, loads the model, then waits (outside
the quorum) on the launcher's store for the rank it replaces (:func:`.ft_join.wait_for_activation`)."""
SPARE_KEY = "activate/"
"""Store key prefix the launcher sets to activate a spare: ``activate/<slot>`` = the rank it becomes."""
JOINED_KEY = "joined/"
"""Store key a replacement sets once it committed its first step (``joined/<rank>``): the launcher starts the
next warm spare then, not while the replacement is joining (its start-up would slow the join on a busy host)."""
REPLICA_ENV = "STARVERSE_FT_REPLICA"
"""``RankSpec.env`` key: the replica a rank belongs to when a replica is several ranks (a pipeline's stages). The
launcher starts, loses and replaces those ranks together; absent, every rank is a replica of its own."""
EXTRA_FT_HOST = "ft_host"
"""``RankEnv.extra`` key: the address the launcher's stores listen on (start barrier, spare activation, a pipelined
replica's store); absent: 127.0.0.1. The Lighthouse's address is :data:`EXTRA_LIGHTHOUSE` (a full URL)."""
EXTRA_BIND_HOST = "bind_host"
"""``RankEnv.extra`` key: the address this replica's torchft ``ManagerServer`` and its own store bind and advertise
to the other replicas (its node's IP on a multi-host Ray cluster); absent: 127.0.0.1."""
LOSSES_KEY = "losses"
"""Launcher store key: how many losses the launcher announced (:func:`announce_loss`)."""
LOST_KEY = "lost/"
"""Launcher store key prefix: ``lost/<n>`` (n from 1) = the index of the replica lost n-th."""
EXTRA_REPLICA_STORE = "replica_store_port"
"""``RankEnv.extra`` key: the port of the launcher's store of this rank's replica (several ranks): the replica's
``torch.distributed`` world and its torchft ``Manager`` meet there (a replacement replica gets a new store)."""


class PeerLostError(DistributedError):
    """What a replica reports to torchft when it gave up a collective because the launcher announced the loss of a
    peer of that collective (the step fails and is redone without it)."""


def announce_loss(store: Any, replica: int) -> None:
    """The launcher (the only writer): tell every replica that ``replica`` is lost (``lost/<n>``, then the count)."""
    n = int(store.add(LOSSES_KEY, 0)) + 1
    store.set(f"{LOST_KEY}{n}", str(replica))
    store.add(LOSSES_KEY, 1)


@dataclass(frozen=True)
class LossNotices:
    """Where a replica reads the launcher's loss announcements: the launcher's store."""

    host: str
    """The store's address."""
    port: int
    """Its port."""
    poll_s: float = 0.05
    """How often the watch reads the count."""


def loss_notices(extra: dict[str, Any]) -> LossNotices | None:
    """The launcher's loss announcements for a replica launched with ``extra`` (None: a launcher without a store)."""
    port = extra.get(EXTRA_BARRIER_PORT)
    return None if port is None else LossNotices(ft_host(extra), int(port))


class LossWatch:
    """A replica's thread reading the launcher's loss announcements: ``on_loss(n, replica)`` for each new one (the
    n-th), in order; :meth:`count` is the number announced so far."""

    def __init__(self, notices: LossNotices, on_loss: Callable[[int, int], None], timeout_s: float):
        import torch.distributed as dist

        self._lock = threading.Lock()  # one store client, two threads (this one, torchft's quorum thread)
        self._store = dist.TCPStore(notices.host, notices.port, is_master=False, timeout=timedelta(seconds=timeout_s))
        self._stop = threading.Event()
        self._seen = self.count()
        self._on_loss, self._poll_s = on_loss, notices.poll_s
        threading.Thread(target=self._run, name="loss-watch", daemon=True).start()

    def count(self) -> int:
        """Losses announced so far."""
        with self._lock:
            return int(self._store.add(LOSSES_KEY, 0))

    def _run(self) -> None:
        try:
            while not self._stop.wait(self._poll_s):
                n = self.count()
                while self._seen < n:
                    self._seen += 1
                    with self._lock:
                        replica = int(self._store.get(f"{LOST_KEY}{self._seen}"))
                    self._on_loss(self._seen, replica)
        except Exception as e:  # the launcher's store is gone: the job is over
            log.debug("loss watch ended: %s", e)

    def stop(self) -> None:
        """End the thread."""
        self._stop.set()


def quiet_torchft() -> None:
    """torchft's Rust side logs every quorum at INFO to stderr; WARNING and up unless ``$RUST_LOG`` says else
    (read once, when torchft is first imported in a process)."""
    os.environ.setdefault("RUST_LOG", "warn")
    # a flight-recorder warning every quorum, a traceback for every peer lost (logged here once, as a warning)
    logging.getLogger("torchft.manager").setLevel(logging.CRITICAL)


def ft_host(extra: dict[str, Any]) -> str:
    """Where the launcher's stores listen (:data:`EXTRA_FT_HOST`; 127.0.0.1 unless the launcher said else)."""
    return str(extra.get(EXTRA_FT_HOST) or LOOPBACK)


def bind_host(extra: dict[str, Any]) -> str:
    """The address this replica binds and advertises (:data:`EXTRA_BIND_HOST`; 127.0.0.1 unless said else)."""
    return str(extra.get(EXTRA_BIND_HOST) or LOOPBACK)


def loopback_manager_server(host: str = LOOPBACK, **kwargs: Any) -> Any:
    """torchft's ``ManagerServer``, bound to and advertised on ``host`` (127.0.0.1) instead of ``[::]`` / the
    hostname."""
    from torchft._torchft import ManagerServer

    port = str(kwargs.pop("bind")).rsplit(":", 1)[1]
    kwargs["hostname"] = host
    return ManagerServer(bind=f"{host}:{port}", **kwargs)


def patch_manager_bind(host: str = LOOPBACK) -> None:
    """Make ``torchft.manager.Manager`` start its ``ManagerServer`` on ``host`` (torchft 0.2.0 has no option).

    ``Manager.__init__`` calls the module-level name ``ManagerServer(replica_id=..., bind="[::]:PORT", ...)``
    with keyword arguments only; that name is replaced in this (rank) process by :func:`loopback_manager_server`.
    """
    import functools

    import torchft.manager as tm

    tm.ManagerServer = functools.partial(loopback_manager_server, host)  # type: ignore[assignment,misc]


@dataclass(frozen=True)
class Quorum:
    """This step's membership as one replica sees it."""

    rank: int
    """This replica's position among the participants (0: the leader)."""
    size: int
    """Number of participants."""
    quorum_id: int = -1
    """The Lighthouse's id of this membership: it changes whenever the members change or a step failed, so a step
    whose id is the last committed step's has the same members in the same order (-1: unknown)."""


class ReplicaSync(Protocol):
    """What the in-place loop needs from a fault-tolerant group (:class:`TorchftSync` on torchft)."""

    def start_step(self) -> Quorum:
        """Agree on this step's participants (a late replica is healed here)."""
        ...

    def allreduce_sum(self, t: torch.Tensor) -> bool:
        """Sum ``t`` over the participants in place; False if it failed (then :meth:`commit` says False too)."""
        ...

    def commit(self) -> bool:
        """True if every participant finished the step (apply it); False: redo it."""
        ...

    def shutdown(self) -> None:
        """Leave the group."""
        ...


class TorchftSync:
    """:class:`ReplicaSync` on a torchft ``Manager`` and a reconfigurable gloo group.

    A replica group of one rank by default (its own store); with ``store_port`` (the launcher's store of the
    replica) it is rank ``group_rank`` of ``group_world_size``: as in torchft's HSDP examples, every rank of the
    replica has a ``Manager`` with the same ``replica_id``, group rank 0 hosts the replica's ``ManagerServer``, the
    quorum and the commit vote cover the whole replica, and the gloo group sums over the ranks of the *same group
    rank* of every replica (a pipeline's same stage); a joiner's rank ``k`` heals from a peer's rank ``k``."""

    def __init__(self, replica_id: str, lighthouse: str, timeout_s: float,
                 state_dict: Callable[[], dict[str, Any]], load_state_dict: Callable[[dict[str, Any]], None],
                 group_rank: int = 0, group_world_size: int = 1, store_port: int | None = None,
                 host: str = LOOPBACK, store_host: str = LOOPBACK, losses: LossNotices | None = None):
        """``host``: the address this replica's ``ManagerServer`` and its own store bind and advertise;
        ``store_host``: where the launcher's store at ``store_port`` listens (when one is given); ``losses``: where
        the launcher announces losses (None: a collective whose peer stopped waits for its timeout)."""
        quiet_torchft()
        from torchft import Manager, ProcessGroupGloo
        from torchft.checkpointing.pg_transport import PGTransport

        patch_manager_bind(host)
        timeout = timedelta(seconds=timeout_s)
        if store_port is None:
            self._store = store_server(host, 1, timeout_s)  # this replica group's own store (loopback by default)
            store_port, store_host = int(self._store.port), host
        pg = ProcessGroupGloo(timeout=timeout)
        self._pg = pg
        self._timeout_s = timeout_s
        self._replica = _replica_index(replica_id)
        self._lock = threading.Lock()
        self._members: frozenset[int] = frozenset()
        """Replica indices of the current process group (set when torchft configures it for a quorum)."""
        self._epoch = 0
        """Losses announced when the current group was configured (older ones do not concern it)."""
        self._lost_peer: int | None = None
        """A replica of the current group that the launcher announced lost (this group's collectives are given up)."""
        self._wake = threading.Event()
        self._orphans: list[tuple[Any, Any]] = []
        """Given-up collectives still running (their future; their work and gloo group, referenced until they end)."""
        self._watch = LossWatch(losses, self._peer_lost, timeout_s) if losses is not None else None
        configure = pg.configure

        def configure_watched(*args: Any, **kwargs: Any) -> None:
            # ProcessGroup.configure(store_addr, replica_id, rank, world_size, quorum_id, group_rank,
            # group_world_size, global_ranks), global_ranks = replica index * group_world_size + group rank
            ranks = kwargs.get("global_ranks", args[7] if len(args) > 7 else None) or []
            with self._lock:
                self._members = frozenset(int(g) // group_world_size for g in ranks)
                self._epoch = self._watch.count() if self._watch is not None else 0
                self._lost_peer = None
            configure(*args, **kwargs)

        pg.configure = configure_watched  # type: ignore[method-assign]
        self.manager = Manager(
            pg=pg, load_state_dict=load_state_dict, state_dict=state_dict, min_replica_size=1,
            use_async_quorum=False, timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
            rank=group_rank, world_size=group_world_size, store_addr=store_host, store_port=store_port,
            lighthouse_addr=lighthouse,
            replica_id=replica_id, hostname=host, init_sync=False,
            checkpoint_transport=PGTransport(pg, timeout=timeout, device=torch.device("cpu")),
        )

    def start_step(self) -> Quorum:
        """See :class:`ReplicaSync`."""
        m = self.manager
        m.start_quorum()  # synchronous: a late replica is healed before this returns
        rank = m.participating_rank()
        if rank is None:
            raise ConfigError("torchft put this replica outside the quorum (spare replicas are not used).")
        # torchft 0.2.0 keeps the id private (_quorum_id: set by every quorum, the process group reconfigured on change)
        return Quorum(rank=rank, size=m.num_participants(), quorum_id=int(m._quorum_id))

    def _peer_lost(self, n: int, replica: int) -> None:
        """The launcher announced (n-th) that ``replica`` is lost: give up the collective in flight if that replica
        is in this replica's current group and the group was configured before the announcement (a replacement with
        the same index is in a later group)."""
        with self._lock:
            if n <= self._epoch or replica not in self._members or replica == self._replica:
                return
            self._lost_peer = replica
        log.warning("replica %d: the launcher lost replica %d of this quorum; giving up the collective in flight",
                    self._replica, replica)
        self._wake.set()

    def allreduce_sum(self, t: torch.Tensor) -> bool:
        """See :class:`ReplicaSync`. As torchft's ``Manager.allreduce`` (SUM), but waited for here: until the gloo
        work ends or the launcher announces the loss of a peer of this group (:class:`LossWatch`; the step then
        fails at once); a failure is reported to the Manager as torchft's own wrapper reports it."""
        m = self.manager
        self._orphans = [(f, g) for f, g in self._orphans if not f.done()]
        if m.errored() is None:
            try:
                self._allreduce(t)
            except Exception as e:
                m.report_error(e)
        if m.errored() is None:
            return True
        # Close this group's connections now, not at the next quorum's reconfiguration: another survivor may be
        # blocked in the same collective waiting for data from *this* one (gloo routes through it), and the
        # Lighthouse holds the next quorum for that heartbeating survivor. Without this both waited for the
        # collective timeout (the launcher's join timeout is the same): the 60 s re-quorum stall under load.
        self._pg.abort()
        return False

    def _allreduce(self, t: torch.Tensor) -> None:
        """Sum ``t`` over the current group; raise if it failed or was given up (:meth:`_peer_lost`)."""
        from torch.distributed import AllreduceOptions, ReduceOp

        self.manager.wait_quorum()
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp(ReduceOp.SUM)
        wake = threading.Event()  # this call's: an abandoned operation's late end must not wake a later one
        self._wake = wake
        if self._lost_peer is not None:
            raise PeerLostError(f"replica {self._lost_peer} of this quorum was lost (announced by the launcher)")
        group = self._pg._pg
        work = self._pg.allreduce([t], opts)
        done = work.get_future()
        done.add_done_callback(lambda _: wake.set())
        if not wake.wait(self._timeout_s + 5.0) or not done.done():
            self._orphans.append((done, (work, group)))  # it ends by itself later (a closed socket, gloo's own timeout)
            lost = self._lost_peer
            raise PeerLostError(f"replica {lost} of this quorum was lost (announced by the launcher)" if lost is not None
                                else f"the all-reduce did not end within {self._timeout_s:g} s")
        work.wait()

    def commit(self) -> bool:
        """See :class:`ReplicaSync`."""
        return bool(self.manager.should_commit())

    def current_step(self) -> int:
        """Steps committed (torchft's count; healed with the state)."""
        return int(self.manager.current_step())

    def shutdown(self) -> None:
        """See :class:`ReplicaSync`."""
        if self._watch is not None:
            self._watch.stop()
        self.manager.shutdown(wait=False)


def _replica_index(replica_id: str) -> int:
    """The replica index in a replica id (``replica0003`` -> 3), as torchft reads it (its trailing digits)."""
    tail = replica_id[len(replica_id.rstrip("0123456789")):]
    return int(tail) if tail else -1
