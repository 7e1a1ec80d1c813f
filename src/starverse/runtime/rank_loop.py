"""One rank's training loop, split as torchtitan splits ``train.py``.

:class:`RankTrainer` runs a rank's parts (:class:`~starverse.runtime.rank_parts.RankParts`: mesh, model,
optimizer, schedule, data, gradient sync, rebalancer, callbacks, as typed attributes) in three layers:

- :meth:`RankTrainer.forward_backward_step`: the forward and backward of this rank's micro-batches (the
  seam a pipeline schedule replaces);
- :meth:`RankTrainer.train_step`: one optimizer step: forward/backward, gradient sum over the mixed mesh,
  clipping, AdamW and the schedule, then the per-step exchange of losses and times;
- :meth:`RankTrainer.train`: the loop: steps, metrics, rebalancing, callbacks, the agreed stop, the result.

:meth:`RankParts.prepare_model` is where the model is made ready for this rank (moved to its device today;
tensor parallelism, FSDP and recompute from ``runtime/parallel`` plug in there).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from starverse.errors import TrainingDivergedError
from starverse.runtime.callbacks import TrainContext
from starverse.runtime.hetero_dp import HolderSync
from starverse.runtime.launch import RankEnv
from starverse.runtime.parallel.parallelize import ParallelModel
from starverse.runtime.parallel.pipeline import micro_batch_count_error
from starverse.runtime.rank_job import FitJob, RankResult, StepTimes
from starverse.runtime.rank_parts import RankParts, training_parts
from starverse.runtime.steps import batch_loss

__all__ = ["FitJob", "RankResult", "RankTrainer", "StepTimes", "agree_to_stop", "step_mfu", "train_rank",
           "training_parts"]
"""``FitJob``, ``RankResult`` and ``training_parts`` are also importable from here (``runtime/ft.py`` does)."""


@dataclass
class RankTrainer(RankParts):
    """One rank's loop over its parts: forward/backward, the optimizer step, the loop (built by :meth:`build`)."""

    def forward_backward_step(self, micro_batches: Sequence[np.ndarray], num_targets: int | None) -> torch.Tensor:
        """Forward and backward of this rank's micro-batches; gradients accumulate in ``.grad``.

        Each micro-batch's mean loss is scaled by its size over ``global_batch`` (``micro_batch / global_batch``,
        or a ZeRO-2/3 rank's uneven lockstep size) so gradients summed over ranks are those of the global batch's
        mean loss; with masked labels the loss is already this micro-batch's part of the mean over the global batch's ``num_targets`` labelled tokens. Returns this
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
            weight = len(idx) / self.job.global_batch if y is None else 1.0  # its sequences' share
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


def train_rank(env: RankEnv, job: FitJob) -> RankResult | None:
    """The launched function: build this rank's parts and run its loop (``recovery: in-place``: a torchft
    replica's loop, :func:`starverse.runtime.ft.train_replica`)."""
    if job.recovery == "in-place":
        from starverse.runtime.ft import train_replica

        return train_replica(env, job)  # None: a replacement that found no one to join
    return RankTrainer.build(env, job).train()


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
