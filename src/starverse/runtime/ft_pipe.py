"""In-place recovery when a replica is a pipeline: torchft replica groups of several ranks (its stages).

As in torchft's HSDP examples, a replica is a *replica group* (:mod:`starverse.runtime.ft_multi`): its ranks (one
per pipeline stage, in stage order) form their own ``torch.distributed`` world (gloo: in-place recovery runs on CPU
ranks; NCCL is not built) for the pipeline's point-to-point transfers, and every rank has a torchft ``Manager``
with the replica's id, ``rank`` = its stage, ``world_size`` = the stages.
The quorum and the commit vote cover the whole replica; the reconfigurable gloo group of stage ``s`` sums the
gradients of stage ``s`` over the participating replicas, and a replacement replica's stage ``s`` heals from a
peer's stage ``s`` (its chunk's weights and optimizer state, the schedule, sampler, step and shares).

The step is :class:`~starverse.runtime.ft.ReplicaTrainer`'s (quorum, roster, this replica's share of the global
batch, summed gradients, commit vote, AdamW), with the replica's pipeline (:class:`PipelineRunner`) doing the
forward/backward; inside the replica, parameters held twice (a tied head) are summed and the gradient norm is
taken over all stages (:class:`~starverse.runtime.hetero_dp.HolderSync`), and the loss comes from the last stage.

A lost stage rank loses its replica: its other ranks are stopped by the launcher
(``starverse.elastic.inplace``), and the other replicas redo the step in flight without it. The replicas must
cut the model alike (one stage layout), so that a joiner's stage ``s`` and its peer's hold the same layers.
Callbacks run on every rank of the leader replica, which sees itself as a one-replica pipeline job
(``ctx.rank`` its stage, ``ctx.world_size`` its stages, ``ctx.group`` its world).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from starverse.runtime.callbacks import CallbackList, TrainContext
from starverse.runtime.eval_pipeline import PipelineScorer
from starverse.runtime.ft_group import ReplicaSync
from starverse.runtime.ft_multi import GroupReplicaTrainer, train_group_replica
from starverse.runtime.hetero_dp import HolderSync
from starverse.runtime.launch import RankEnv
from starverse.runtime.lora import trainable_state_dict
from starverse.runtime.parallel.pipeline import (
    PipelineRunner,
    UnsplitSignature,
    UnsplitView,
    min_micro_batches,
)
from starverse.runtime.parallel.pipeline_layout import PipelineLayout
from starverse.runtime.rank_job import FitJob, RankResult
from starverse.runtime.rank_parts import (
    gather_pipeline_weights,
    resume,
    state_bytes,
    training_parts,
    write_final,
)


def pipeline_replica_error(layout: PipelineLayout) -> str | None:
    """Why in-place recovery cannot run this pipelined layout (None: it can): every replica must be one pipeline
    without tensor parallelism or virtual stages, all cut alike (a joiner heals stage by stage from a peer)."""
    if layout.virtual_stages > 1:
        return "interleaved virtual stages"
    if any(p.tp_rank for p in layout.places):
        return "tensor parallelism inside a replica"
    if len(set(layout.stage_layers)) > 1:
        return "replicas whose pipelines cut the layers differently"
    return None


@dataclass
class PipelineReplicaTrainer(GroupReplicaTrainer):
    """One stage rank of a pipelined replica (built in the rank process by :meth:`build_stage`)."""

    pipeline: PipelineRunner | None = None
    """This rank's chunks and the replica's schedule."""
    holders: HolderSync | None = None
    """Inside the replica: sums a parameter held twice, the gradient norm over the stages."""
    layout: PipelineLayout | None = None
    """The plan's layout (replica and stage of every rank)."""
    pipeline_times: list[tuple[float, float]] = field(default_factory=list)
    """``(schedule wall time, compute time)`` of this rank's pipeline, per step attempted."""

    @classmethod
    def build_stage(cls, env: RankEnv, job: FitJob) -> PipelineReplicaTrainer:
        """This rank's chunks of the model, optimizer, schedule and data (collective inside the replica)."""
        device = torch.device(env.spec.device)
        torch.manual_seed(job.seed)
        np.random.seed(job.seed)
        layout = PipelineLayout.from_plan(job.plan)
        place = layout.places[env.rank]
        members = layout.replica_ranks[place.replica]
        full = torch.load(job.model_path, map_location="cpu", weights_only=False)
        full.train()
        world = dist.group.WORLD
        pipeline = PipelineRunner.build(full, layout, env.rank, device, job.plan.train.schedule,
                                        job.micro_batch / job.global_batch, {place.replica: world},
                                        job.weights_folder, job.loss_fn)
        model = UnsplitView(pipeline.parameters(), UnsplitSignature.of(full))
        del full
        optimizer, scheduler, data, sampler = training_parts(model, job)
        ctx = TrainContext(
            rank=members.index(env.rank), world_size=len(members), plan=job.plan, run_dir=job.run_dir, step=0,
            model=model, optimizer=optimizer, lr_scheduler=scheduler, sampler=sampler, group=world,
            device_kind=env.spec.device_kind, device=device, rank_kinds=[env.ranks[r].device_kind for r in members],
            max_steps=job.max_steps, shares=list(job.shares),
        )
        ctx.metrics.micro_batch = job.micro_batch
        # held-out sequences go through the pipeline; only the leader replica runs the callbacks: it scores them all
        ctx.held_out_scorer = PipelineScorer(pipeline, 0, 1, job.micro_batch, pipeline.has_last)
        callbacks = CallbackList(job.callbacks)
        resume(ctx, callbacks, job.resume_from, device)
        pipeline.on_compute = lambda dt: callbacks.on_micro_batch_end(ctx, dt)
        holders = HolderSync(list(model.named_parameters()), 0, [env.ranks[r].device_kind for r in members],
                             [env.ranks[r].device for r in members], world, job.bucket_mb)
        return cls(job=job, env=env, device=device, model=model, optimizer=optimizer, data=data, ctx=ctx,
                   callbacks=callbacks, pipeline=pipeline, holders=holders, layout=layout, replica=place.replica,
                   group_rank=members.index(env.rank), group_size=len(members))

    @property
    def min_share(self) -> int:
        """The fewest micro-batches the replica's schedule runs (1F1B: one per stage)."""
        return min_micro_batches(self.job.plan.train.schedule, self.group_size)

    def forward_backward(self, micro_batches: Any, num_targets: int | None) -> float:
        """This replica's micro-batches through its pipeline (this rank's part of the loss: 0 but on the last
        stage)."""
        assert self.pipeline is not None
        rows = np.concatenate(list(micro_batches))
        y = self.data.batch_labels(rows)
        part = self.pipeline.step(torch.from_numpy(self.data.batch(rows)), len(micro_batches),
                                  None if y is None else torch.from_numpy(y), num_targets)
        self.pipeline_times.append((self.pipeline.times.step_s, self.pipeline.times.busy_s))
        return part

    def run(self, sync: ReplicaSync) -> RankResult | None:
        """The replica loop; the result carries this stage's figures for the run's pipeline report."""
        result = super().run(sync)
        if result is None or self.pipeline is None or not self.pipeline_times:
            return result
        times = self.pipeline_times[1:] or self.pipeline_times  # the first: shape inference, warm-up
        return dataclasses.replace(
            result, pipeline_step_s=sum(t for t, _ in times) / len(times),
            pipeline_busy_s=sum(b for _, b in times) / len(times),
            num_chunk_runs=len(self.pipeline.chunks) * result.share, state_bytes=state_bytes(self.model, self.optimizer),
            loaded_tensors=sum(c.loaded_tensors for c in self.pipeline.chunks))

    def replica_sum(self) -> None:
        """Sum the gradient of a parameter two stages hold (a tied head)."""
        assert self.holders is not None
        self.holders.all_reduce()

    def clip(self, params: list[torch.nn.Parameter]) -> torch.Tensor:
        """The gradient norm over every stage of the replica (each parameter once), clipped there."""
        assert self.holders is not None
        return self.holders.clip_grad_norm_(self.job.grad_clip)

    def save_final(self) -> None:
        """The stages' parts gathered on the replica's first stage, written as the whole model's weights."""
        mine = {k: v.detach().cpu() for k, v in trainable_state_dict(self.model).items()}
        state = gather_pipeline_weights(mine, self.job, self.group_size, dist.group.WORLD)
        if state is not None:
            write_final(self.job, state)


def train_pipeline_replica(env: RankEnv, job: FitJob) -> RankResult | None:
    """The launched function of a stage rank of a pipelined replica (see the module docstring)."""
    layout = PipelineLayout.from_plan(job.plan)
    replica = layout.places[env.rank].replica
    return train_group_replica(env, job, replica, layout.replica_ranks[replica], PipelineReplicaTrainer.build_stage)
