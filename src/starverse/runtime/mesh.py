"""The mixed mesh: process groups by device kind, native inside a kind, a gloo bridge between kinds.

A mixed job cannot run one collective backend over all ranks: NCCL only talks CUDA, XLA only TPU,
HCCL only Ascend. So ranks are grouped by device kind; each kind reduces inside itself with its native
backend, the first rank of each kind (its *leader*) exchanges the partial sums with the other leaders
over gloo (host memory, TCP), and each leader broadcasts the total back inside its kind::

    kind A: reduce -> leader A --gloo bridge-- leader B <- reduce :kind B
            broadcast <-------'                    `-------> broadcast

With one kind, the hierarchy collapses to a single native all-reduce. Every group is created with the
job's collective timeout (it is inherited from ``init_process_group``), so no step can hang on a dead peer.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from starverse.runtime.launch import native_backend

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KindGroup:
    """The ranks of one device kind."""

    kind: str
    """Accelerator id of the kind."""
    ranks: tuple[int, ...]
    """Global ranks of this kind (ascending); the first is the kind's leader."""
    backend: str
    """Native collective backend used inside the kind."""

    @property
    def leader(self) -> int:
        """The rank that talks to the other kinds."""
        return self.ranks[0]


@dataclass(frozen=True)
class MeshLayout:
    """Which ranks form which groups (pure data: computed identically in the user's process and in ranks)."""

    kinds: tuple[KindGroup, ...]
    """One entry per device kind, in order of first appearance."""

    @classmethod
    def from_ranks(
        cls, rank_kinds: Sequence[str], rank_devices: Sequence[str] | None = None, members: Sequence[int] | None = None
    ) -> MeshLayout:
        """Group ranks by kind; ``rank_devices`` (torch device strings) picks each kind's native backend.

        ``members``: only these global ranks (None: all); ``rank_kinds``/``rank_devices`` stay indexed by rank.
        """
        devices = list(rank_devices) if rank_devices is not None else ["cpu"] * len(rank_kinds)
        order: dict[str, list[int]] = {}
        for r in sorted(members) if members is not None else range(len(rank_kinds)):
            order.setdefault(rank_kinds[r], []).append(r)
        return cls(tuple(KindGroup(k, tuple(rs), native_backend(devices[rs[0]])) for k, rs in order.items()))

    @property
    def is_mixed(self) -> bool:
        """More than one device kind (the gloo bridge is used)."""
        return len(self.kinds) > 1

    def describe(self) -> str:
        """One line for logs: ``cpu-a: ranks 0,1 (gloo) | cpu-b: rank 2 (gloo) | bridge: gloo``."""
        parts = [
            f"{g.kind}: rank{'s' if len(g.ranks) > 1 else ''} {','.join(map(str, g.ranks))} ({g.backend})"
            for g in self.kinds
        ]
        return " | ".join(parts) + (" | bridge: gloo between leaders" if self.is_mixed else "")


@dataclass
class MixedMesh:
    """The process groups of a running job (built inside every rank by :meth:`build`)."""

    layout: MeshLayout
    """Which ranks form which groups."""
    rank: int
    """This rank."""
    kind_group: Any
    """Process group of this rank's kind (native backend)."""
    my_kind: KindGroup
    """This rank's kind."""
    bridge_group: Any = None
    """gloo group over the kind leaders (None with one kind, or on a non-leader)."""
    host_group: Any = None
    """gloo group over all ranks (host-side coordination: votes, metrics, checkpoints)."""
    _groups: list[Any] = field(default_factory=list)

    @classmethod
    def build(cls, rank_kinds: Sequence[str], rank_devices: Sequence[str] | None = None) -> MixedMesh:
        """Create the groups; every rank must call this with the same arguments (collective)."""
        mesh = cls.build_over(rank_kinds, rank_devices, None)
        assert mesh is not None
        return mesh

    @classmethod
    def build_over(
        cls, rank_kinds: Sequence[str], rank_devices: Sequence[str] | None, members: Sequence[int] | None
    ) -> MixedMesh | None:
        """The mesh over ``members`` (None: all ranks); None on a rank outside them.

        Collective over the whole world: every rank calls it with the same arguments, in the same order.
        A mesh over a subset has no host group (host-side coordination uses the world's).
        """
        if not dist.is_initialized():
            raise RuntimeError("MixedMesh.build needs an initialised process group (run inside launch()).")
        layout = MeshLayout.from_ranks(rank_kinds, rank_devices, members)
        rank = dist.get_rank()
        mine: KindGroup | None = None
        kind_group = None
        # new_group is collective over the whole world: every rank creates every group, in the same order.
        for g in layout.kinds:
            pg = dist.new_group(list(g.ranks), backend=g.backend)
            if rank in g.ranks:
                mine, kind_group = g, pg
        bridge = None
        if layout.is_mixed:
            pg = dist.new_group([g.leader for g in layout.kinds], backend="gloo")
            bridge = pg if mine is not None and rank == mine.leader else None
        host = None
        if members is None:
            host = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        if mine is None:
            return None
        log.info("mixed mesh: %s", layout.describe())
        return cls(layout, rank, kind_group, mine, bridge, host)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over all ranks in place (native inside kinds, gloo bridge between them)."""
        if not self.layout.is_mixed:
            dist.all_reduce(tensor, group=self.kind_group)
            return
        leader = self.my_kind.leader
        if len(self.my_kind.ranks) > 1:
            dist.reduce(tensor, dst=leader, group=self.kind_group)
        if self.rank == leader:
            host = tensor if tensor.device.type == "cpu" else tensor.cpu()
            dist.all_reduce(host, group=self.bridge_group)
            if host is not tensor:
                tensor.copy_(host)
        if len(self.my_kind.ranks) > 1:
            dist.broadcast(tensor, src=leader, group=self.kind_group)

    def all_reduce_async(self, tensor: torch.Tensor) -> Any:
        """Start a sum over all ranks; returns an object with ``wait()``.

        Asynchronous only with one kind (a single native collective); the bridge is done synchronously.
        """
        if not self.layout.is_mixed:
            return dist.all_reduce(tensor, group=self.kind_group, async_op=True)
        self.all_reduce(tensor)
        return _Done()


class _Done:
    def wait(self) -> bool:
        return True
