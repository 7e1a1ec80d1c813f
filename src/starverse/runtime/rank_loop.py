"""One rank's training loop, split as torchtitan splits ``train.py``.

:class:`RankTrainer` holds a rank's parts as typed attributes (mesh, model, optimizer, schedule, data,
gradient sync, rebalancer, callbacks) and runs them in three layers:

- :meth:`RankTrainer.forward_backward_step`: the forward and backward of this rank's micro-batches (the
  seam a pipeline schedule replaces);
- :meth:`RankTrainer.train_step`: one optimizer step: forward/backward, gradient sum over the mixed mesh,
  clipping, AdamW and the schedule, then the per-step exchange of losses and times;
- :meth:`RankTrainer.train`: the loop: steps, metrics, rebalancing, callbacks, the agreed stop, the result.

:meth:`RankTrainer.prepare_model` is where the model is made ready for this rank (moved to its device today;
tensor parallelism, FSDP and recompute from ``runtime/parallel`` plug in there).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from starverse.errors import ConfigError, TrainingDivergedError
from starverse.plan import Plan
from starverse.runtime.callbacks import Callback, CallbackList, TrainContext
from starverse.runtime.data import DeterministicSampler, PackedDataset
from starverse.runtime.eval_pipeline import PipelineScorer
from starverse.runtime.export import FINAL_WEIGHTS
from starverse.runtime.hetero_dp import GradientSync, HolderSync, Rebalancer, local
from starverse.runtime.launch import RankEnv
from starverse.runtime.lora import trainable_state_dict
from starverse.runtime.mesh import MixedMesh
from starverse.runtime.parallel.fsdp import ZeroModel
from starverse.runtime.parallel.parallelize import ParallelModel, full_tensors, parallelize_for_plan
from starverse.runtime.parallel.pipeline import (
    PipelineRunner,
    UnsplitSignature,
    UnsplitView,
    micro_batch_count_error,
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
from starverse.runtime.steps import LossFn, autocast_dtype, batch_loss, make_optimizer, make_schedule


@dataclass(frozen=True)
class FitJob:
    """Everything a rank needs (pickled into the rank processes)."""

    plan: Plan
    """The plan every rank runs."""
    run_dir: Path
    """The run directory (shared by all ranks)."""
    model_path: Path
    """``torch.save`` of the user's initial model."""
    tokens_path: Path
    """The packed token array (``np.save``)."""
    seq_len: int
    """Tokens per sequence."""
    micro_batch: int
    """Sequences per micro-batch."""
    global_batch: int
    """Sequences per optimizer step."""
    shares: tuple[int, ...]
    """Initial micro-batches per data-parallel replica (one replica per rank without pipelines)."""
    max_steps: int
    """Steps at which the fit ends."""
    lr: float
    """Peak learning rate."""
    warmup_steps: int
    """Linear warm-up steps."""
    min_lr_ratio: float
    """Cosine decay floor as a fraction of ``lr``."""
    weight_decay: float
    """AdamW weight decay."""
    grad_clip: float
    """Global gradient-norm clip (0: none)."""
    seed: int
    """Seed of data order and model randomness."""
    rebalance_every: int
    """Consider new shares every this many steps (0: never)."""
    hysteresis: float
    """Adopt new shares only if predicted this fraction faster."""
    precision: str
    """Training precision (autocast choice per device)."""
    callbacks: tuple[Callback, ...]
    """Hooks run on every rank."""
    loss_fn: LossFn | None
    """The user's loss (None: the model's own / shifted cross-entropy)."""
    resume_from: Path | None
    """A checkpoint to resume from."""
    peaks_tflops: tuple[float | None, ...]
    """Peak TFLOPS of each rank (None: unknown)."""
    flops_per_token: float
    """Training FLOPs per token of the model."""
    bucket_mb: float = 25.0
    """Gradient all-reduce bucket size."""
    labels_path: Path | None = None
    """Per-token labels (``np.save``; -100 = no loss, e.g. a chat prompt); None: the tokens shifted."""
    weights_folder: Path | None = None
    """With a pipeline: ``model_path`` is a skeleton whose meta parameters each rank reads for its stage only
    from this folder's safetensors (see ``parallel.pipeline_weights``); None: ``model_path`` is the whole model."""
    recovery: str = "restart"
    """``restart`` (checkpoint-restart by the supervisor) or ``in-place`` (torchft replicas: ``runtime/ft.py``)."""


