"""What a rank is given and what it gives back: the job pickled into every rank process (:class:`FitJob`), each
rank's result at the end (:class:`RankResult`) and one step's measurements before the exchange
(:class:`StepTimes`). The parts are built in :mod:`.rank_parts`, the loop runs in :mod:`.rank_loop`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from starverse.plan import Plan
from starverse.runtime.callbacks import Callback
from starverse.runtime.steps import LossFn


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
    adam_eps: float
    """AdamW's epsilon (added to the root of the second moment)."""
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
