"""One rank's parts, torchtitan style: built once (:meth:`RankParts.build`: mesh, model made ready for the rank
with its pipeline chunks, tensor parallel and ZeRO, optimizer, schedule, data, gradient sync, rebalancer,
callbacks) and read at the end (final weights, state bytes, pipeline figures). The step and the loop over these
parts are :class:`starverse.runtime.rank_loop.RankTrainer`'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import numpy as np
import torch
import torch.distributed as dist

from starverse.errors import ConfigError
from starverse.runtime.callbacks import CallbackList, TrainContext
from starverse.runtime.data import DeterministicSampler, PackedDataset
from starverse.runtime.eval_pipeline import PipelineScorer
from starverse.runtime.export import FINAL_WEIGHTS
from starverse.runtime.hetero_dp import GradientSync, HolderSync, Rebalancer, local
from starverse.runtime.launch import RankEnv
from starverse.runtime.lora import trainable_state_dict
from starverse.runtime.mesh import MixedMesh
from starverse.runtime.parallel.fsdp import ZeroModel
from starverse.runtime.parallel.parallelize import (
    ParallelModel,
    full_tensors,
    lockstep_micro_batches,
    parallelize_for_plan,
)
from starverse.runtime.parallel.pipeline import (
    PipelineRunner,
    UnsplitSignature,
    UnsplitView,
    min_micro_batches,
    pipeline_groups,
)
from starverse.runtime.parallel.pipeline_layout import PipelineLayout
from starverse.runtime.parallel.pipeline_parallel import (
    parallelize_chunks,
    pipeline_parallel_config,
    stage_meshes,
)
from starverse.runtime.parallel.pipeline_weights import load_chunk_weights
from starverse.runtime.rank_job import FitJob
from starverse.runtime.steps import autocast_dtype, make_optimizer, make_schedule


@dataclass
class _Timer:
    device: torch.device

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


@dataclass
class RankParts:
    """One rank's parts (built inside the rank process by :meth:`build`), and what it reports at the end."""

    job: FitJob
    """The job."""
    env: RankEnv
    """Who this rank is."""
    device: torch.device
    """The torch device this rank computes on."""
    mesh: MixedMesh
    """Process groups: native inside a kind, gloo bridge between kinds, host group over all."""
    model: torch.nn.Module
    """This rank's model (ready for the rank: see :meth:`prepare_model`)."""
    optimizer: torch.optim.Optimizer
    """AdamW over the model's trainable parameters."""
    scheduler: torch.optim.lr_scheduler.LambdaLR
    """Warm-up + cosine."""
    data: PackedDataset
    """The packed sequences."""
    sampler: DeterministicSampler
    """Global-batch order, identical on every rank."""
    callbacks: CallbackList
    """The user's hooks."""
    ctx: TrainContext
    """What callbacks see."""
    grads: GradientSync | HolderSync | ParallelModel
    """Sums gradients over the ranks that hold each parameter (FSDP2 does it in the backward under ZeRO)."""
    layout: PipelineLayout
    """Where every rank sits in the plan (replica, stage)."""
    pipeline: PipelineRunner | None
    """This rank's pipeline chunks and schedule (None: the whole model on this rank)."""
    rebalancer: Rebalancer
    """Proposes new shares from measured compute times."""
    amp: torch.dtype | None
    """Autocast dtype on this device (None: fp32)."""
    timer: _Timer
    """Wall clock that waits for the device."""
    losses: list[float] = field(default_factory=list)
    """Loss of every step of this fit."""
    step_times: list[float] = field(default_factory=list)
    """Wall time (slowest rank) of every step of this fit."""
    shares_history: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)
    """``(step, shares)`` at the start and at every change."""
    tokens: int = 0
    """Tokens this rank processed."""
    compute_s: float = 0.0
    """This rank's forward+backward time."""
    pipeline_times: list[tuple[float, float]] = field(default_factory=list)
    """``(schedule wall time, compute time)`` of this rank's pipeline, per step."""

    @classmethod
    def build(cls, env: RankEnv, job: FitJob) -> Self:
        """Create every part of this rank (collective: every rank calls it)."""
        device = torch.device(env.spec.device)
        torch.manual_seed(job.seed)
        np.random.seed(job.seed)
        kinds, devices = [r.device_kind for r in env.ranks], [r.device for r in env.ranks]
        mesh = MixedMesh.build(kinds, devices)
        layout = PipelineLayout.from_plan(job.plan)
        full = torch.load(job.model_path, map_location="cpu", weights_only=False)
        pipeline: PipelineRunner | None = None
        parallel: ParallelModel | None = None
        zeros: list[ZeroModel] = []
        if layout.is_pipelined:
            full.train()
            pipeline = PipelineRunner.build(
                full, layout, env.rank, device, job.plan.train.schedule, job.micro_batch / job.global_batch,
                pipeline_groups(layout, kinds, devices), job.weights_folder, job.loss_fn,
            )
            in_stage = pipeline_parallel_config(job.plan)
            if not in_stage.is_plain:  # the same on every rank: all build the stage meshes together
                zeros = parallelize_chunks(pipeline.chunks, in_stage,
                                           stage_meshes(layout, devices, in_stage, device.type))
            model: torch.nn.Module = UnsplitView(pipeline.parameters(), UnsplitSignature.of(full))
            del full
        else:
            model = cls.prepare_model(full, device, job)
            parallel = parallelize_for_plan(model, job.plan, device, env.world_size)
            if parallel is not None:
                model = parallel.model
        # ZeRO-1: the optimizer state sharded over the replicas (of this rank's stage in a pipeline)
        shard = parallel.shard_optimizer if parallel is not None else (zeros[0].shard_optimizer if zeros else None)
        optimizer, scheduler, data, sampler = training_parts(model, job, shard)
        ctx = TrainContext(
            rank=env.rank, world_size=env.world_size, plan=job.plan, run_dir=job.run_dir, step=0, model=model,
            optimizer=optimizer, lr_scheduler=scheduler, sampler=sampler, group=mesh.host_group,
            device_kind=env.spec.device_kind, device=device, rank_kinds=[r.device_kind for r in env.ranks],
            max_steps=job.max_steps, shares=list(job.shares),
        )
        ctx.metrics.micro_batch = job.micro_batch
        if pipeline is not None:  # no rank holds the whole model: held-out sequences go through the pipelines
            place = layout.places[env.rank]
            ctx.held_out_scorer = PipelineScorer(pipeline, place.replica, layout.num_replicas, job.micro_batch,
                                                 pipeline.has_last and place.tp_rank == 0)
        callbacks = CallbackList(job.callbacks)
        resume(ctx, callbacks, job.resume_from, device)
        callbacks.on_fit_start(ctx)
        grads: GradientSync | HolderSync | ParallelModel
        if pipeline is not None:
            pipeline.on_compute = lambda dt: callbacks.on_micro_batch_end(ctx, dt)
            place = layout.places[env.rank]  # under FSDP2 (ZeRO-2/3, ZeRO-1 with offload) summed over the replicas
            grads = HolderSync(list(model.named_parameters()), place.tp_rank, kinds, devices, mesh.host_group,
                               job.bucket_mb, place.replica if any(z.fsdp for z in zeros) else None)
        elif parallel is not None and parallel.syncs_own_gradients:
            grads = parallel
        else:
            grads = GradientSync(list(model.parameters()), mesh, job.bucket_mb, env.world_size)
        min_shares = tuple(
            min_micro_batches(job.plan.train.schedule, layout.num_stages(g)) for g in layout.replica_group
        )
        return cls(
            job=job, env=env, device=device, mesh=mesh, model=model, optimizer=optimizer, scheduler=scheduler,
            data=data, sampler=sampler, callbacks=callbacks, ctx=ctx, grads=grads, layout=layout, pipeline=pipeline,
            rebalancer=Rebalancer(sum(ctx.shares), every=job.rebalance_every, hysteresis=job.hysteresis,
                                  min_shares=min_shares),
            amp=autocast_dtype(job.precision, device), timer=_Timer(device),
            shares_history=[(ctx.step, tuple(ctx.shares))],
        )

    @staticmethod
    def prepare_model(model: torch.nn.Module, device: torch.device, job: FitJob) -> torch.nn.Module:
        """Make the user's model ready for this rank: today, moved to its device in training mode."""
        model = model.to(device)
        model.train()
        return model

    @property
    def rank(self) -> int:
        """This rank."""
        return self.env.rank

    @property
    def replica(self) -> int:
        """This rank's data-parallel replica (the rank itself without pipelines)."""
        return self.layout.replica_of(self.rank)

    def my_micro_batches(self, batch_idx: np.ndarray) -> list[np.ndarray]:
        """This rank's replica's micro-batches (sequence indices) of a global batch, by the current shares."""
        mb = self.job.micro_batch
        shares = self.ctx.shares
        start = sum(shares[: self.replica]) * mb
        if isinstance(self.grads, ParallelModel) and self.grads.lockstep:  # ZeRO-2/3: equal counts, uneven sizes
            return lockstep_micro_batches(batch_idx[start : start + shares[self.replica] * mb], shares)
        return [batch_idx[start + k * mb : start + (k + 1) * mb] for k in range(shares[self.replica])]

    def pipeline_figures(self) -> dict[str, Any]:
        """Per-step means of the pipeline's wall and compute time on this rank, the first step (shape inference,
        warm-up) left out when there are more (empty without a pipeline)."""
        if self.pipeline is None or not self.pipeline_times:
            return {}
        times = self.pipeline_times[1:] or self.pipeline_times
        runs = len(self.pipeline.chunks) * self.ctx.shares[self.replica]
        return {"pipeline_step_s": sum(t for t, _ in times) / len(times),
                "pipeline_busy_s": sum(b for _, b in times) / len(times), "num_chunk_runs": runs}

    def state_bytes(self) -> int:
        """Bytes of parameters, gradients (as many as parameters) and optimizer state held by this rank (its
        shards under tensor parallel and ZeRO)."""
        return state_bytes(self.model, self.optimizer)

    def peak_activation_bytes(self) -> int:
        """Peak device memory above the training state (CUDA's allocator; 0 on devices without a counter)."""
        if self.device.type != "cuda":
            return 0
        return max(0, int(torch.cuda.max_memory_allocated(self.device)) - self.state_bytes())

    def save_final(self) -> None:
        """Write the trained weights (unsplit names, CPU tensors) for ``fit`` to load into the user's model.

        Under ZeRO the shards are gathered (a collective on every rank). With a pipeline every rank holds a
        part: the parts are gathered on rank 0 and written into a copy of the initial model (under the unsplit
        names), so the file is the whole model's state dict.
        """
        state = full_tensors(trainable_state_dict(self.model))
        mine: dict[str, torch.Tensor] | None = {k: v.detach().cpu() for k, v in state.items()}
        if self.pipeline is not None:
            mine = gather_pipeline_weights(mine or {}, self.job, self.env.world_size, self.mesh.host_group)
        elif self.rank != 0:
            return
        if mine is not None:
            write_final(self.job, mine)


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of ``model``'s trainable parameters, as many for their gradients, and ``optimizer``'s state (the
    local shards of DTensors)."""
    params = sum(local(p).numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    opt = sum(
        local(t).numel() * t.element_size() for st in optimizer.state.values() for t in st.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )
    return 2 * params + opt


def gather_pipeline_weights(mine: dict[str, torch.Tensor], job: FitJob, world: int,
                            group: Any) -> dict[str, torch.Tensor] | None:
    """The whole model's trained weights, from every pipeline rank's part (``mine``: unsplit names, CPU), on rank 0
    of ``group`` (a collective over ``group``; None elsewhere): the parts written into a copy of the initial model."""
    rank = dist.get_rank(group)
    parts: list[Any] = [None] * world if rank == 0 else []
    dist.gather_object(mine, parts if rank == 0 else None, dst=dist.get_global_rank(group, 0), group=group)
    if rank != 0:
        return None
    full = torch.load(job.model_path, map_location="cpu", weights_only=False)
    if job.weights_folder is not None:  # a skeleton: the untrained tensors (frozen base) from the files
        load_chunk_weights(full, {n: n for n, _ in full.named_parameters()}, job.weights_folder)
    named = dict(full.named_parameters())
    with torch.no_grad():
        for part in parts:
            for k, v in part.items():
                named[k].copy_(v)
    return {k: v.detach().cpu() for k, v in trainable_state_dict(full).items()}


def write_final(job: FitJob, state: dict[str, torch.Tensor]) -> None:
    """Write the trained weights ``fit`` loads into the user's model (atomically: a temporary file renamed)."""
    final = Path(job.run_dir) / FINAL_WEIGHTS
    tmp = final.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(final)