@dataclass(frozen=True)
class RankResult:
    """What one rank reports back to ``Trainer.fit`` at the end of its loop."""

    step: int
    """Optimizer steps completed (including before a resume)."""
    losses: tuple[float, ...]
    """Loss of every step of this fit (identical on every rank)."""
    tokens_total: int
    """Tokens trained in total (including before a resume)."""
    wall_s: float
    """Wall time of this rank's loop."""
    step_times: tuple[float, ...]
    """Wall time of every step (slowest rank)."""
    shares_history: tuple[tuple[int, tuple[int, ...]], ...]
    """``(step, shares)`` at the start and at every change of shares."""
    stop_reason: str | None
    """Why training stopped early (None: reached max_steps)."""
    tokens: int
    """Tokens this rank processed."""
    compute_s: float
    """This rank's forward+backward time."""
    share: int
    """This rank's micro-batches per step at the end (its replica's share)."""
    pipeline_step_s: float = 0.0
    """Mean wall time of this rank's pipeline schedule per step (0 without a pipeline)."""
    pipeline_busy_s: float = 0.0
    """Mean time per step this rank computed inside its pipeline (forwards and backwards)."""
    num_chunk_runs: int = 0
    """Chunk forwards per step on this rank (micro-batches × chunks; 0 without a pipeline)."""
    state_bytes: int = 0
    """Bytes of parameters, gradients and optimizer state on this rank at the end."""
    peak_activation_bytes: int = 0
    """Peak device memory above the training state (CUDA only; 0 where unmeasured)."""
    loaded_tensors: int = 0
    """Tensors this rank read from the model folder for its stage (per-stage loading; 0 otherwise)."""


@dataclass(frozen=True)
class StepTimes:
    """What one rank measured in one step, before the exchange."""

    loss_part: float
    """This rank's part of the step's mean loss (already weighted by its samples)."""
    compute_s: float
    """Forward+backward time, without time blocked in collectives."""
    wall_s: float
    """The whole step on this rank."""


@dataclass
class _Timer:
    device: torch.device

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


