"""``Trainer.fit``: train one model with heterogeneous data parallelism over the cluster's ranks.

The user's process prepares everything that must be identical on every rank (tokenised corpus, initial
weights, initial shares), then :func:`~starverse.runtime.launch.launch` starts one process per rank.
Each rank runs :func:`~starverse.runtime.rank_loop.train_rank` (a :class:`~starverse.runtime.rank_loop.RankTrainer`):
micro-batches of its share, gradients summed over the mixed mesh, AdamW with warm-up + cosine, clipping, a
per-step exchange of losses/times/stop votes, rebalancing of shares. Rank 0 writes the final weights, which are loaded back into the user's model, so ``model`` is
trained after ``fit`` returns, as with a single-process trainer.

What ``fit`` checks and writes before the ranks start is :mod:`~starverse.runtime.fit_inputs`, the recovery it
runs :mod:`~starverse.runtime.recovery`, what it returns :mod:`~starverse.runtime.fit_result` (their names that
other modules import from here are re-exported).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from starverse.errors import ConfigError
from starverse.runtime.callbacks import Callback
from starverse.runtime.cluster import Cluster, accelerate, estimate_or_none
from starverse.runtime.data import HFTokenizer
from starverse.runtime.export import FINAL_WEIGHTS, record_model
from starverse.runtime.fit_inputs import check_runs, initial_shares, max_positions, prepare_data
from starverse.runtime.fit_result import FitResult, RankSummary, peak_tflops, summarise
from starverse.runtime.launch import Launcher, RecoveringLauncher, launch, resolve_launcher
from starverse.runtime.lora import apply_mode
from starverse.runtime.parallel.parallelize import check_parallel_plan
from starverse.runtime.parallel.pipeline_layout import PipelineLayout
from starverse.runtime.parallel.pipeline_parallel import check_pipeline_parallel
from starverse.runtime.parallel.pipeline_report import pipeline_report
from starverse.runtime.parallel.pipeline_split import as_module
from starverse.runtime.parallel.pipeline_weights import skeleton, unchanged_weights_folder
from starverse.runtime.plan_check import check_model, check_ranks
from starverse.runtime.rank_loop import FitJob, train_rank
from starverse.runtime.recovery import (
    RECOVERY_MODES,
    fill_lost,
    inplace_refusal,
    inplace_supported,
    recovery_for,
    tag_replicas,
)
from starverse.runtime.runlog import ProgressCallback, RunLogCallback
from starverse.runtime.steps import LossFn, flops_per_token

log = logging.getLogger(__name__)

__all__ = [  # the trainer, and the names other modules and tests import from this path
    "RECOVERY_MODES",
    "FitResult",
    "RankSummary",
    "Trainer",
    "_fill_lost",
    "_recovery_for",
    "inplace_refusal",
    "inplace_supported",
    "tag_replicas",
]

_recovery_for = recovery_for
_fill_lost = fill_lost


@dataclass
class Trainer:
    """Trains a model on a :class:`~starverse.runtime.cluster.Cluster` (see ``fit``)."""

    cluster: Cluster | None = None
    """Where to train (None: ``starverse.accelerate()`` on the local devices)."""
    callbacks: Sequence[Callback] = ()
    """Hooks run on every rank (checkpoints, metrics, billing, progress); must be picklable."""
    run_dir: str | Path | None = None
    """Directory of this run (None: ``runs/<UTC time>`` under the current directory)."""
    lr: float = 3e-4
    """Peak learning rate of AdamW."""
    warmup_steps: int | None = None
    """Linear warm-up steps (None: 5 % of max_steps, at least 1)."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at this fraction of ``lr``."""
    weight_decay: float = 0.1
    """AdamW weight decay (not applied to biases and norms)."""
    adam_eps: float = 1e-8
    """AdamW's epsilon (transformers' ``adam_epsilon``): added to the root of the second moment, it bounds the
    update of a parameter whose gradients are tiny."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0: no clipping)."""
    rebalance_every: int = 10
    """Consider new shares every this many steps from measured step times (0: keep the initial shares)."""
    hysteresis: float = 0.05
    """Adopt new shares only if predicted this fraction faster."""
    seed: int = 0
    """Seed of data order and any randomness in the model."""
    timeout_s: float = 24 * 3600.0
    """The whole fit must end within this (all ranks are stopped after it)."""
    collective_timeout_s: float = 120.0
    """Timeout of every collective: a dead peer fails the step after at most this long."""
    launcher: str | Launcher = "local"
    """How ranks are started: ``"local"`` (spawned processes on this machine), ``"ray"`` (one Ray actor per
    rank; joins ``$RAY_ADDRESS`` if set, else a private single-node Ray) or a launcher object such as
    ``starverse.providers.ray.RayLauncher(address=...)``. See docs/ray.md."""
    eval_fraction: float = 0.0
    """Hold out this fraction of the data's sequences (the end of the corpus) and report its loss (0: none)."""
    eval_every: int = 0
    """Evaluate on the held-out split every this many steps (0: only at the end)."""
    progress: bool = True
    """Show progress on rank 0: a rich bar on a terminal, else a plain log line every ``log_every`` steps."""
    log_every: int = 10
    """Steps between plain progress lines."""
    tensorboard: bool = True
    """Write TensorBoard event files under ``RUN_DIR/tensorboard`` (``metrics.jsonl`` is always written)."""
    recovery: str = "restart"
    """What survives a lost rank: ``restart`` (the supervisor re-plans and resumes from a checkpoint) or
    ``in-place`` (torchft replicas keep training: ``runtime/ft.py``; needs a launcher with a Lighthouse such as
    ``starverse.elastic.inplace.InplaceLauncher``, and a data-parallel plan: else restart is used)."""

    def __post_init__(self) -> None:
        resolve_launcher(self.launcher)  # an unknown name or a missing Ray fails here, before data is prepared
        if self.lr <= 0:
            raise ConfigError(f"lr must be > 0 (got {self.lr}).")
        if not self.adam_eps > 0:
            raise ConfigError(f"adam_eps must be > 0 (got {self.adam_eps}).")
        if self.grad_clip < 0:
            raise ConfigError(f"grad_clip must be >= 0 (got {self.grad_clip}).")
        if self.rebalance_every < 0:
            raise ConfigError(f"rebalance_every must be >= 0 (got {self.rebalance_every}).")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError(f"eval_fraction must be in [0, 1) (got {self.eval_fraction}).")
        if self.eval_every < 0:
            raise ConfigError(f"eval_every must be >= 0 (got {self.eval_every}).")
        if self.recovery not in RECOVERY_MODES:
            raise ConfigError(f"recovery must be one of {', '.join(RECOVERY_MODES)} (got {self.recovery!r}).")

    def fit(
        self,
        model: torch.nn.Module | Sequence[torch.nn.Module],
        dataset: Any = None,
        per_device_batch_size: int = 1,
        max_steps: int = 100,
        seq_len: int | None = None,
        resume_from: Path | str | None = None,
        *,
        global_batch: int | None = None,
        shares: Sequence[int] | None = None,
        tokenizer: str | Any = "auto",
        loss_fn: LossFn | None = None,
        precision: str | None = None,
        max_corpus_bytes: int | None = None,
    ) -> FitResult:
        """Train ``model`` on ``dataset`` for ``max_steps`` optimizer steps; returns the summary.

        ``per_device_batch_size``: sequences per micro-batch. ``global_batch``: sequences per step (None: the
        plan's ``train.global_batch``). ``shares``: initial micro-batches per rank (None: from the plan's
        ``batch_share`` or device speed). ``seq_len``: None takes the plan's. ``tokenizer``: ``bpe``,
        ``bytes``, a model folder / tokenizer.json / transformers tokenizer, or ``auto`` (the model folder's own
        tokenizer when it has one, else bpe sized to the model's vocabulary). The plan's ``train.mode`` lora /
        qlora puts adapters on ``model`` first (in place). ``precision``: None takes the plan's
        (bf16 autocast where the device supports it). ``resume_from``: see ``Callback.on_resume``.
        ``model`` may be a list of blocks (or an ``nn.Sequential``: the first takes token ids, the last returns
        logits); a plan with pipeline stages splits it by the stages' ``layers``, as it splits the decoder blocks
        of a bundled family. The plan is checked against the ranks and the model first (see ``plan_check``).
        After ``fit`` the user's ``model`` holds the trained weights.
        """
        cluster = self.cluster or accelerate()
        plan = cluster.plan
        ranks = list(cluster.ranks)
        world = len(ranks)
        if isinstance(model, (list, tuple)):
            model = as_module(list(model))
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module or a list of blocks (got {type(model).__name__}).")
        check_ranks(plan, ranks, "the cluster's plan")
        check_model(plan, model, "the cluster's plan")
        layout = PipelineLayout.from_plan(plan)
        check_runs(plan, layout, loss_fn)
        if not any(p.requires_grad for p in model.parameters()):
            raise ConfigError(
                f"the model ({type(model).__name__}) has no trainable parameters. To fix: pass a model with "
                "parameters (requires_grad=True)."
            )
        if per_device_batch_size <= 0:
            raise ConfigError(f"per_device_batch_size must be > 0 (got {per_device_batch_size}).")
        if max_steps <= 0:
            raise ConfigError(f"max_steps must be > 0 (got {max_steps}).")
        seq_len = seq_len or plan.train.seq_len
        max_pos = max_positions(model)
        if max_pos is not None and seq_len > max_pos:
            raise ConfigError(f"seq_len {seq_len} exceeds the model's {max_pos} positions. To fix: lower seq_len.")
        gb = global_batch or plan.train.global_batch
        if gb % per_device_batch_size:
            raise ConfigError(
                f"global batch {gb} is not a multiple of per_device_batch_size {per_device_batch_size}. "
                "To fix: choose a batch size that divides it, or pass global_batch=."
            )
        num_micro = gb // per_device_batch_size
        init_shares = initial_shares(cluster, layout, num_micro, shares)
        if layout.is_pipelined:
            check_pipeline_parallel(plan, self.rebalance_every, init_shares, model, seq_len=seq_len,
                                    rank_devices=[r.device for r in ranks])
        else:
            check_parallel_plan(plan, [r.device_kind for r in ranks], self.rebalance_every, init_shares, model,
                                [r.device for r in ranks])

        run_dir = Path(self.run_dir) if self.run_dir else Path("runs") / datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
        run_dir = run_dir.resolve()
        (run_dir / "data").mkdir(parents=True, exist_ok=True)

        lora = apply_mode(model, plan.train.mode, plan.train.lora_rank, [r.device for r in ranks])
        prec = precision or plan.train.precision
        data = prepare_data(
            run_dir, model, dataset, tokenizer, seq_len=seq_len, global_batch=gb, eval_fraction=self.eval_fraction,
            eval_every=self.eval_every, micro_batch=per_device_batch_size, precision=prec,
            max_corpus_bytes=max_corpus_bytes,
        )
        callbacks: list[Callback] = [data.eval_callback] if data.eval_callback is not None else []
        callbacks += [*self.callbacks, RunLogCallback(self.tensorboard)]
        if self.progress:
            callbacks.append(ProgressCallback(self.log_every))
        if loss_fn is not None and data.labels_path is not None:
            raise ConfigError("loss_fn= cannot be combined with masked labels (chat data: the loss is over the "
                              "labelled tokens). To fix: drop loss_fn, or train on plain text.")
        corpus = data.corpus
        record_model(run_dir, model, tokenizer=data.tokenizer.tok if isinstance(data.tokenizer, HFTokenizer) else None,
                     bpe_file=corpus.tokenizer[4:] if corpus.tokenizer.startswith("bpe:") else None,
                     lora=lora, mode=plan.train.mode)
        model_path = run_dir / "data" / "init_model.pt"
        # a pipeline's ranks read only their stage's tensors from the folder when the model still holds its weights
        weights = unchanged_weights_folder(model) if layout.is_pipelined else None
        torch.save(skeleton(model, weights) if weights is not None else model, model_path)

        job = FitJob(
            plan=plan, run_dir=run_dir, model_path=model_path, tokens_path=data.tokens_path, seq_len=seq_len,
            micro_batch=per_device_batch_size, global_batch=gb, shares=tuple(init_shares), max_steps=max_steps,
            lr=self.lr, warmup_steps=self.warmup_steps if self.warmup_steps is not None else max(1, max_steps // 20),
            min_lr_ratio=self.min_lr_ratio, weight_decay=self.weight_decay, adam_eps=self.adam_eps,
            grad_clip=self.grad_clip,
            seed=self.seed, rebalance_every=self.rebalance_every, hysteresis=self.hysteresis, precision=prec,
            callbacks=tuple(callbacks), loss_fn=loss_fn, labels_path=data.labels_path, weights_folder=weights,
            resume_from=Path(resume_from).resolve() if resume_from is not None else None,
            peaks_tflops=tuple(peak_tflops(r.device_kind, prec, r.device) for r in ranks),
            flops_per_token=flops_per_token(model, seq_len),
            recovery=recovery_for(self.recovery, plan),
        )
        log.info(
            "fit: %d ranks, global batch %d = %d micro-batches of %d, shares %s, %d steps, seq_len %d",
            world, gb, num_micro, per_device_batch_size, init_shares, max_steps, seq_len,
        )
        if job.recovery == "in-place" and (layout.is_pipelined or plan.train.zero_stage):
            ranks = tag_replicas(ranks, plan, layout)
        launcher = self.launcher
        if job.recovery != self.recovery and isinstance(launcher, RecoveringLauncher):
            launcher = launcher.restart_launcher()  # the plan runs as one job (one world), with checkpoint-restart
        results = launch(
            train_rank, ranks, timeout_s=self.timeout_s, args=(job,), collective_timeout_s=self.collective_timeout_s,
            launcher=launcher,
        )
        results = fill_lost(results)
        final = run_dir / FINAL_WEIGHTS
        if final.is_file():  # adapters only for LoRA (the frozen base is unchanged)
            model.load_state_dict(torch.load(final, map_location="cpu", weights_only=True), strict=lora is None)
        report = None
        if layout.is_pipelined:
            est = cluster.estimate if cluster.estimate is not None else estimate_or_none(plan)
            report = pipeline_report(layout, results, [r.device_kind for r in ranks], est)
        return summarise(results, job, ranks, report)