def training_parts(
    model: torch.nn.Module, job: FitJob,
    shard: Callable[[torch.optim.Optimizer], torch.optim.Optimizer] | None = None,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR, PackedDataset, DeterministicSampler]:
    """A rank's optimizer (``shard``: wraps it, e.g. ZeRO-1), schedule, packed data and sampler for ``model``."""
    optimizer = make_optimizer(model, job.lr, job.weight_decay, eps=job.adam_eps, kind=job.plan.train.optimizer)
    if shard is not None:
        optimizer = shard(optimizer)
    scheduler = make_schedule(optimizer, job.warmup_steps, job.max_steps, job.min_lr_ratio)
    labels = np.load(job.labels_path, mmap_mode="r") if job.labels_path is not None else None
    data = PackedDataset(np.load(job.tokens_path, mmap_mode="r"), job.seq_len, labels)
    return optimizer, scheduler, data, DeterministicSampler(len(data), seed=job.seed)


def resume(ctx: TrainContext, callbacks: CallbackList, path: Path | None, device: torch.device) -> None:
    """Restore the state of a fit from ``path`` (None: a fresh start): a callback's checkpoint, or a state file."""
    if path is None:
        return
    ctx.extra["resume_from"] = path
    if callbacks.on_resume(ctx, path):
        return
    if not path.is_file():
        raise ConfigError(
            f"resume_from={path}: no callback loaded it and it is not a state file. To fix: "
            "pass the checkpoint callback that wrote it, or a file saved from TrainContext.state_dict()."
        )
    ctx.load_state_dict(torch.load(path, map_location=device, weights_only=False))