@dataclass
class RankTrainer:
    """One rank's parts and its loop (built inside the rank process by :meth:`build`)."""

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
    def build(cls, env: RankEnv, job: FitJob) -> RankTrainer:
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
                pipeline_groups(layout, kinds, devices), job.weights_folder,
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
        _resume(ctx, callbacks, job.resume_from, device)
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
        return [batch_idx[start + k * mb : start + (k + 1) * mb] for k in range(shares[self.replica])]

    def forward_backward_step(self, micro_batches: Sequence[np.ndarray], num_targets: int | None) -> torch.Tensor:
        """Forward and backward of this rank's micro-batches; gradients accumulate in ``.grad``.

        Each micro-batch's mean loss is scaled by ``micro_batch / global_batch`` so gradients summed over
        ranks are those of the global batch's mean loss; with masked labels the loss is already this
        micro-batch's part of the mean over the global batch's ``num_targets`` labelled tokens. Returns this
        rank's part of that mean (float64). With a pipeline, the schedule runs them through the replica's
        stages (the last stage's part is the loss; other stages return 0).
        """
        if self.pipeline is not None:
            rows = np.concatenate(micro_batches)
            y = self.data.batch_labels(rows)
            part = self.pipeline.step(torch.from_numpy(self.data.batch(rows)), len(micro_batches),
                                      None if y is None else torch.from_numpy(y), num_targets)
            self.pipeline_times.append((self.pipeline.times.step_s, self.pipeline.times.busy_s))
            return torch.tensor(part, dtype=torch.float64)
        scale = self.job.micro_batch / self.job.global_batch
        loss_sum = torch.zeros((), dtype=torch.float64)
        for k, idx in enumerate(micro_batches):
            tm, blocked0 = self.timer.now(), self.grads.blocked_s
            if isinstance(self.grads, ParallelModel):
                self.grads.before_micro_batch(k, len(micro_batches))
            x = torch.from_numpy(self.data.batch(idx)).to(self.device)
            y = self.data.batch_labels(idx)
            with torch.autocast(self.device.type, dtype=self.amp, enabled=self.amp is not None):
                loss = batch_loss(self.model, x, self.job.loss_fn,
                                  None if y is None else torch.from_numpy(y).to(self.device), num_targets)
            if k == len(micro_batches) - 1:
                self.grads.arm()  # the last backward: overlap the gradient all-reduce with it
            weight = scale if y is None else 1.0
            (loss * weight).backward()
            loss_sum += loss.detach().double().cpu() * weight
            self.callbacks.on_micro_batch_end(self.ctx, self.timer.now() - tm - (self.grads.blocked_s - blocked0))
        return loss_sum

    def train_step(self) -> tuple[list[StepTimes], float, float]:
        """One optimizer step; returns every rank's :class:`StepTimes`, the gradient norm and the lr used."""
        t0 = self.timer.now()
        batch_idx = self.sampler.next_indices(self.job.global_batch)
        num_targets = self.data.num_targets(batch_idx) if self.data.labels is not None else None
        self.grads.blocked_s = 0.0  # time waiting for peers is not this device's compute (see GradientSync)
        loss_part = self.forward_backward_step(self.my_micro_batches(batch_idx), num_targets)
        if self.layout.places[self.rank].tp_rank:
            loss_part = loss_part * 0.0  # a TP group computes its replica's loss once per rank: count it once
        clip = self.job.grad_clip
        if isinstance(self.grads, HolderSync):
            compute_s = self.timer.now() - t0
            self.grads.all_reduce()
            norm = self.grads.clip_grad_norm_(clip)
        else:
            compute_s = self.timer.now() - t0 - self.grads.blocked_s
            self.grads.finish()
            if isinstance(self.grads, ParallelModel):
                norm = self.grads.clip_grad_norm_(clip)
            else:
                params = [p for p in self.model.parameters() if p.requires_grad]
                norm = torch.nn.utils.clip_grad_norm_(params, clip) if clip > 0 else _grad_norm(params)
        lr = float(self.optimizer.param_groups[0]["lr"])
        if not (math.isfinite(float(loss_part)) and math.isfinite(float(norm))):
            # no update from a non-finite loss or gradient; the NaN loss part reaches every rank in the
            # exchange, so all of them stop at this step (see train)
            return self.exchange(StepTimes(math.nan, compute_s, self.timer.now() - t0)), float(norm), lr
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        mine = StepTimes(float(loss_part), compute_s, self.timer.now() - t0)
        return self.exchange(mine), float(norm), lr

    def exchange(self, mine: StepTimes) -> list[StepTimes]:
        """One small host-side exchange per step: every rank learns every rank's loss part and times."""
        t = torch.tensor([mine.loss_part, mine.compute_s, mine.wall_s], dtype=torch.float64)
        if self.env.world_size == 1:
            return [mine]
        gathered = [torch.zeros(3, dtype=torch.float64) for _ in range(self.env.world_size)]
        dist.all_gather(gathered, t, group=self.mesh.host_group)
        return [StepTimes(float(g[0]), float(g[1]), float(g[2])) for g in gathered]

    def record_step(self, times: list[StepTimes], grad_norm: float, lr: float) -> None:
        """Count the step and fill ``ctx.metrics`` (identical on every rank)."""
        job, ctx = self.job, self.ctx
        compute_times = [t.compute_s for t in times]
        step_times_r = [t.wall_s for t in times]
        ctx.step += 1
        self.tokens += ctx.shares[self.replica] * job.micro_batch * job.seq_len
        self.compute_s += times[self.rank].compute_s
        m = ctx.metrics
        m.loss = float(sum(t.loss_part for t in times))
        m.tokens_step = job.global_batch * job.seq_len
        m.tokens_total += m.tokens_step
        m.step_time_s = max(step_times_r)
        m.step_times_s = step_times_r
        m.compute_times_s = compute_times
        m.shares = [ctx.shares[self.layout.replica_of(r)] for r in range(self.env.world_size)]
        m.tokens_per_s = m.tokens_step / m.step_time_s if m.step_time_s > 0 else 0.0
        m.mfu = step_mfu(job, m.step_time_s)
        m.lr = lr
        m.grad_norm = grad_norm
        self.losses.append(m.loss)
        self.step_times.append(m.step_time_s)

    def rebalance(self) -> list[int] | None:
        """Feed the step's compute times to the rebalancer; new shares when it proposes them.

        A replica's time is its slowest rank's (a pipeline's stages all wait for the slowest). Shares a
        replica's schedule cannot run (interleaved rounds) are not adopted.
        """
        times = [
            max(self.ctx.metrics.compute_times_s[r] for r in ranks) for ranks in self.layout.replica_ranks
        ]
        self.rebalancer.observe(self.ctx.shares, times)
        new = self.rebalancer.propose(self.ctx.step, self.ctx.shares)
        if new is None:
            return None
        schedule = self.job.plan.train.schedule
        for g, n in zip(self.layout.replica_group, new, strict=True):
            if micro_batch_count_error(schedule, self.layout.num_stages(g), n) is not None:
                return None
        return new

    def train(self) -> RankResult:
        """The loop: steps until ``max_steps`` or an agreed stop; rank 0 writes the final weights."""
        ctx = self.ctx
        t_loop = time.perf_counter()
        while ctx.step < self.job.max_steps:
            times, norm, lr = self.train_step()
            self.record_step(times, norm, lr)
            if not math.isfinite(ctx.metrics.loss):
                # before the step's callbacks: no checkpoint of this step, none of NaN weights marked ok
                raise TrainingDivergedError(
                    f"step {ctx.step}: the loss is not finite (gradient norm {norm:.3g} on rank {self.rank}); "
                    "training stopped before applying the step, and the checkpoints written so far are kept. "
                    "To fix: lower train.lr (or the schedule's peak), then resume from the last checkpoint")
            new = self.rebalance()
            self.callbacks.on_step_end(ctx)
            if new is not None:
                ctx.shares = new
                self.shares_history.append((ctx.step, tuple(new)))
            if agree_to_stop(ctx, self.mesh.host_group, self.env.world_size):
                break
        wall = time.perf_counter() - t_loop
        self.callbacks.on_fit_end(ctx)
        if self.rank == 0 or self.pipeline is not None or isinstance(self.grads, ParallelModel):
            self.save_final()
        return RankResult(
            step=ctx.step, losses=tuple(self.losses), tokens_total=ctx.metrics.tokens_total, wall_s=wall,
            step_times=tuple(self.step_times), shares_history=tuple(self.shares_history),
            stop_reason=ctx.stop_reason, tokens=self.tokens, compute_s=self.compute_s,
            share=ctx.shares[self.replica], **self.pipeline_figures(), state_bytes=self.state_bytes(),
            peak_activation_bytes=self.peak_activation_bytes(),
            loaded_tensors=sum(c.loaded_tensors for c in self.pipeline.chunks) if self.pipeline else 0,
        )

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
        params = sum(local(p).numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)
        opt = sum(
            local(t).numel() * t.element_size() for st in self.optimizer.state.values() for t in st.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        )
        return 2 * params + opt

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
        mine = {k: v.detach().cpu() for k, v in state.items()}
        if self.pipeline is not None:
            parts: list[Any] = [None] * self.env.world_size if self.rank == 0 else []
            dist.gather_object(mine, parts if self.rank == 0 else None, dst=0, group=self.mesh.host_group)
            if self.rank != 0:
                return
            full = torch.load(self.job.model_path, map_location="cpu", weights_only=False)
            if self.job.weights_folder is not None:  # a skeleton: the untrained tensors (frozen base) from the files
                load_chunk_weights(full, {n: n for n, _ in full.named_parameters()}, self.job.weights_folder)
            named = dict(full.named_parameters())
            with torch.no_grad():
                for part in parts:
                    for k, v in part.items():
                        named[k].copy_(v)
            mine = {k: v.detach().cpu() for k, v in trainable_state_dict(full).items()}
        elif self.rank != 0:
            return
        final = self.job.run_dir / FINAL_WEIGHTS
        tmp = final.with_suffix(".tmp")
        torch.save(mine, tmp)
        tmp.replace(final)


