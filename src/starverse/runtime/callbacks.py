"""Hooks into ``Trainer.fit`` and the per-rank state they see.

The checkpoint, elastic, billing and metrics parts plug into training through :class:`Callback`
subclasses; they never patch the trainer. Every rank runs its own copy of each callback (callbacks are
pickled into the rank processes), so a callback that must act once checks ``ctx.rank == 0`` itself.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from starverse.errors import CheckpointError
from starverse.runtime.lora import trainable_state_dict

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from starverse.plan import Plan
    from starverse.runtime.data import PackedDataset

log = logging.getLogger(__name__)


@dataclass
class StepMetrics:
    """What the last optimizer step measured; identical on every rank after the step's exchange."""

    loss: float = float("nan")
    """Mean loss of the last step over the whole global batch (as one process would compute it)."""
    tokens_step: int = 0
    """Tokens in the last step's global batch (all ranks)."""
    tokens_total: int = 0
    """Tokens trained since step 0 (including steps before a resume)."""
    step_time_s: float = 0.0
    """Wall time of the last step on the slowest rank (compute + gradient exchange + optimizer)."""
    step_times_s: list[float] = field(default_factory=list)
    """Wall time of the last step on each rank, indexed by rank."""
    compute_times_s: list[float] = field(default_factory=list)
    """Forward+backward time of the last step on each rank (what rebalancing uses), indexed by rank."""
    shares: list[int] = field(default_factory=list)
    """Micro-batches per rank in the last step, indexed by rank."""
    micro_batch: int = 0
    """Sequences per micro-batch."""
    tokens_per_s: float = 0.0
    """Whole-job throughput of the last step (tokens_step / step_time_s)."""
    mfu: float | None = None
    """Model FLOPs utilisation of the last step against the (probed, else datasheet) peaks; None if unknown."""
    lr: float = 0.0
    """Learning rate used by the last step."""
    grad_norm: float = float("nan")
    """Global gradient norm before clipping."""

    def as_dict(self) -> dict[str, Any]:
        """A JSON-friendly copy (for logs and metrics exporters)."""
        return {k: (list(v) if isinstance(v, list) else v) for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class Notice:
    """A device of this rank is about to be taken back (a preemption notice)."""

    source: str
    """What raised it (``SIGTERM``, a file path, a URL, ``another rank``)."""
    received_at: float = field(default_factory=time.monotonic)
    """``time.monotonic()`` when it was seen (the grace period counts from here)."""
    detail: str = ""
    """What the source said (for the log)."""


@dataclass(frozen=True)
class CommittedCheckpoint:
    """The last checkpoint that is complete on disk (published on rank 0 by the checkpoint callback)."""

    step: int
    """Its step."""
    at_s: int
    """Unix time it was created."""
    seconds: float
    """How long its write took."""
    path: str
    """Its ``step-N`` folder."""
    reason: str
    """``interval``, ``final``, ``notice``..."""


@dataclass
class TrainContext:
    """One per rank process: everything a callback may read, and the two things it may do.

    A callback may call :meth:`request_stop` (the trainer stops at the next step boundary, all ranks
    together) and may save/restore :meth:`state_dict` (what a checkpoint must hold to resume exactly).
    """

    rank: int
    """This process's rank in the job (0..world_size-1)."""
    world_size: int
    """Number of ranks in the job."""
    plan: Plan
    """The plan being run."""
    run_dir: Path
    """Directory of this run (checkpoints, ledgers and logs go below it); shared by all ranks."""
    step: int
    """Optimizer steps completed (after a resume: including those before it)."""
    model: torch.nn.Module
    """The model being trained (the plain module, never a wrapper: its state_dict keys are the user's)."""
    optimizer: torch.optim.Optimizer
    """The optimizer (AdamW)."""
    lr_scheduler: Any
    """The learning-rate scheduler (``torch.optim.lr_scheduler.LRScheduler``)."""
    sampler: Any
    """The data sampler; has ``state_dict()``/``load_state_dict()`` (its position in the data)."""
    group: ProcessGroup | None
    """A gloo group over all ranks, for host-side coordination (checkpoints, votes); None when world_size is 1."""
    device_kind: str
    """Accelerator id of this rank's device (``cpu``, ``h100-80gb-sxm``, ...)."""
    metrics: StepMetrics = field(default_factory=StepMetrics)
    """Measurements of the last step."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """The torch device this rank computes on."""
    rank_kinds: list[str] = field(default_factory=list)
    """Accelerator id of every rank, indexed by rank."""
    max_steps: int = 0
    """The step at which ``fit`` ends unless stopped earlier."""
    stop_reason: str | None = None
    """Why a stop was requested on this rank (None: no request); the trainer agrees over all ranks."""
    shares: list[int] = field(default_factory=list)
    """Current micro-batches per rank (changed by rebalancing); saved in checkpoints."""
    notice: Notice | None = None
    """The preemption notice every rank agreed on (set by the preemption callback; None: none)."""
    grace_s: float = 30.0
    """Seconds between a notice and the loss of the device (the emergency checkpoint must fit in them)."""
    committed: CommittedCheckpoint | None = None
    """The last committed checkpoint (rank 0; set by the checkpoint callback, read by billing and metrics)."""
    takeover: bool = False
    """True on an in-place replica that takes over the job's callbacks from a lost leader (``runtime/ft.py``):
    the run goes on, it is not a restart (billing adopts the open leases)."""
    held_out_scorer: Callable[[PackedDataset], torch.Tensor] | None = None
    """How this rank scores held-out sequences where ``model`` cannot (pipeline stages: the trainer sets
    ``eval_pipeline.PipelineScorer``): ``[loss sum, labelled tokens]`` of its part, summed over all ranks by the
    evaluation. None: ``model`` scores a round-robin slice of the sequences."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free space for the user's own callbacks (Starverse's callbacks use the typed fields above)."""

    def request_stop(self, reason: str) -> None:
        """Ask the trainer to stop after the current step; every rank stops at the same step.

        Any rank may ask; the trainer exchanges the requests at each step boundary, so the decision is
        the same everywhere. ``on_fit_end`` then runs as usual.
        """
        if self.stop_reason is None:
            log.info("rank %d requests stop at step %d: %s", self.rank, self.step, reason)
            self.stop_reason = reason

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint saves to resume exactly: model, optimizer, lr_scheduler, sampler, step, rng, shares.

        ``rng`` is this rank's random state (torch CPU, CUDA if used, Python, numpy).
        """
        rng: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": np.random.get_state(),
        }
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {
            "model": trainable_state_dict(self.model),
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "sampler": self.sampler.state_dict() if self.sampler is not None else None,
            "step": self.step,
            "rng": rng,
            "shares": list(self.shares),
            "tokens_total": self.metrics.tokens_total,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (in place; the model/optimizer objects are kept).

        Shares are restored only when the world size is unchanged (a resume on fewer or more ranks
        starts again from the plan's shares).
        """
        # a LoRA state holds only the trainable tensors (the frozen base comes from the plan's model)
        missing, unexpected = self.model.load_state_dict(sd["model"], strict=False)
        lost = set(missing) & set(trainable_state_dict(self.model))
        if unexpected or lost:
            raise CheckpointError(
                f"the saved model state does not fit this model ({len(lost)} trainable tensor(s) missing, "
                f"{len(unexpected)} unknown; e.g. {sorted(lost or unexpected)[0]}). To fix: resume with the model "
                "and train.mode the state was saved with."
            )
        self.optimizer.load_state_dict(sd["optimizer"])
        if self.lr_scheduler is not None and sd.get("lr_scheduler") is not None:
            self.lr_scheduler.load_state_dict(sd["lr_scheduler"])
        if self.sampler is not None and sd.get("sampler") is not None:
            self.sampler.load_state_dict(sd["sampler"])
        self.step = int(sd["step"])
        self.metrics.tokens_total = int(sd.get("tokens_total", 0))
        rng = sd.get("rng") or {}
        if "torch" in rng:
            torch.set_rng_state(torch.as_tensor(rng["torch"], dtype=torch.uint8))
        if "python" in rng:
            random.setstate(_as_python_rng_state(rng["python"]))
        if "numpy" in rng:
            np.random.set_state(rng["numpy"])
        if "cuda" in rng and self.device.type == "cuda":
            torch.cuda.set_rng_state(torch.as_tensor(rng["cuda"], dtype=torch.uint8), self.device)
        shares = list(sd.get("shares") or [])
        if len(shares) == len(self.shares) and sum(shares) == sum(self.shares or shares):
            self.shares = [int(s) for s in shares]


def _as_python_rng_state(state: Any) -> tuple[Any, ...]:
    """``random.setstate`` needs tuples; a state that went through a serializer may come back as lists."""
    version, internal, gauss = state
    return (version, tuple(internal), gauss)


class Callback:
    """Base class with no-op hooks; subclasses override what they need.

    Hooks run on every rank, in the order the callbacks were given. An exception in a hook fails the
    rank (and so the job): a callback that may fail harmlessly catches its own errors.
    """

    def on_resume(self, ctx: TrainContext, path: Path) -> bool:
        """``fit(resume_from=path)``: load the saved state into ``ctx``; return True if this callback did.

        Called before ``on_fit_start`` on every callback until one returns True. When none does and
        ``path`` is a file, the trainer loads it itself as a ``torch.save`` of :meth:`TrainContext.state_dict`.
        """
        return False

    def on_fit_start(self, ctx: TrainContext) -> None:
        """After model, optimizer and sampler exist (and after a resume was loaded), before step 1."""

    def on_micro_batch_end(self, ctx: TrainContext, compute_s: float) -> None:
        """After the forward+backward of one micro-batch (``compute_s``: its time); inside the timed compute.

        Time spent here counts as compute time of this rank (the rebalancer sees it); meant for the
        test facility (:class:`starverse.testing.SlowRank`), not for bookkeeping.
        """

    def on_step_end(self, ctx: TrainContext) -> None:
        """After each optimizer step (``ctx.step`` already counts it, ``ctx.metrics`` describe it)."""

    def on_fit_end(self, ctx: TrainContext) -> None:
        """After the last step, also when stopping early (stop requested)."""


class CallbackList(Callback):
    """Several callbacks called in order."""

    def __init__(self, callbacks: list[Callback] | tuple[Callback, ...] = ()):
        self.callbacks = list(callbacks)

    def on_resume(self, ctx: TrainContext, path: Path) -> bool:
        """Offer the resume to each callback in order until one loads it."""
        return any(cb.on_resume(ctx, path) for cb in self.callbacks)

    def on_fit_start(self, ctx: TrainContext) -> None:
        """Call every callback's ``on_fit_start``."""
        for cb in self.callbacks:
            cb.on_fit_start(ctx)

    def on_micro_batch_end(self, ctx: TrainContext, compute_s: float) -> None:
        """Call every callback's ``on_micro_batch_end``."""
        for cb in self.callbacks:
            cb.on_micro_batch_end(ctx, compute_s)

    def on_step_end(self, ctx: TrainContext) -> None:
        """Call every callback's ``on_step_end``."""
        for cb in self.callbacks:
            cb.on_step_end(ctx)

    def on_fit_end(self, ctx: TrainContext) -> None:
        """Call every callback's ``on_fit_end``."""
        for cb in self.callbacks:
            cb.on_fit_end(ctx)
