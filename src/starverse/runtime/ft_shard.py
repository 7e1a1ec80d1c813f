"""In-place recovery when a replica is sharded inside: ZeRO 1-3 over the ranks of one replica (torchft's HSDP way).

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
step.

ZeRO-2/3 (:class:`FsdpReplicaTrainer`): FSDP2 ``fully_shard`` over the replica's world (each block a unit, the
plan's recompute wrapped first), so a rank holds a shard of every parameter (and, ZeRO-3, gathers the whole layer
only while it computes). Its micro-batches run in lockstep with its replica's other ranks (a rank with one fewer
runs a zero-weight pass: FSDP2's collectives pair up); FSDP2 reduce-scatters and *sums* the gradients inside the
replica; rank ``s`` sums its local shards over the replicas on torchft's group of shard ``s`` (FSDP2's ``Shard(0)``
split is alike in replicas of one size), the norm is taken over the replica's shards and AdamW steps the shards.
A replacement's shard ``s`` heals from a peer's shard ``s``: the live state crosses as local tensors, wrapped
back as DTensors on the joiner's own mesh. Offload inside a replica is not built (:func:`shard_replica_error`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from starverse.plan import Plan
from starverse.runtime.callbacks import TrainContext
from starverse.runtime.ft import ReplicaTrainer
from starverse.runtime.ft_multi import GroupReplicaTrainer, train_group_replica
from starverse.runtime.launch import RankEnv
from starverse.runtime.parallel.dtensor import is_dtensor
from starverse.runtime.parallel.zero1 import ShardedOptimizer
from starverse.runtime.rank_job import FitJob, RankResult
from starverse.runtime.rank_parts import write_final
from starverse.runtime.steps import batch_loss

T = TypeVar("T", bound=GroupReplicaTrainer)


def shard_replica_error(plan: Plan) -> str | None:
    """Why in-place recovery cannot run ``plan`` as sharded replicas (None: it can): ZeRO 1-3, no offload, every
    group one replica of single-rank stages (no pipeline, no TP), every group as many ranks (shard ``s`` of
    every replica owns the same parameters), at least two groups (a loss must leave a replica)."""
    t = plan.train
    if t.zero_stage not in (1, 2, 3):
        return f"ZeRO-{t.zero_stage} inside a replica (sharded replicas are built for ZeRO 1-3)"
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
        return cls._in_replica(cls.build(env, job, shard=lambda opt: ShardedOptimizer(opt, world)), env, job)

    @staticmethod
    def _in_replica(trainer: T, env: RankEnv, job: FitJob) -> T:
        """``trainer``'s context as a rank of its replica's world (a one-replica job to the callbacks)."""
        members = _members(job.plan, env.rank)
        ctx: TrainContext = trainer.ctx
        ctx.rank, ctx.world_size, ctx.group = members.index(env.rank), len(members), dist.group.WORLD
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
        with torch.no_grad():  # a DTensor's local shard (FSDP2) is then the tensor itself
            for p in params:
                if p.grad is not None:
                    sq += _local(p.grad).double().pow(2).sum()
            dist.all_reduce(sq)
            norm = sq.sqrt().to(torch.float32)[0]
            clip = self.job.grad_clip
            if clip > 0:
                coef = torch.clamp(clip / (norm + 1e-6), max=1.0)
                for p in params:
                    if p.grad is not None:
                        _local(p.grad).mul_(coef.to(p.grad.dtype))
        return norm

    def save_final(self) -> None:
        """The replica's first rank writes the weights (every rank holds them whole)."""
        if self.group_rank == 0:
            super().save_final()


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the tensor itself under ``no_grad``), else ``t``."""
    return t.to_local() if is_dtensor(t) else t


@dataclass
class FsdpReplicaTrainer(ShardedReplicaTrainer):
    """One rank of a ZeRO-2/3 replica: FSDP2 ``fully_shard`` over the replica's world (``parallel.fsdp.apply_zero``:
    each block a unit, gradients reduce-scattered and *summed* inside the replica); rank ``s`` sums its local
    shards over the replicas on torchft's group of shard ``s`` (the replicas being of one size, FSDP2's even
    ``Shard(0)`` split gives shard ``s`` the same rows in every replica)."""

    zero: Any = None
    """The :class:`~starverse.runtime.parallel.fsdp.ZeroModel` driving FSDP2 through a step."""

    @classmethod
    def build_fsdp(cls, env: RankEnv, job: FitJob) -> FsdpReplicaTrainer:
        """The model sharded by FSDP2 over the replica's world (before the optimizer is built on its shards)."""
        from torch.distributed.device_mesh import init_device_mesh

        from starverse.runtime.parallel.fsdp import apply_zero

        mesh = init_device_mesh(torch.device(env.spec.device).type, (dist.get_world_size(),))
        zeros: list[Any] = []
        trainer = cls._in_replica(cls.build(
            env, job, prepare=lambda m: zeros.append(apply_zero(m, mesh, job.plan.train.zero_stage))), env, job)
        trainer.zero = zeros[0]
        return trainer

    def forward_backward(self, micro_batches: Any, num_targets: int | None) -> float:
        """This rank's micro-batches (``k mod ranks``) in lockstep with the replica's other ranks (FSDP2's
        collectives pair up): a rank with one fewer runs the replica's first micro-batch again with weight 0."""
        batches = list(micro_batches)
        count = -(-len(batches) // self.group_size)
        mine = batches[self.group_rank::self.group_size]
        total = 0.0
        for i in range(count):
            self.zero.before_micro_batch(i, count)
            if i < len(mine):
                total += ReplicaTrainer.forward_backward(self, [mine[i]], num_targets)
            else:
                total += self.padding_pass(batches[0], num_targets)
        return total

    def padding_pass(self, idx: Any, num_targets: int | None) -> float:
        """A forward/backward whose gradients are zero (its collectives keep the replica in lockstep)."""
        x = torch.from_numpy(self.data.batch(idx)).to(self.device)
        y = self.data.batch_labels(idx)
        loss = batch_loss(self.model, x, self.job.loss_fn, None if y is None else torch.from_numpy(y).to(self.device),
                          num_targets)
        (loss * 0.0).backward()
        return 0.0

    def replica_sum(self) -> None:
        """Nothing: FSDP2 summed the gradients inside the replica (reduce-scatter)."""

    def synced_params(self) -> list[torch.nn.Parameter]:
        """Every trainable parameter (this rank holds a shard of each)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def grad_tensors(self, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
        """The local shards of the gradients (zeros where a parameter has none)."""
        with torch.no_grad():
            return [_local(p.grad) if p.grad is not None else torch.zeros_like(_local(p)) for p in params]

    def set_grads(self, params: list[torch.nn.Parameter], grads: list[torch.Tensor], summed: torch.Tensor) -> None:
        """Copy the replicas' sums into the local gradient shards."""
        offset = 0
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                n = g.numel()
                if p.grad is not None:  # a parameter without a gradient had none on any rank of any replica
                    g.copy_(summed[offset: offset + n].view_as(g))
                offset += n

    def live_state(self) -> dict[str, Any]:
        """The live state with every DTensor as its local shard (the joiner's shard ``s`` takes shard ``s``)."""
        return _tree(super().live_state(), lambda t: _local(t).detach().clone() if is_dtensor(t) else t)

    def load_live_state(self, sd: dict[str, Any]) -> None:
        """A peer's shard-``s`` state, its local shards wrapped back as DTensors like this rank's own."""
        from torch.distributed.tensor import DTensor

        got = sd["ctx"]
        got["model"] = _rewrap(self.ctx.state_dict()["model"], got["model"], DTensor)
        # a joiner's optimizer has no state yet: a moment is a DTensor like its parameter (the step count is not)
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        got["optimizer"]["state"] = {i: {k: _rewrap(params[int(i)], v, DTensor)
                                             if isinstance(v, torch.Tensor) and v.dim() else v
                                         for k, v in st.items()} for i, st in got["optimizer"]["state"].items()}
        super().load_live_state(sd)

    def save_final(self) -> None:
        """The whole weights, gathered from the shards (every rank of the leader replica), written by its first."""
        from starverse.runtime.lora import trainable_state_dict

        state = {k: (v.full_tensor() if is_dtensor(v) else v).detach().cpu()
                 for k, v in trainable_state_dict(self.model).items()}
        if self.group_rank == 0:
            write_final(self.job, state)


def _tree(obj: Any, fn: Any) -> Any:
    """``obj`` (dicts, lists, tuples) with ``fn`` applied to every leaf."""
    if isinstance(obj, dict):
        return {k: _tree(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_tree(v, fn) for v in obj)
    return fn(obj)


def _rewrap(own: Any, got: Any, dtensor: Any) -> Any:
    """``got`` with each leaf where ``own`` has a DTensor made a DTensor of ``own``'s mesh and placements."""
    if isinstance(own, dtensor):
        return dtensor.from_local(got, own.device_mesh, own.placements, run_check=False, shape=own.shape,
                                  stride=own.stride())
    if isinstance(own, dict) and isinstance(got, dict):
        return {k: _rewrap(own[k], v, dtensor) if k in own else v for k, v in got.items()}
    if isinstance(own, (list, tuple)) and isinstance(got, (list, tuple)) and len(own) == len(got):
        return type(got)(_rewrap(o, g, dtensor) for o, g in zip(own, got, strict=True))
    return got


def _members(plan: Plan, rank: int) -> list[int]:
    replicas = shard_replicas(plan)
    return [r for r, g in enumerate(replicas) if g == replicas[rank]]


def train_shard_replica(env: RankEnv, job: FitJob) -> RankResult | None:
    """The launched function of a rank of a sharded replica (ZeRO-1, or FSDP2 for ZeRO-2/3: the module docstring)."""
    build = ShardedReplicaTrainer.build_shard if job.plan.train.zero_stage == 1 else FsdpReplicaTrainer.build_fsdp
    return train_group_replica(env, job, shard_replicas(job.plan)[env.rank], _members(job.plan, env.rank), build)


__all__ = ["ShardedReplicaTrainer", "shard_replica_error", "shard_replicas", "train_shard_replica"]
