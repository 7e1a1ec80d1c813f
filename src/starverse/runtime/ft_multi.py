"""What a torchft replica of several ranks shares, whatever it does inside (a pipeline's stages:
:mod:`starverse.runtime.ft_pipe`; ranks that shard the optimizer state: :mod:`starverse.runtime.ft_shard`).

As in torchft's HSDP examples, such a replica is a *replica group*: its ranks form their own ``torch.distributed``
world (gloo, on the launcher's store of that replica, ``env.extra["replica_store_port"]``), and every rank has a
torchft ``Manager`` with the replica's id, ``rank`` = its place in the replica, ``world_size`` = the replica's ranks
(:class:`~starverse.runtime.ft_group.TorchftSync`). The quorum and the commit vote cover the whole replica; the
reconfigurable group of place ``s`` sums what place ``s`` holds over the participating replicas, and a
replacement replica's place ``s`` heals from a peer's place ``s``. A lost rank loses its replica: the launcher
stops its other ranks (``starverse.elastic.inplace``).

Callbacks run on every rank of the leader replica, which sees itself as a one-replica job (``ctx.rank`` its place,
``ctx.world_size`` the replica's ranks, ``ctx.group`` its world).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from starverse.errors import ConfigError
from starverse.runtime.ft import ReplicaTrainer
from starverse.runtime.ft_group import (
    EXTRA_JOINER,
    EXTRA_LIGHTHOUSE,
    EXTRA_REPLICA_STORE,
    Quorum,
    TorchftSync,
    bind_host,
    ft_host,
    loss_notices,
)
from starverse.runtime.ft_join import start_barrier
from starverse.runtime.launch import RankEnv
from starverse.runtime.rank_job import FitJob, RankResult


@dataclass
class GroupReplicaTrainer(ReplicaTrainer):
    """One rank of a replica of several ranks (see the module docstring)."""

    replica: int = 0
    """This rank's replica in the plan."""
    group_rank: int = 0
    """This rank's place in its replica."""
    group_size: int = 1
    """Ranks of the replica."""

    @property
    def replica_index(self) -> int:
        """This rank's replica in the plan."""
        return self.replica

    def set_ctx_rank(self, q: Quorum) -> None:
        """The leader replica's ranks are ranks 0.. of the callbacks' world (its ranks)."""
        self.ctx.rank = q.rank * self.group_size + self.group_rank

    def step_loss(self, stats: torch.Tensor) -> float:
        """The step's loss: the participants' summed parts, summed over the replica's ranks."""
        t = stats[:, 0].sum().reshape(1).clone()
        dist.all_reduce(t)
        return float(t)

    def note(self, event: dict[str, Any]) -> None:
        """The replica's first rank writes its events (once per replica)."""
        if self.group_rank == 0:
            super().note(event)


T = TypeVar("T", bound=GroupReplicaTrainer)


def train_group_replica(env: RankEnv, job: FitJob, replica: int, members: Sequence[int],
                        build: Callable[[RankEnv, FitJob], T]) -> RankResult | None:
    """The launched function of a rank of a replica of several ranks (``members``: the replica's ranks in order;
    ``build``: this rank's trainer, collective inside the replica's world)."""
    lighthouse = env.extra.get(EXTRA_LIGHTHOUSE)
    if not lighthouse:
        raise ConfigError("recovery: in-place needs a launcher with a torchft Lighthouse "
                          "(starverse.elastic.inplace.InplaceLauncher).")
    port = int(env.extra[EXTRA_REPLICA_STORE])
    timeout = timedelta(seconds=env.collective_timeout_s)
    store = dist.TCPStore(ft_host(env.extra), port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore("pipeline", store), rank=list(members).index(env.rank),
                            world_size=len(members), timeout=timeout)
    try:
        trainer = build(env, job)
        trainer.replica, trainer.group_rank, trainer.group_size = replica, list(members).index(env.rank), len(members)
        trainer.joiner = bool(env.extra.get(EXTRA_JOINER))
        sync = TorchftSync(f"replica{replica:04d}", str(lighthouse), env.collective_timeout_s, trainer.live_state,
                           trainer.load_live_state, trainer.group_rank, trainer.group_size, port,
                           host=bind_host(env.extra), store_host=ft_host(env.extra),
                           losses=loss_notices(env.extra))
        trainer.ready_at = time.time()
        start_barrier(env)
        try:
            return trainer.run(sync)
        finally:
            sync.shutdown()
    finally:
        dist.destroy_process_group()
