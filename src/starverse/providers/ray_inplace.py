"""In-place recovery on Ray: torchft replicas as Ray actors; a lost actor (its node removed, its process killed)
does not stop the job.

:class:`RayInplaceLauncher` is the Ray counterpart of :class:`starverse.elastic.inplace.InplaceLauncher` (and a
subclass of it, so the supervisor and the ledger read its ``losses`` and ``joins`` and call its ``on_loss`` /
``on_join`` hooks the same way). What is the same: the torchft ``Lighthouse`` runs in the launcher's process
(the driver), bound to 127.0.0.1; the launcher's store holds the start barrier; each replica runs the launched
function (:func:`starverse.runtime.ft.train_replica` for ``recovery: in-place``) without a ``torch.distributed``
world; survivors finish the step in flight with the lost replica's share redistributed. What differs:

- each replica is one Ray actor (:class:`starverse.providers.ray_actor._RankActor`), its bundle of a placement group
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
  it waits for one; one that never got a node is no join (the rank stays lost for good);
- with ``warm_spares`` (off by default on Ray: a spare holds a bundle, a GPU on a GPU node, for the whole run), one
  *spare actor* per device kind starts with the job in a placement group of its own (a bundle like a rank of that
  kind: CPUs, a GPU for a CUDA rank, a sliver of its kind's node resource), imports torch and torchft, loads the
  model and waits on the launcher's store (:func:`starverse.runtime.ft_join.wait_for_activation`). A loss of a
  rank of that kind activates it (``activate/<slot>``): the replacement is that running actor, a warm
  :class:`~starverse.elastic.inplace.Join` at once, no actor start, imports or model load on the join's path. The
  activated spare keeps its own bundle; the lost rank's bundle (re-reserved by Ray where there is room) becomes the
  bundle of the next spare of that kind, started once the activated one has committed a step. A spare that is not
  running yet (its bundle waits for room) is not used: the replacement starts cold in the lost rank's bundle;
- where the replicas meet (``bind``): on a cluster whose nodes are all on 127.0.0.1 (``ray.cluster_utils.Cluster``,
  ``ray start --node-ip-address=127.0.0.1``) the Lighthouse, the launcher's stores and every replica's torchft
  ``Manager`` listen on 127.0.0.1 (the loopback rule, ``runtime/ft_group.py``); on a cluster with nodes on other
  addresses the Lighthouse and the stores listen on the driver's node IP and each replica's ``Manager`` and store
  on its own node's IP (``ray.util.get_node_ip_address()``), so replicas on other hosts reach them.

A hung actor (alive, not stepping: SIGSTOPped, its host stuck) is found by its heartbeat
(:mod:`starverse.providers.heartbeat`: a thread of the actor adds to its counter on the launcher's store every
``heartbeat_s``): silent for ``heartbeat_timeout_s``, it is a :class:`~starverse.errors.LostRankError` with cause
``heartbeat timeout`` and its node; the launcher kills it (``ray.kill`` and a SIGKILL of its process, so it cannot
come back) and goes on as for an actor's death (``on_loss``, a replacement). Every loss is also announced on the
launcher's store (:func:`starverse.runtime.ft_group.announce_loss`): the survivors give up their collective with the
lost replica at once instead of waiting for the collective timeout when its connections stay open.

Replicas on more than one machine have not run here (one machine only: the tests run the loopback binding and, with
``bind="node"``, the node-IP path on a cluster whose node IPs are 127.0.0.1).

This module is the launcher; one launch's actors and bookkeeping are :class:`~starverse.providers.ray_inplace_run.RayRun`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from starverse.elastic.inplace import InplaceLauncher, replica_members
from starverse.errors import ConfigError
from starverse.providers.heartbeat import driver_host
from starverse.providers.ray import RayLauncher
from starverse.providers.ray_inplace_run import RayRun
from starverse.providers.ray_session import import_ray, ray_session
from starverse.runtime.launch import LOOPBACK, Launcher, RankSpec

log = logging.getLogger(__name__)


BINDS = ("auto", "loopback", "node")
"""Values of :attr:`RayInplaceLauncher.bind`."""

__all__ = ["BINDS", "RayInplaceLauncher", "driver_host"]


@dataclass
class RayInplaceLauncher(InplaceLauncher):
    """Runs torchft replicas as Ray actors; survives lost actors (see the module docstring).

    ``heartbeat_s`` and ``heartbeat_timeout_s`` are each actor's heartbeat period and the silence after which it is
    lost (a hung actor; Ray reports a dead one)."""

    ray: RayLauncher = field(default_factory=RayLauncher)
    """Where and how the actors run: ``address``, ``num_cpus_per_rank``, ``kind_resources``, ``placement_timeout_s``
    (a private single-node session when no cluster is named)."""
    warm_spares: bool = False
    """With ``replace_after_s``: one spare actor per device kind, started with the job in a bundle of its own,
    activated on a loss (see the module docstring). Off by default: a spare holds its bundle the whole run."""
    bind: str = "auto"
    """Where the Lighthouse, the stores and the replicas' torchft managers listen: ``loopback`` (127.0.0.1),
    ``node`` (the driver's and each actor's node IP), ``auto`` (loopback when every node of the cluster is on
    127.x, else ``node``)."""
    _nodes: dict[int, str] = field(default_factory=dict, init=False, repr=False, compare=False)
    _spare_nodes: dict[int, str] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bind not in BINDS:
            raise ConfigError(f"RayInplaceLauncher: bind must be one of {', '.join(BINDS)} (got {self.bind!r}).")

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

    def spare_nodes(self) -> dict[int, str]:
        """Slot -> Ray node id of the spare actors running now and not yet activated."""
        return dict(self._spare_nodes)

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
            host = driver_host(self.bind, [n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")],
                               str(ray.util.get_node_ip_address()))
            lighthouse, barrier, extra = self._coordination(len(ranks), collective_timeout_s, host or LOOPBACK)
            members = replica_members(ranks)
            run = RayRun(self, ray, ranks, fn, args, collective_timeout_s, extra, members, barrier,
                          bind_node=host is not None)
            try:
                run.place(min(self.ray.placement_timeout_s, timeout_s))
                for replica in run.members:
                    run.start_replica(replica, joiner=False)
                # a spare stands in for one rank: a replica of several ranks is replaced by new actors
                if self.replace_after_s is not None and self.warm_spares and all(len(m) == 1 for m in members.values()):
                    for kind in dict.fromkeys(r.device_kind for r in ranks):
                        run.start_spare(kind, run.spare_bundle(kind))
                log.info("in-place launch on Ray: %d replicas over %d actors, lighthouse %s", len(run.members),
                         len(ranks), lighthouse.address)
                run.watch(timeout_s)
            finally:
                run.stop()
                lighthouse.shutdown()
        return [run.values.get(r.rank) for r in ranks]
