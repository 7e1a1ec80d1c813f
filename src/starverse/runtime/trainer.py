"""``Trainer.fit``: train one model with heterogeneous data parallelism over the cluster's ranks.

The user's process prepares everything that must be identical on every rank (tokenised corpus, initial
weights, initial shares), then :func:`~starverse.runtime.launch.launch` starts one process per rank.
Each rank runs :func:`~starverse.runtime.rank_loop.train_rank` (a :class:`~starverse.runtime.rank_loop.RankTrainer`):
micro-batches of its share, gradients summed over the mixed mesh, AdamW with warm-up + cosine, clipping, a
per-step exchange of losses/times/stop votes, rebalancing of shares. Rank 0 writes the final weights, which are loaded back into the user's model, so ``model`` is
trained after ``fit`` returns, as with a single-process trainer.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from starverse.errors import ConfigError, DistributedError
from starverse.plan import Plan
from starverse.runtime.callbacks import Callback
from starverse.runtime.data import (
    HFTokenizer,
    TokenizedCorpus,
    load_tokenizer,
    model_tokenizer,
    pack,
    tokenize_corpus,
)
from starverse.runtime.export import FINAL_WEIGHTS, record_model
from starverse.runtime.hetero_dp import proportional_shares
from starverse.runtime.launch import Launcher, RankSpec, RecoveringLauncher, launch, resolve_launcher
from starverse.runtime.lora import apply_mode
from starverse.runtime.parallel.parallelize import check_parallel_plan
from starverse.runtime.parallel.pipeline import (
    check_pipeline_loss_fn,
    micro_batch_count_error,
    min_micro_batches,
)
from starverse.runtime.parallel.pipeline_layout import PipelineLayout
from starverse.runtime.parallel.pipeline_parallel import check_pipeline_parallel
from starverse.runtime.parallel.pipeline_report import PipelineReport, pipeline_report
from starverse.runtime.parallel.pipeline_split import as_module
from starverse.runtime.parallel.pipeline_weights import skeleton, unchanged_weights_folder
from starverse.runtime.plan_check import check_model, check_ranks
from starverse.runtime.rank_loop import FitJob, RankResult, train_rank
from starverse.runtime.runlog import EVAL_FILE, EvalCallback, ProgressCallback, RunLogCallback
from starverse.runtime.steps import LossFn, config_int, flops_per_token

if TYPE_CHECKING:
    from starverse.runtime.cluster import Cluster

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankSummary:
    """What one rank did over the whole fit."""

    rank: int
    """The rank."""
    device_kind: str
    """Its accelerator id."""
    final_share: int
    """Micro-batches per step at the end."""
    tokens: int
    """Tokens this rank processed."""
    compute_s: float
    """Time spent in forward+backward."""
    tokens_per_s: float
    """Tokens per second of compute on this rank."""
    peak_tflops: float | None
    """The peak its MFU is measured against (probe profile, else datasheet); None if unknown."""
    mfu: float | None
    """Model FLOPs utilisation of its compute time (None without a peak)."""


@dataclass(frozen=True)
class FitResult:
    """The outcome of ``Trainer.fit``."""

    steps: int
    """Optimizer steps completed (including steps before a resume)."""
    final_loss: float
    """Mean loss of the last step over its global batch."""
    losses: tuple[float, ...]
    """Loss of every step of this fit, in order."""
    tokens_total: int
    """Tokens trained in total (including before a resume)."""
    wall_s: float
    """Wall time of the training loop (rank 0), without start-up."""
    tokens_per_s: float
    """Whole-job throughput over the steps of this fit, the first one excluded (start-up)."""
    mfu: float | None
    """Whole-job MFU: achieved model FLOP/s over the sum of the ranks' peaks (None if a peak is unknown)."""
    ranks: tuple[RankSummary, ...]
    """Per-rank summary."""
    shares_history: tuple[tuple[int, tuple[int, ...]], ...]
    """``(step, shares)`` at the start and at every change of shares."""
    micro_batch: int
    """Sequences per micro-batch."""
    global_batch: int
    """Sequences per optimizer step."""
    seq_len: int
    """Tokens per sequence."""
    stop_reason: str | None
    """Why training stopped early (None: reached max_steps)."""
    run_dir: Path
    """The run directory."""
    step_time_s: float
    """Median step time of this fit (first step excluded)."""
    step_times_s: tuple[float, ...] = ()
    """Wall time of every step of this fit (slowest rank), in order."""
    eval_loss: float | None = None
    """Mean token loss on the held-out split at the end (None: no held-out split, ``Trainer.eval_fraction``)."""
    eval_perplexity: float | None = None
    """``exp(eval_loss)``."""
    pipeline: PipelineReport | None = None
    """Per stage time per micro-batch, bubble and state bytes, beside the cost model's (None: no pipeline)."""

    def summary_lines(self) -> list[str]:
        """Human-readable summary (the CLI prints these)."""
        lines = [
            f"steps {self.steps}, final loss {self.final_loss:.4f}, {self.tokens_total:,} tokens, "
            f"{self.tokens_per_s:,.0f} tokens/s, step {self.step_time_s:.3f} s"
            + (f", MFU {self.mfu:.1%}" if self.mfu is not None else ", MFU n/a (no peak for a device kind)"),
        ]
        for r in self.ranks:
            mfu = f"{r.mfu:.1%} of {r.peak_tflops:.3g} TFLOPS" if r.mfu is not None and r.peak_tflops else "n/a"
            lines.append(
                f"  rank {r.rank} {r.device_kind}: share {r.final_share}/{self.global_batch // self.micro_batch} "
                f"micro-batches, {r.tokens_per_s:,.0f} tokens/s of compute, MFU {mfu}"
            )
        if len(self.shares_history) > 1:
            lines.append("  shares: " + " -> ".join(f"{list(s)}@{st}" for st, s in self.shares_history))
        if self.pipeline is not None:
            lines.extend(self.pipeline.summary_lines())
        if self.eval_loss is not None:
            lines.append(f"  held-out: loss {self.eval_loss:.4f}, perplexity {self.eval_perplexity:.2f}")
        if self.stop_reason:
            lines.append(f"  stopped early: {self.stop_reason}")
        return lines


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
    recovery: str = "restart"
    """What survives a lost rank: ``restart`` (the supervisor re-plans and resumes from a checkpoint) or
    ``in-place`` (torchft replicas keep training: ``runtime/ft.py``; needs a launcher with a Lighthouse such as
    ``starverse.elastic.inplace.InplaceLauncher``, and a data-parallel plan: else restart is used)."""
    """Write TensorBoard event files under ``RUN_DIR/tensorboard`` (``metrics.jsonl`` is always written)."""

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
        from starverse.runtime.cluster import accelerate, estimate_or_none

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
        _check_runs(plan, layout, loss_fn)
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
        max_pos = _max_positions(model)
        if max_pos is not None and seq_len > max_pos:
            raise ConfigError(f"seq_len {seq_len} exceeds the model's {max_pos} positions. To fix: lower seq_len.")
        gb = global_batch or plan.train.global_batch
        if gb % per_device_batch_size:
            raise ConfigError(
                f"global batch {gb} is not a multiple of per_device_batch_size {per_device_batch_size}. "
                "To fix: choose a batch size that divides it, or pass global_batch=."
            )
        num_micro = gb // per_device_batch_size
        init_shares = _initial_shares(cluster, layout, num_micro, shares)
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
        vocab = _vocab_size(model)
        tok = tokenizer
        if isinstance(tok, str) and tok == "auto":
            tok = model_tokenizer(model) or ("bpe" if vocab is None or vocab >= 512 else "bytes")
        hf_tok = tok if isinstance(tok, str) and tok in ("bpe", "bytes") else load_tokenizer(tok)
        corpus = tokenize_corpus(
            dataset, tokenizer=hf_tok, vocab_size=min(vocab or 8192, 8192), max_bytes=max_corpus_bytes
        )
        if vocab is not None and corpus.vocab_size > vocab:
            fix = ("use the tokenizer saved with the model (its folder), or a model whose vocab_size covers it"
                   if isinstance(hf_tok, HFTokenizer) else "build the model with a larger vocab_size or use tokenizer='bytes'")
            raise ConfigError(
                f"the tokenizer ({corpus.tokenizer}) has {corpus.vocab_size} token ids but the model's vocabulary "
                f"has {vocab}: they do not belong together. To fix: {fix}."
            )
        packed = pack(corpus, seq_len, min_sequences=gb)
        num_eval = math.ceil(len(packed) * self.eval_fraction) if self.eval_fraction else 0
        callbacks: list[Callback] = []
        if num_eval:
            packed, held_out = packed.split(num_eval)
            pack(TokenizedCorpus(packed.tokens, 0, 0, ""), seq_len, min_sequences=gb)  # still one step's worth
            np.save(run_dir / "data" / "eval_tokens.npy", held_out.tokens)
            callbacks.append(EvalCallback(
                run_dir / "data" / "eval_tokens.npy", seq_len, every=self.eval_every,
                micro_batch=per_device_batch_size, precision=precision or plan.train.precision,
                labels_path=_save_array(run_dir / "data" / "eval_labels.npy", held_out.labels),
            ))
        callbacks += [*self.callbacks, RunLogCallback(self.tensorboard)]
        if self.progress:
            callbacks.append(ProgressCallback(self.log_every))
        tokens_path = run_dir / "data" / "tokens.npy"
        np.save(tokens_path, packed.tokens)
        labels_path = _save_array(run_dir / "data" / "labels.npy", packed.labels)
        if loss_fn is not None and labels_path is not None:
            raise ConfigError("loss_fn= cannot be combined with masked labels (chat data: the loss is over the "
                              "labelled tokens). To fix: drop loss_fn, or train on plain text.")
        record_model(run_dir, model, tokenizer=hf_tok.tok if isinstance(hf_tok, HFTokenizer) else None,
                     bpe_file=corpus.tokenizer[4:] if corpus.tokenizer.startswith("bpe:") else None,
                     lora=lora, mode=plan.train.mode)
        model_path = run_dir / "data" / "init_model.pt"
        # a pipeline's ranks read only their stage's tensors from the folder when the model still holds its weights
        weights = unchanged_weights_folder(model) if layout.is_pipelined else None
        torch.save(skeleton(model, weights) if weights is not None else model, model_path)

        prec = precision or plan.train.precision
        job = FitJob(
            plan=plan, run_dir=run_dir, model_path=model_path, tokens_path=tokens_path, seq_len=seq_len,
            micro_batch=per_device_batch_size, global_batch=gb, shares=tuple(init_shares), max_steps=max_steps,
            lr=self.lr, warmup_steps=self.warmup_steps if self.warmup_steps is not None else max(1, max_steps // 20),
            min_lr_ratio=self.min_lr_ratio, weight_decay=self.weight_decay, adam_eps=self.adam_eps,
            grad_clip=self.grad_clip,
            seed=self.seed, rebalance_every=self.rebalance_every, hysteresis=self.hysteresis, precision=prec,
            callbacks=tuple(callbacks), loss_fn=loss_fn, labels_path=labels_path, weights_folder=weights,
            resume_from=Path(resume_from).resolve() if resume_from is not None else None,
            peaks_tflops=tuple(_peak_tflops(r.device_kind, prec, r.device) for r in ranks),
            flops_per_token=flops_per_token(model, seq_len),
            recovery=_recovery_for(self.recovery, plan),
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
        results = _fill_lost(results)
        final = run_dir / FINAL_WEIGHTS
        if final.is_file():  # adapters only for LoRA (the frozen base is unchanged)
            model.load_state_dict(torch.load(final, map_location="cpu", weights_only=True), strict=lora is None)
        report = None
        if layout.is_pipelined:
            est = cluster.estimate if cluster.estimate is not None else estimate_or_none(plan)
            report = pipeline_report(layout, results, [r.device_kind for r in ranks], est)
        return _summarise(results, job, ranks, report)


def _recovery_for(recovery: str, plan: Plan) -> str:
    """``recovery``, or ``restart`` with one logged line when in-place recovery does not run ``plan``."""
    refusal = inplace_refusal(plan) if recovery == "in-place" else None
    if refusal is None:
        return recovery
    log.warning("recovery: in-place recovers replicas of one rank, one pipeline or one ZeRO group each; this plan "
                "(%s) has %s, so it runs with checkpoint-restart", ", ".join(
                    f"{g.replicas} replica(s) of {g.devices_per_replica} {g.stages[0].accelerator}" for g in plan.groups),
                refusal)
    return "restart"


RECOVERY_MODES = ("restart", "in-place")
"""Values of ``Trainer.recovery`` (``recovery:`` in a job file)."""


def inplace_supported(plan: Plan) -> bool:
    """True if in-place recovery can run ``plan`` (see :func:`inplace_refusal`)."""
    return inplace_refusal(plan) is None


def inplace_refusal(plan: Plan) -> str | None:
    """Why in-place recovery cannot run ``plan`` (None: it can): every replica one rank holding the whole model,
    or one pipeline (a stage per rank, no TP, every replica cut alike, GPipe or 1F1B, no recompute: its stage
    chunks are not wrapped for it in place), or a sharded group (``ft_shard.shard_replica_error``); no offload."""
    t = plan.train
    if t.zero_stage:
        from starverse.runtime.ft_shard import shard_replica_error

        return shard_replica_error(plan)
    if t.offload != "none":
        return f"offload {t.offload} (sharded replicas are built without offload)"
    if all(g.devices_per_replica == 1 for g in plan.groups):
        return None
    from starverse.runtime.ft_pipe import pipeline_replica_error

    layout = PipelineLayout.from_plan(plan)
    if not layout.is_pipelined:
        return "replicas of several ranks without a pipeline"
    if t.recompute != "none":
        return f"recompute {t.recompute} inside a pipelined replica"
    return pipeline_replica_error(layout)


def tag_replicas(ranks: list[RankSpec], plan: Plan, layout: PipelineLayout) -> list[RankSpec]:
    """The ranks of an in-place run with replicas of several ranks (a pipeline; a ZeRO group), each told its
    replica (the launcher starts, loses and replaces a replica's ranks together: ``REPLICA_ENV``)."""
    from starverse.runtime.ft_group import REPLICA_ENV
    from starverse.runtime.ft_shard import shard_replicas

    replica = shard_replicas(plan) if plan.train.zero_stage else [p.replica for p in layout.places]
    return [dataclasses.replace(r, env=(*r.env, (REPLICA_ENV, str(replica[r.rank])))) for r in ranks]


def _fill_lost(results: list[Any]) -> list[RankResult]:
    """An in-place run's results with each rank lost for good (``None``) reported as having trained nothing."""
    done = [r for r in results if r is not None]
    if not done:  # every replica lost (a launcher that does not raise it itself): the supervisor restarts
        raise DistributedError("every replica of the in-place run was lost; nothing holds the live state")
    return [r if r is not None else dataclasses.replace(done[0], tokens=0, compute_s=0.0, share=0) for r in results]


def _save_array(path: Path, arr: np.ndarray | None) -> Path | None:
    if arr is None:
        return None
    np.save(path, arr)
    return path


def _max_positions(model: torch.nn.Module) -> int | None:
    return config_int(model, "max_position_embeddings", "n_positions", "max_seq_len")


def _vocab_size(model: torch.nn.Module) -> int | None:
    v = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(v, int):
        return v
    emb = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    return emb[0].num_embeddings if emb else None


def _check_runs(plan: Plan, layout: PipelineLayout, loss_fn: LossFn | None) -> None:
    """What this runtime does not run yet, refused rather than silently run as something else."""
    # tensor parallelism: checked by parallel.parallelize.check_parallel_plan (with the shares)
    if layout.is_pipelined and loss_fn is not None:
        check_pipeline_loss_fn(loss_fn)  # the last stage calls loss_fn(logits, labels)
    if layout.is_pipelined and plan.train.mode == "qlora":
        raise ConfigError(
            "the cluster's plan: train.mode: qlora is not run with pipeline stages yet (a stage is a copy of the "
            "model's part, and 4-bit weights are not copied). To fix: mode: lora, or one stage per group for QLoRA."
        )


def _initial_shares(
    cluster: Cluster, layout: PipelineLayout, num_micro: int, shares: Sequence[int] | None
) -> list[int]:
    """Micro-batches per data-parallel replica (per rank without pipelines) at the start."""
    schedule = cluster.plan.train.schedule
    low = [min_micro_batches(schedule, layout.num_stages(g)) for g in layout.replica_group]
    units = layout.num_replicas
    if shares is not None:
        shares = [int(s) for s in shares]
        what = "ranks" if not layout.is_pipelined else "pipeline replicas"
        if len(shares) != units or sum(shares) != num_micro or any(s < lo for s, lo in zip(shares, low, strict=True)):
            raise ConfigError(
                f"shares {shares} must give each of the {units} {what} >= {max(low)} micro-batch"
                f"{'es' if max(low) > 1 else ''} and sum to "
                f"{num_micro}."
            )
    elif units == len(cluster.ranks):  # one replica per rank: by the ranks' speed
        shares = proportional_shares(num_micro, cluster.rank_weights())
    else:
        weights = [
            (cluster.plan.groups[g].batch_share or 1.0) / cluster.plan.groups[g].replicas for g in layout.replica_group
        ]
        shares = proportional_shares(num_micro, weights, low)
    for g, n in zip(layout.replica_group, shares, strict=True):
        why = micro_batch_count_error(schedule, layout.num_stages(g), n)
        if why is not None:
            raise ConfigError(f"the cluster's plan: train.schedule: {why}. To fix: change the global batch or shares.")
    return shares


def _peak_tflops(kind: str, precision: str, device: str) -> float | None:
    """Peak dense TFLOPS of a device kind at ``precision`` (probe profile, else datasheet); None if unknown.

    CPU ranks compute in fp32 unless bf16 autocast was asked for, so their peak is the fp32 one.
    """
    try:
        from starverse.catalog import load_catalog

        acc = load_catalog().accelerator(kind)
    except Exception as e:  # a missing catalog entry only costs the MFU figure
        log.info("no peak TFLOPS for %s (%s): MFU not reported", kind, e)
        return None
    prec = "fp32" if device == "cpu" and precision != "bf16-cpu" else precision.replace("-cpu", "")
    try:
        value = float(acc.peak_tflops(prec))
    except Exception:
        return None
    return value if value > 0 and math.isfinite(value) else None


def _summarise(
    results: list[RankResult], job: FitJob, ranks: list[RankSpec], pipeline: PipelineReport | None = None
) -> FitResult:
    r0 = results[0]
    per_rank = []
    achieved = 0.0
    peaks = 0.0
    for res, spec, peak in zip(results, ranks, job.peaks_tflops, strict=True):
        tps = res.tokens / res.compute_s if res.compute_s > 0 else 0.0
        mfu = tps * job.flops_per_token / (peak * 1e12) if peak else None
        achieved += tps * job.flops_per_token
        peaks += peak or float("nan")
        per_rank.append(RankSummary(spec.rank, spec.device_kind, res.share, res.tokens, res.compute_s, tps, peak, mfu))
    ev = json.loads((job.run_dir / EVAL_FILE).read_text()) if (job.run_dir / EVAL_FILE).is_file() else None
    times = r0.step_times[1:] or r0.step_times
    step_s = float(np.median(times)) if times else float("nan")
    tokens_step = job.global_batch * job.seq_len
    tps_job = tokens_step * len(times) / sum(times) if times and sum(times) > 0 else 0.0
    mfu_job = tps_job * job.flops_per_token / (peaks * 1e12) if math.isfinite(peaks) and peaks > 0 else None
    return FitResult(
        steps=r0.step, final_loss=r0.losses[-1] if r0.losses else float("nan"), losses=r0.losses,
        tokens_total=r0.tokens_total, wall_s=r0.wall_s, tokens_per_s=tps_job, mfu=mfu_job,
        ranks=tuple(per_rank), shares_history=r0.shares_history,
        micro_batch=job.micro_batch, global_batch=job.global_batch, seq_len=job.seq_len,
        stop_reason=r0.stop_reason, run_dir=job.run_dir, step_time_s=step_s,
        step_times_s=r0.step_times, pipeline=pipeline,
        eval_loss=ev["loss"] if ev else None, eval_perplexity=ev["perplexity"] if ev else None,
    )
