"""In-place recovery of data-parallel replicas on torchft: survivors keep training when a replica dies.

Opt-in (``recovery: in-place`` in a job file, ``Trainer(recovery="in-place")``), for plans whose replicas
are single ranks (this module), pipelines (:mod:`starverse.runtime.ft_pipe`) or sharded groups (ZeRO-1, or
ZeRO-2/3 on FSDP2: :mod:`starverse.runtime.ft_shard`), the last two reusing this loop with a replica group of
several ranks (:mod:`starverse.runtime.ft_multi`; offload keeps checkpoint-restart). A single rank is
one torchft *replica group* of size 1: it owns a :class:`torchft.Manager` that talks to the launcher's
Lighthouse (``env.extra["lighthouse"]``), and a reconfigurable :class:`torchft.ProcessGroupGloo` that torchft
rebuilds for every new quorum. No ``torch.distributed`` default group is used: a dead peer can only fail
one step, never hang the job.

One step, on every replica (:meth:`ReplicaTrainer.try_step`):

1. **quorum** (:meth:`ReplicaSync.start_step`): the Lighthouse's membership for this step. A replica that
   joins late (a replacement, a device back) has a lower step; torchft *heals* it here: it receives the
   live weights, optimizer, schedule, sampler position and shares from a peer (``PGTransport``: over the
   process group, no extra listener) and joins at this step boundary.
2. **roster**, only when the membership changed (a new quorum id: a loss, a join, a failed step; else the last
   step's members and shares stand): one small all-reduce of every participant's replica index and measured
   time per micro-batch, so every participant computes the same shares (:func:`replica_shares`: the current ones while the
   membership is unchanged, the rebalancer's split of the *whole* global batch over the participants when it
   changed, so a lost replica's share is redistributed and the global batch stays exact).
3. **forward/backward** of this replica's slice of the global batch, each micro-batch's loss scaled by
   ``micro_batch / global_batch``; the gradients and every participant's loss part and times are summed in
   one all-reduce (``Manager.allreduce``, SUM) in the gradients' dtype (fp32), as the restart path sums them.
   A replica whose all-reduce failed aborts its process group at once (:meth:`TorchftSync.allreduce_sum`), so
   a survivor waiting on it fails too instead of at the collective timeout; and when the launcher announces a
   loss (a replica that died, or stopped: its heartbeat), every survivor gives up its collective with it at once
   (:class:`~starverse.runtime.ft_group.LossWatch`), even if the lost peer's connections stay open.
4. **commit** (``Manager.should_commit``): if any participant failed the step (a peer died mid-collective),
   no one applies it: the sampler is rewound and the same global batch is redone with the new quorum's
   shares. Else clip, AdamW, schedule: the update equals a single process's step on the same global batch.

Callbacks (checkpoint, progress, billing, metrics) run on the *leader* only: the participant with quorum rank
0 (replica ids sort by index, so the lowest surviving replica), seeing ``rank 0`` of ``world_size 1`` and no
group; leadership moves to the next replica when the leader dies (its callbacks' ``on_fit_start`` runs then).

The torchft wiring (``Manager``, loopback bind, :class:`TorchftSync`) is in :mod:`starverse.runtime.ft_group`;
the start barrier, warm spares and the joined signal in :mod:`starverse.runtime.ft_join`.

This module imports only torch, torchft and the runtime (never elastic, providers or jobs): the launcher
(``starverse.elastic.inplace.InplaceLauncher``) provides the Lighthouse and the start barrier.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import numpy as np
import torch

from starverse.errors import ConfigError, TrainingDivergedError
from starverse.runtime.callbacks import CallbackList, TrainContext
from starverse.runtime.data import PackedDataset
from starverse.runtime.ft_group import (
    EXTRA_JOINER,
    EXTRA_LIGHTHOUSE,
    EXTRA_REPLICA_STORE,
    EXTRA_SPARE,
    Quorum,
    ReplicaSync,
    TorchftSync,
    bind_host,
    loopback_manager_server,
    loss_notices,
)
from starverse.runtime.ft_join import announce_joined, load_model, start_barrier, wait_for_activation
from starverse.runtime.hetero_dp import balanced_shares
from starverse.runtime.launch import RankEnv
from starverse.runtime.lora import trainable_state_dict
from starverse.runtime.rank_loop import FitJob, RankResult, training_parts
from starverse.runtime.rank_parts import write_final
from starverse.runtime.steps import autocast_dtype, batch_loss

log = logging.getLogger(__name__)

INPLACE_LOG = "inplace.jsonl"
"""Run-directory file of membership changes and redone steps (one JSON object a line, written by the leader)."""


def replica_shares(num_micro: int, roster: Sequence[tuple[int, float]], previous: Sequence[int] | None,
                   previous_members: Sequence[int] | None, min_share: int = 1) -> list[int]:
    """Micro-batches per participant for one step (identical on every participant: a function of the roster).

    ``roster``: ``(replica index, time per micro-batch or 0 if unmeasured)`` per participant, in quorum order.
    While the members are those of the last step, the last shares are kept; when they changed (a loss, a
    join), the whole global batch is split again by measured speed (the rebalancer's greedy split; an
    unmeasured replica counts as the mean of the measured ones; each gets at least ``min_share``: a pipeline's
    schedule may need as many micro-batches as stages).
    """
    members = [r for r, _ in roster]
    if previous is not None and previous_members is not None and list(previous_members) == members:
        return list(previous)
    known = [t for _, t in roster if t > 0]
    fill = sum(known) / len(known) if known else 1.0
    return balanced_shares(num_micro, [t if t > 0 else fill for _, t in roster], [min_share] * len(roster))


class _NothingToJoin(Exception):
    """A replacement found no other replica in its first quorum."""


@dataclass
class ReplicaTrainer:
    """One replica's parts and its fault-tolerant loop (built in the rank process by :meth:`build`)."""

    job: FitJob
    """The job."""
    env: RankEnv
    """Who this replica is (``env.rank`` is its replica index)."""
    device: torch.device
    """Where it computes."""
    model: torch.nn.Module
    """The whole model."""
    optimizer: torch.optim.Optimizer
    """AdamW."""
    data: PackedDataset
    """The packed sequences."""
    ctx: TrainContext
    """Model, optimizer, schedule, sampler, step, shares: the live state (what a joiner receives)."""
    callbacks: CallbackList
    """The job's hooks (run on the leader)."""
    sync: ReplicaSync | None = None
    """The fault-tolerant group (set by :meth:`run`)."""
    members: list[int] | None = None
    """Replica indices of the last committed step's participants, in quorum order."""
    leader_started: bool = False
    """True once this replica ran the callbacks' ``on_fit_start`` (it became the leader)."""
    my_times: deque[float] = field(default_factory=lambda: deque(maxlen=5))
    """This replica's recent compute time per micro-batch."""
    losses: list[float] = field(default_factory=list)
    """Loss of every committed step of the run (a joiner receives the earlier ones with the live state)."""
    step_times: list[float] = field(default_factory=list)
    """Wall time (slowest participant) of every committed step."""
    shares_history: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)
    """``(step, shares)`` at the start and at every change of members or shares."""
    tokens: int = 0
    """Tokens this replica processed."""
    compute_s: float = 0.0
    """This replica's forward+backward time."""
    redone: int = 0
    """Steps redone after a failed commit."""
    last_quorum: Quorum | None = None
    """The quorum of the last step attempted."""
    joiner: bool = False
    """Started after the job began (a replacement): it must receive the live state from a peer."""
    failed_at: float | None = None
    """When this replica's last attempt at a step failed (None: the last one committed)."""
    committed_quorum: int = -1
    """The quorum id of the last step this replica committed (-1: none yet; a joiner's first step has a new one)."""
    ready_at: float = 0.0
    """When this replica's torchft manager was up (process started or spare activated, model built)."""

    @classmethod
    def build(cls, env: RankEnv, job: FitJob, model: torch.nn.Module | None = None,
              shard: Callable[[torch.optim.Optimizer], torch.optim.Optimizer] | None = None,
              prepare: Callable[[torch.nn.Module], object] | None = None) -> Self:
        """Create this replica's model (``model``: already loaded on the CPU, a warm spare's; its blocks wrapped for
        the plan's recompute, then ``prepare``: FSDP2 inside a replica), optimizer (``shard``: wraps it, ZeRO-1
        inside a replica), schedule and data (no collectives but ``prepare``'s)."""
        from starverse.runtime.parallel.recompute import apply_recompute

        device = torch.device(env.spec.device)
        torch.manual_seed(job.seed)
        np.random.seed(job.seed)
        if model is None:
            model = load_model(job)
        model = model.to(device)
        model.train()
        apply_recompute(model, job.plan.train.recompute, early_stop=job.plan.train.recompute_early_stop)
        if prepare is not None:
            prepare(model)
        optimizer, scheduler, data, sampler = training_parts(model, job, shard)
        ctx = TrainContext(
            rank=0, world_size=1, plan=job.plan, run_dir=job.run_dir, step=0, model=model, optimizer=optimizer,
            lr_scheduler=scheduler, sampler=sampler, group=None, device_kind=env.spec.device_kind, device=device,
            rank_kinds=[r.device_kind for r in env.ranks], max_steps=job.max_steps, shares=list(job.shares),
        )
        ctx.metrics.micro_batch = job.micro_batch
        callbacks = CallbackList(job.callbacks)
        if job.resume_from is not None:
            ctx.extra["resume_from"] = job.resume_from
            if not callbacks.on_resume(ctx, job.resume_from):
                ctx.load_state_dict(torch.load(job.resume_from, map_location=device, weights_only=False))
        return cls(job=job, env=env, device=device, model=model, optimizer=optimizer, data=data, ctx=ctx,
                   callbacks=callbacks)

    # the state a joiner receives from a peer (torchft calls these from its quorum thread / main thread)
    def live_state(self) -> dict[str, Any]:
        """Model, optimizer, schedule, sampler, step, shares, the last members and the run's history so far."""
        return {"ctx": self.ctx.state_dict(), "members": self.members, "losses": list(self.losses),
                "step_times": list(self.step_times), "shares_history": [list(h) for h in self.shares_history]}

    def load_live_state(self, sd: dict[str, Any]) -> None:
        """Adopt a peer's live state (a joiner, at a step boundary)."""
        self.ctx.load_state_dict(sd["ctx"])
        self.members = sd["members"]
        self.losses, self.step_times = list(sd["losses"]), list(sd["step_times"])
        self.shares_history = [(int(st), tuple(sh)) for st, sh in sd["shares_history"]]
        self.note({"event": "healed", "replica": self.replica_index, "step": self.ctx.step, "ready_at": self.ready_at})
        log.info("replica %d joined at step %d with the live state of a peer", self.replica_index, self.ctx.step)

    # what a replica of several ranks (runtime/ft_pipe.py) does differently
    @property
    def replica_index(self) -> int:
        """This replica's index in the plan (a replica of one rank: its rank)."""
        return self.env.rank

    @property
    def min_share(self) -> int:
        """The fewest micro-batches a step may give this replica."""
        return 1

    def set_ctx_rank(self, q: Quorum) -> None:
        """What the callbacks see as this rank: the leader is rank 0 of a world of 1."""
        self.ctx.rank = q.rank

    def replica_sum(self) -> None:
        """Sum inside the replica what its ranks hold twice (nothing: one rank holds the whole model)."""

    def synced_params(self) -> list[torch.nn.Parameter]:
        """The parameters whose gradients this rank sums over the replicas and updates (one rank: all)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def grad_tensors(self, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
        """The gradients of ``params`` this rank sums over the replicas (zeros where a parameter has none)."""
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]

    def set_grads(self, params: list[torch.nn.Parameter], grads: list[torch.Tensor], summed: torch.Tensor) -> None:
        """Make ``summed`` (the replicas' sum of ``grads``, flattened in order) the gradients of ``params``."""
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = summed[offset: offset + n].view_as(p).to(p.dtype)  # a view of the sum when the dtypes agree
            offset += n

    def clip(self, params: list[torch.nn.Parameter]) -> torch.Tensor:
        """Clip the summed gradients to ``grad_clip``; the gradient norm before clipping."""
        clip = self.job.grad_clip
        return torch.nn.utils.clip_grad_norm_(params, clip) if clip > 0 else torch.stack(
            [p.grad.norm() for p in params if p.grad is not None]).norm()

    def step_loss(self, stats: torch.Tensor) -> float:
        """The step's loss from the summed loss parts of the participants."""
        return float(stats[:, 0].sum())

    def save_final(self) -> None:
        """Write the final weights (the last leader)."""
        write_final(self.job, {k: v.detach().cpu() for k, v in trainable_state_dict(self.model).items()})

    @property
    def num_micro(self) -> int:
        """Micro-batches per global batch."""
        return int(self.job.global_batch // self.job.micro_batch)

    def try_step(self, sync: ReplicaSync) -> bool:
        """One attempt at the next step; True if it was committed (applied), False if it must be redone."""
        job, ctx = self.job, self.ctx
        t0 = time.perf_counter()
        q = sync.start_step()
        self.last_quorum = q
        self.set_ctx_rank(q)
        if self.joiner and self.members is None and q.size == 1:
            raise _NothingToJoin  # the others finished or are gone: no live state to receive
        if q.rank == 0:
            self.lead()
            if self.failed_at is not None:
                self.note({"event": "requorum", "step": ctx.step + 1, "members_before": self.members,
                           "participants": q.size, "failed_at": self.failed_at})
        self.failed_at = None
        if self.members is not None and q.quorum_id >= 0 and q.quorum_id == self.committed_quorum:
            members, shares = self.members, list(ctx.shares)  # the last step's members: no roster needed
        else:
            roster_t = torch.zeros(q.size, 2, dtype=torch.float64)
            tpm = float(np.median(self.my_times)) if self.my_times else 0.0
            roster_t[q.rank] = torch.tensor([float(self.replica_index), tpm], dtype=torch.float64)
            if not sync.allreduce_sum(roster_t):  # a peer died before the step began: new quorum, same step
                return self.redo(sync)
            roster = [(round(float(r[0])), float(r[1])) for r in roster_t]
            members = [r for r, _ in roster]
            shares = replica_shares(self.num_micro, roster, ctx.shares, self.members, self.min_share)
        sampler_state = ctx.sampler.state_dict()
        batch_idx = ctx.sampler.next_indices(job.global_batch)
        start = sum(shares[: q.rank]) * job.micro_batch
        mine = [batch_idx[start + k * job.micro_batch: start + (k + 1) * job.micro_batch]
                for k in range(shares[q.rank])]
        num_targets = self.data.num_targets(batch_idx) if self.data.labels is not None else None
        tc = time.perf_counter()
        loss_part = self.forward_backward(mine, num_targets)
        self.replica_sum()
        compute_s = time.perf_counter() - tc
        params = self.synced_params()
        grads = self.grad_tensors(params)
        # one buffer in the gradients' dtype (at least fp32), as the restart path's buckets; each stats row has one
        # non-zero contributor, so its sum is exact
        dtype = functools.reduce(torch.promote_types, [g.dtype for g in grads], torch.float32)
        stats = torch.zeros(q.size, 4, dtype=dtype)
        stats[q.rank] = torch.tensor([loss_part, compute_s, time.perf_counter() - t0,
                                      0.0 if ctx.stop_reason is None else 1.0], dtype=dtype)
        flat = torch.cat([*(g.reshape(-1).to(dtype) for g in grads), stats.reshape(-1)])
        sync.allreduce_sum(flat)
        if not sync.commit():
            ctx.sampler.load_state_dict(sampler_state)
            self.optimizer.zero_grad(set_to_none=True)
            self.redone += 1
            self.failed_at = time.time()
            log.warning("replica %d: step %d failed on a peer; redoing it with the new quorum",
                        self.replica_index, ctx.step + 1)
            return False
        stats = flat[-stats.numel():].reshape(q.size, 4)
        self.set_grads(params, grads, flat[: -stats.numel()])
        norm = self.clip(params)
        lr = float(self.optimizer.param_groups[0]["lr"])
        loss = self.step_loss(stats)
        if not (math.isfinite(loss) and math.isfinite(float(norm))):
            raise TrainingDivergedError(
                f"step {ctx.step + 1}: the loss is not finite (gradient norm {float(norm):.3g}); training stopped "
                "before applying the step. To fix: lower train.lr, then resume from the last checkpoint")
        self.optimizer.step()
        ctx.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if shares[q.rank]:
            self.my_times.append(compute_s / shares[q.rank])
        self.record(q, shares, members, stats, lr, float(norm), loss)
        self.committed_quorum = q.quorum_id
        return True

    def redo(self, sync: ReplicaSync) -> bool:
        """End a step that failed before any computation (commit says no everywhere); it is redone."""
        self.failed_at = time.time()
        if sync.commit():
            raise RuntimeError("torchft committed a step whose collective failed")  # cannot happen: a bug
        return False

    def forward_backward(self, micro_batches: Sequence[np.ndarray], num_targets: int | None) -> float:
        """Forward and backward of this replica's micro-batches (each loss scaled to the global batch)."""
        job = self.job
        amp = autocast_dtype(job.precision, self.device)
        scale = job.micro_batch / job.global_batch
        total = 0.0
        for idx in micro_batches:
            tm = time.perf_counter()
            x = torch.from_numpy(self.data.batch(idx)).to(self.device)
            y = self.data.batch_labels(idx)
            with torch.autocast(self.device.type, dtype=amp, enabled=amp is not None):
                loss = batch_loss(self.model, x, job.loss_fn,
                                  None if y is None else torch.from_numpy(y).to(self.device), num_targets)
            weight = scale if y is None else 1.0
            (loss * weight).backward()
            total += float(loss.detach()) * weight
            self.callbacks.on_micro_batch_end(self.ctx, time.perf_counter() - tm)  # every replica: local hooks
        return total

    def record(self, q: Quorum, shares: list[int], members: list[int], stats: torch.Tensor, lr: float,
               norm: float, loss: float) -> None:
        """Count the committed step; note a membership change; the leader runs the callbacks."""
        job, ctx = self.job, self.ctx
        if members != self.members:
            if self.members is not None and q.rank == 0:
                gone = sorted(set(self.members) - set(members))
                new = sorted(set(members) - set(self.members))
                self.note({"event": "members", "step": ctx.step + 1, "lost": gone, "joined": new,
                           "members": members, "shares": shares})
            if self.members is not None or tuple(shares) != self.shares_history[-1][1]:
                self.shares_history.append((ctx.step, tuple(shares)))
        self.members = members
        ctx.shares = shares
        ctx.step += 1
        self.tokens += shares[q.rank] * job.micro_batch * job.seq_len
        self.compute_s += float(stats[q.rank, 1])
        m = ctx.metrics
        m.loss = loss
        m.tokens_step = job.global_batch * job.seq_len
        m.tokens_total += m.tokens_step
        m.step_time_s = float(stats[:, 2].max())
        m.step_times_s = [float(x) for x in stats[:, 2]]
        m.compute_times_s = [float(x) for x in stats[:, 1]]
        m.shares = list(shares)
        m.tokens_per_s = m.tokens_step / m.step_time_s if m.step_time_s > 0 else 0.0
        m.lr = lr
        m.grad_norm = norm
        self.losses.append(m.loss)
        self.step_times.append(m.step_time_s)
        if bool(stats[:, 3].sum() > 0) and ctx.stop_reason is None:
            ctx.stop_reason = "stop requested by another replica"
        if q.rank == 0:
            self.callbacks.on_step_end(ctx)

    def lead(self) -> None:
        """Become the leader: run the callbacks' ``on_fit_start`` once. The first leader is replica 0 (the
        quorum sorts replicas by index and the first quorum holds them all); any other leader takes over."""
        if self.leader_started:
            return
        self.leader_started = True
        self.ctx.takeover = self.replica_index != 0 or self.joiner
        self.callbacks.on_fit_start(self.ctx)

    def note(self, event: dict[str, Any]) -> None:
        """Append an event to the run's in-place log (the leader; a joiner notes its healing)."""
        event = {"time": time.time(), **event}
        with (Path(self.job.run_dir) / INPLACE_LOG).open("a") as f:
            f.write(json.dumps(event) + "\n")

    def run(self, sync: ReplicaSync) -> RankResult | None:
        """Steps until ``max_steps`` or an agreed stop; the last leader writes the final weights."""
        self.sync = sync
        if not self.shares_history:
            self.shares_history = [(self.ctx.step, tuple(self.ctx.shares))]
        t_loop = time.perf_counter()
        announce = self.joiner
        while self.ctx.step < self.job.max_steps:
            try:
                committed = self.try_step(sync)
                if committed and announce:
                    announce = False
                    announce_joined(self.env)
                if committed and self.ctx.stop_reason is not None:
                    break
            except _NothingToJoin:
                log.warning("replica %d: started as a replacement but no other replica is left; leaving",
                            self.replica_index)
                return None
        wall = time.perf_counter() - t_loop
        leader = self.last_quorum is not None and self.last_quorum.rank == 0
        if leader:
            self.lead()
            self.callbacks.on_fit_end(self.ctx)
            self.save_final()
            if self.redone:
                self.note({"event": "redone", "steps": self.redone})
        ctx = self.ctx
        return RankResult(
            step=ctx.step, losses=tuple(self.losses), tokens_total=ctx.metrics.tokens_total, wall_s=wall,
            step_times=tuple(self.step_times), shares_history=tuple(self.shares_history),
            stop_reason=ctx.stop_reason, tokens=self.tokens, compute_s=self.compute_s,
            share=ctx.shares[self.last_quorum.rank] if self.last_quorum is not None else 0,
        )



def _mark_joiner(env: RankEnv) -> None:
    """``$STARVERSE_JOINER`` in a replacement's process: :mod:`starverse.testing`'s fault injectors spare it."""
    if env.extra.get(EXTRA_JOINER):
        os.environ["STARVERSE_JOINER"] = "1"


def train_replica(env: RankEnv, job: FitJob) -> RankResult | None:
    """The launched function for ``recovery: in-place``: build the replica, join the quorum, run the loop (a warm
    spare first waits for its activation)."""
    lighthouse = env.extra.get(EXTRA_LIGHTHOUSE)
    if not lighthouse:
        raise ConfigError("recovery: in-place needs a launcher with a torchft Lighthouse "
                          "(starverse.elastic.inplace.InplaceLauncher).")
    _mark_joiner(env)  # a replacement's ranks, whatever the replica's layout
    if env.extra.get(EXTRA_REPLICA_STORE) is not None:  # a replica of several ranks
        if job.plan.train.zero_stage:  # ranks sharding the optimizer state
            from starverse.runtime.ft_shard import train_shard_replica

            return train_shard_replica(env, job)
        from starverse.runtime.ft_pipe import train_pipeline_replica  # a pipeline's stages

        return train_pipeline_replica(env, job)
    model = None
    if env.extra.get(EXTRA_SPARE):
        env, model = wait_for_activation(env, job)
        _mark_joiner(env)  # activated as a replacement
    trainer = ReplicaTrainer.build(env, job, model)
    trainer.joiner = bool(env.extra.get(EXTRA_JOINER))
    sync = TorchftSync(f"replica{env.rank:04d}", str(lighthouse), env.collective_timeout_s,
                       trainer.live_state, trainer.load_live_state, host=bind_host(env.extra),
                       losses=loss_notices(env.extra))
    trainer.ready_at = time.time()
    start_barrier(env)  # after the Manager: every initial replica heartbeats, so the first quorum waits for all
    try:
        return trainer.run(sync)
    finally:
        sync.shutdown()


__all__ = [  # what the tests and benchmarks import from here (EXTRA_JOINER, loopback_manager_server: ft_group)
    "EXTRA_JOINER", "INPLACE_LOG", "ReplicaTrainer", "loopback_manager_server", "replica_shares", "train_replica",
]