def training_parts(
    model: torch.nn.Module, job: FitJob,
    shard: Callable[[torch.optim.Optimizer], torch.optim.Optimizer] | None = None,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR, PackedDataset, DeterministicSampler]:
    """A rank's optimizer (``shard``: wraps it, e.g. ZeRO-1), schedule, packed data and sampler for ``model``."""
    optimizer = make_optimizer(model, job.lr, job.weight_decay)
    if shard is not None:
        optimizer = shard(optimizer)
    scheduler = make_schedule(optimizer, job.warmup_steps, job.max_steps, job.min_lr_ratio)
    labels = np.load(job.labels_path, mmap_mode="r") if job.labels_path is not None else None
    data = PackedDataset(np.load(job.tokens_path, mmap_mode="r"), job.seq_len, labels)
    return optimizer, scheduler, data, DeterministicSampler(len(data), seed=job.seed)


def train_rank(env: RankEnv, job: FitJob) -> RankResult | None:
    """The launched function: build this rank's parts and run its loop (``recovery: in-place``: a torchft
    replica's loop, :func:`starverse.runtime.ft.train_replica`)."""
    if job.recovery == "in-place":
        from starverse.runtime.ft import train_replica

        return train_replica(env, job)  # None: a replacement that found no one to join
    return RankTrainer.build(env, job).train()


def _resume(ctx: TrainContext, callbacks: CallbackList, path: Path | None, device: torch.device) -> None:
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


def _grad_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    norms = [p.grad.detach().norm() for p in params if p.grad is not None]
    return torch.stack(norms).norm() if norms else torch.zeros(())


def step_mfu(job: FitJob, step_s: float) -> float | None:
    """Whole-job MFU of one step against the sum of the ranks' peaks (None if a peak is unknown)."""
    if any(p is None for p in job.peaks_tflops) or step_s <= 0:
        return None
    flops = job.global_batch * job.seq_len * job.flops_per_token
    return flops / step_s / (sum(p for p in job.peaks_tflops if p) * 1e12)


def agree_to_stop(ctx: TrainContext, group: Any, world: int) -> bool:
    """All ranks stop together if any asked; the reason of the lowest asking rank is adopted everywhere."""
    if world == 1:
        return ctx.stop_reason is not None
    vote = torch.tensor([0 if ctx.stop_reason is None else 1], dtype=torch.int64)
    dist.all_reduce(vote, group=group)
    if int(vote) == 0:
        return False
    if ctx.stop_reason is None:
        ctx.stop_reason = "stop requested by another rank"
    return True
