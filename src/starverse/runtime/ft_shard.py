"""In-place recovery when a replica is sharded inside: ZeRO-1 over the ranks of one replica (torchft's HSDP way).

Each *group* of the plan is one torchft replica (a replica group: :mod:`starverse.runtime.ft_multi`); its ranks
hold the whole model and shard the optimizer state among themselves (ZeRO-1:
:class:`~starverse.runtime.parallel.zero1.ShardedOptimizer` over the replica's own ``torch.distributed`` world).
Every rank has a torchft ``Manager`` with the replica's id and ``rank`` = its shard index. One step:

1. the replica's share of the global batch (:class:`~starverse.runtime.ft.ReplicaTrainer`'s roster) is dealt
   over its ranks (micro-batch ``k`` to rank ``k mod ranks``), each loss scaled to the global batch;
2. the ranks' gradients are summed inside the replica (one all-reduce over its world);
3. rank ``s`` sums over the participating replicas, on torchft's reconfigurable group of shard ``s``, the
   gradients of the parameters whose optimizer state it owns (its ZeRO-1 partition: alike in every replica,
   the replicas being of one size), with the step's loss parts;
4. commit vote (the whole replica), gradient norm over the replica's shards, its AdamW step on its partition,
   the updated parameters broadcast inside the replica (ZeRO-1's step).

A lost rank loses its replica (the launcher stops its other ranks); the other replicas redo the step in flight
with the whole global batch. A replacement replica's shard ``s`` heals from a peer's shard ``s``: the whole
weights, the partition's optimizer state (:meth:`ShardedOptimizer.state_dict` is local), schedule, sampler and
step. ZeRO-2/3 and offload inside a replica are not built (:func:`shard_replica_error`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from starverse.plan import Plan
from starverse.runtime.callbacks import TrainContext
from starverse.runtime.ft_multi import GroupReplicaTrainer, train_group_replica
from starverse.runtime.launch import RankEnv
from starverse.runtime.parallel.zero1 import ShardedOptimizer
from starverse.runtime.rank_job import FitJob, RankResult


def shard_replica_error(plan: Plan) -> str | None:
    """Why in-place recovery cannot run ``plan`` as sharded replicas (None: it can): ZeRO-1, no offload, every
    group one replica of single-rank stages (no pipeline, no TP), every group as many ranks (shard ``s`` of
    every replica owns the same parameters), at least two groups (a loss must leave a replica)."""
    t = plan.train
    if t.zero_stage != 1:
        return f"ZeRO-{t.zero_stage} inside a replica (sharded replicas are built for ZeRO-1)"
    if t.offload != "none":
        return f"offload {t.offload} inside a replica"
    if any(g.devices_per_replica != 1 for g in plan.groups):
        return "ZeRO with a pipeline or TP inside a replica"
    if len(plan.groups) < 2:
        return "ZeRO over one group (each group is a sharded replica: a loss would leave none)"
    if len({g.replicas for g in plan.groups}) > 1:
        return "sharded replicas (groups) of different sizes"
    return None


def shard_replicas(plan: Plan) -> list[int]:
    """The replica of every rank (ranks in plan order): its group's index."""
    return [g for g, group in enumerate(plan.groups) for _ in range(group.replicas)]


@dataclass
class ShardedReplicaTrainer(GroupReplicaTrainer):
    """One rank of a ZeRO-1 replica (built in the rank process by :meth:`build_shard`)."""

    @classmethod
    def build_shard(cls, env: RankEnv, job: FitJob) -> ShardedReplicaTrainer:
        """The whole model, this rank's partition of AdamW (sharded over the replica's world), schedule, data."""
        world = dist.group.WORLD
        members = _members(job.plan, env.rank)
        trainer = cls.build(env, job, shard=lambda opt: ShardedOptimizer(opt, world))
        ctx: TrainContext = trainer.ctx
        ctx.rank, ctx.world_size, ctx.group = members.index(env.rank), len(members), world
        ctx.rank_kinds = [env.ranks[r].device_kind for r in members]
        replica_of = shard_replicas(job.plan)  # the plan's shares are per rank: a replica's is its ranks' sum
        ctx.shares = [sum(s for r, s in enumerate(job.shares) if replica_of[r] == g) for g in range(len(job.plan.groups))]
        return trainer

    def forward_backward(self, micro_batches: Any, num_targets: int | None) -> float:
        """This rank's micro-batches of the replica's share (``k mod ranks``)."""
        return super().forward_backward(list(micro_batches)[self.group_rank::self.group_size], num_targets)

    def replica_sum(self) -> None:
        """Sum the ranks' gradients inside the replica (one all-reduce in fp32 or wider)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        dtype = torch.promote_types(grads[0].dtype, torch.float32)
        flat = torch.cat([g.reshape(-1).to(dtype) for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for p in params:
            p.grad = flat[offset: offset + p.numel()].view_as(p).to(p.dtype)
            offset += p.numel()

    def synced_params(self) -> list[torch.nn.Parameter]:
        """The parameters of this rank's ZeRO-1 partition."""
        assert isinstance(self.optimizer, ShardedOptimizer)
        owner = self.optimizer._zero._param_to_rank
        return [p for p in self.model.parameters() if p.requires_grad and owner[p] == self.group_rank]

    def clip(self, params: list[torch.nn.Parameter]) -> torch.Tensor:
        """The gradient norm over the replica's partitions, every rank's partition clipped by it."""
        sq = torch.zeros(1, dtype=torch.float64)
        for p in params:
            if p.grad is not None:
                sq += p.grad.detach().double().pow(2).sum()
        dist.all_reduce(sq)
        norm = sq.sqrt().to(torch.float32)[0]
        clip = self.job.grad_clip
        if clip > 0:
            coef = torch.clamp(clip / (norm + 1e-6), max=1.0)
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coef.to(p.grad.dtype))
        return norm

    def save_final(self) -> None:
        """The replica's first rank writes the weights (every rank holds them whole)."""
        if self.group_rank == 0:
            super().save_final()


def _members(plan: Plan, rank: int) -> list[int]:
    replicas = shard_replicas(plan)
    return [r for r, g in enumerate(replicas) if g == replicas[rank]]


def train_shard_replica(env: RankEnv, job: FitJob) -> RankResult | None:
    """The launched function of a rank of a ZeRO-1 replica (see the module docstring)."""
    return train_group_replica(env, job, shard_replicas(job.plan)[env.rank], _members(job.plan, env.rank),
                               ShardedReplicaTrainer.build_shard)


__all__ = ["ShardedReplicaTrainer", "shard_replica_error", "shard_replicas", "train_shard_replica"]
