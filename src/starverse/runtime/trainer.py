"""``Trainer.fit``: train one model with heterogeneous data parallelism over the cluster's ranks.

The user's process prepares everything that must be identical on every rank (tokenised corpus, initial
weights, initial shares), then :func:`~starverse.runtime.launch.launch` starts one process per rank.
Each rank runs :func:`_train_rank`: micro-batches of its share, gradients summed over the mixed mesh,
AdamW with warm-up + cosine, clipping, a per-step exchange of losses/times/stop votes, rebalancing of
shares. Rank 0 writes the final weights, which are loaded back into the user's model, so ``model`` is
trained after ``fit`` returns, as with a single-process trainer.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from starverse.errors import ConfigError
from starverse.plan import Plan
from starverse.runtime.callbacks import Callback, CallbackList, TrainContext
from starverse.runtime.data import (
    DeterministicSampler,
    HFTokenizer,
    PackedDataset,
    TokenizedCorpus,
    load_tokenizer,
    model_tokenizer,
    pack,
    tokenize_corpus,
)
from starverse.runtime.export import FINAL_WEIGHTS, record_model
from starverse.runtime.hetero_dp import GradientSync, Rebalancer, proportional_shares
from starverse.runtime.launch import Launcher, RankEnv, RankSpec, launch, resolve_launcher
from starverse.runtime.lora import apply_mode, trainable_state_dict
from starverse.runtime.runlog import EVAL_FILE, EvalCallback, ProgressCallback, RunLogCallback
from starverse.runtime.steps import (
    LossFn,
    autocast_dtype,
    batch_loss,
    flops_per_token,
    make_optimizer,
    make_schedule,
)

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
        if self.eval_loss is not None:
            lines.append(f"  held-out: loss {self.eval_loss:.4f}, perplexity {self.eval_perplexity:.2f}")
        if self.stop_reason:
            lines.append(f"  stopped early: {self.stop_reason}")
        return lines


@dataclass(frozen=True)
class _FitJob:
    """Everything a rank needs (pickled into the rank processes)."""

    plan: Plan
    run_dir: Path
    model_path: Path
    tokens_path: Path
    seq_len: int
    micro_batch: int
    global_batch: int
    shares: tuple[int, ...]
    max_steps: int
    lr: float
    warmup_steps: int
    min_lr_ratio: float
    weight_decay: float
    grad_clip: float
    seed: int
    rebalance_every: int
    hysteresis: float
    precision: str
    callbacks: tuple[Callback, ...]
    loss_fn: LossFn | None
    resume_from: Path | None
    peaks_tflops: tuple[float | None, ...]
    flops_per_token: float
    bucket_mb: float = 25.0
    labels_path: Path | None = None


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

    def __post_init__(self) -> None:
        resolve_launcher(self.launcher)  # an unknown name or a missing Ray fails here, before data is prepared
        if self.lr <= 0:
            raise ConfigError(f"lr must be > 0 (got {self.lr}).")
        if self.grad_clip < 0:
            raise ConfigError(f"grad_clip must be >= 0 (got {self.grad_clip}).")
        if self.rebalance_every < 0:
            raise ConfigError(f"rebalance_every must be >= 0 (got {self.rebalance_every}).")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError(f"eval_fraction must be in [0, 1) (got {self.eval_fraction}).")
        if self.eval_every < 0:
            raise ConfigError(f"eval_every must be >= 0 (got {self.eval_every}).")

    def fit(
        self,
        model: torch.nn.Module,
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
        After ``fit`` the user's ``model`` holds the trained weights.
        """
        from starverse.runtime.cluster import accelerate

        cluster = self.cluster or accelerate()
        plan = cluster.plan
        ranks = list(cluster.ranks)
        world = len(ranks)
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module (got {type(model).__name__}).")
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
        init_shares = _initial_shares(cluster, num_micro, shares)

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
        record_model(run_dir, model, tokenizer=hf_tok.tok if isinstance(hf_tok, HFTokenizer) else None,
                     bpe_file=corpus.tokenizer[4:] if corpus.tokenizer.startswith("bpe:") else None,
                     lora=lora, mode=plan.train.mode)
        model_path = run_dir / "data" / "init_model.pt"
        torch.save(model, model_path)

        prec = precision or plan.train.precision
        job = _FitJob(
            plan=plan, run_dir=run_dir, model_path=model_path, tokens_path=tokens_path, seq_len=seq_len,
            micro_batch=per_device_batch_size, global_batch=gb, shares=tuple(init_shares), max_steps=max_steps,
            lr=self.lr, warmup_steps=self.warmup_steps if self.warmup_steps is not None else max(1, max_steps // 20),
            min_lr_ratio=self.min_lr_ratio, weight_decay=self.weight_decay, grad_clip=self.grad_clip,
            seed=self.seed, rebalance_every=self.rebalance_every, hysteresis=self.hysteresis, precision=prec,
            callbacks=tuple(callbacks), loss_fn=loss_fn, labels_path=labels_path,
            resume_from=Path(resume_from).resolve() if resume_from is not None else None,
            peaks_tflops=tuple(_peak_tflops(r.device_kind, prec, r.device) for r in ranks),
            flops_per_token=flops_per_token(model, seq_len),
        )
        log.info(
            "fit: %d ranks, global batch %d = %d micro-batches of %d, shares %s, %d steps, seq_len %d",
            world, gb, num_micro, per_device_batch_size, init_shares, max_steps, seq_len,
        )
        results = launch(
            _train_rank, ranks, timeout_s=self.timeout_s, args=(job,), collective_timeout_s=self.collective_timeout_s,
            launcher=self.launcher,
        )
        final = run_dir / FINAL_WEIGHTS
        if final.is_file():  # adapters only for LoRA (the frozen base is unchanged)
            model.load_state_dict(torch.load(final, map_location="cpu", weights_only=True), strict=lora is None)
        return _summarise(results, job, ranks)


def _save_array(path: Path, arr: np.ndarray | None) -> Path | None:
    if arr is None:
        return None
    np.save(path, arr)
    return path


def _max_positions(model: torch.nn.Module) -> int | None:
    cfg = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
        v = getattr(cfg, key, None)
        if isinstance(v, int):
            return v
    return None


def _vocab_size(model: torch.nn.Module) -> int | None:
    v = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(v, int):
        return v
    emb = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    return emb[0].num_embeddings if emb else None


def _initial_shares(cluster: Cluster, num_micro: int, shares: Sequence[int] | None) -> list[int]:
    world = len(cluster.ranks)
    if shares is not None:
        shares = [int(s) for s in shares]
        if len(shares) != world or sum(shares) != num_micro or min(shares) < 1:
            raise ConfigError(
                f"shares {shares} must give each of the {world} ranks >= 1 micro-batch and sum to {num_micro}."
            )
        return shares
    return proportional_shares(num_micro, cluster.rank_weights())


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


def _summarise(results: list[dict[str, Any]], job: _FitJob, ranks: list[RankSpec]) -> FitResult:
    r0 = results[0]
    per_rank = []
    achieved = 0.0
    peaks = 0.0
    for res, spec, peak in zip(results, ranks, job.peaks_tflops, strict=True):
        tps = res["tokens"] / res["compute_s"] if res["compute_s"] > 0 else 0.0
        mfu = tps * job.flops_per_token / (peak * 1e12) if peak else None
        achieved += tps * job.flops_per_token
        peaks += peak or float("nan")
        per_rank.append(RankSummary(spec.rank, spec.device_kind, res["share"], res["tokens"], res["compute_s"], tps, peak, mfu))
    ev = json.loads((job.run_dir / EVAL_FILE).read_text()) if (job.run_dir / EVAL_FILE).is_file() else None
    times = r0["step_times"][1:] or r0["step_times"]
    step_s = float(np.median(times)) if times else float("nan")
    tokens_step = job.global_batch * job.seq_len
    tps_job = tokens_step * len(times) / sum(times) if times and sum(times) > 0 else 0.0
    mfu_job = tps_job * job.flops_per_token / (peaks * 1e12) if math.isfinite(peaks) and peaks > 0 else None
    return FitResult(
        steps=r0["step"], final_loss=r0["losses"][-1] if r0["losses"] else float("nan"), losses=tuple(r0["losses"]),
        tokens_total=r0["tokens_total"], wall_s=r0["wall_s"], tokens_per_s=tps_job, mfu=mfu_job,
        ranks=tuple(per_rank), shares_history=tuple((s, tuple(sh)) for s, sh in r0["shares_history"]),
        micro_batch=job.micro_batch, global_batch=job.global_batch, seq_len=job.seq_len,
        stop_reason=r0["stop_reason"], run_dir=job.run_dir, step_time_s=step_s,
        step_times_s=tuple(r0["step_times"]),
        eval_loss=ev["loss"] if ev else None, eval_perplexity=ev["perplexity"] if ev else None,
    )


@dataclass
class _Timer:
    device: torch.device

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


def _train_rank(env: RankEnv, job: _FitJob) -> dict[str, Any]:
    """One rank's training loop (runs inside a launched process)."""
    import torch.distributed as dist

    from starverse.runtime.mesh import MixedMesh

    rank, world = env.rank, env.world_size
    device = torch.device(env.spec.device)
    torch.manual_seed(job.seed)
    np.random.seed(job.seed)
    mesh = MixedMesh.build([r.device_kind for r in env.ranks], [r.device for r in env.ranks])
    model = torch.load(job.model_path, map_location="cpu", weights_only=False).to(device)
    model.train()
    optimizer = make_optimizer(model, job.lr, job.weight_decay)
    scheduler = make_schedule(optimizer, job.warmup_steps, job.max_steps, job.min_lr_ratio)
    tokens = np.load(job.tokens_path, mmap_mode="r")
    labels = np.load(job.labels_path, mmap_mode="r") if job.labels_path is not None else None
    data = PackedDataset(tokens, job.seq_len, labels)
    sampler = DeterministicSampler(len(data), seed=job.seed)
    callbacks = CallbackList(job.callbacks)
    ctx = TrainContext(
        rank=rank, world_size=world, plan=job.plan, run_dir=job.run_dir, step=0, model=model, optimizer=optimizer,
        lr_scheduler=scheduler, sampler=sampler, group=mesh.host_group, device_kind=env.spec.device_kind,
        device=device, rank_kinds=[r.device_kind for r in env.ranks], max_steps=job.max_steps,
        shares=list(job.shares),
    )
    ctx.metrics.micro_batch = job.micro_batch
    if job.resume_from is not None:
        ctx.extra["resume_from"] = job.resume_from
        if not callbacks.on_resume(ctx, job.resume_from):
            if not job.resume_from.is_file():
                raise ConfigError(
                    f"resume_from={job.resume_from}: no callback loaded it and it is not a state file. To fix: "
                    "pass the checkpoint callback that wrote it, or a file saved from TrainContext.state_dict()."
                )
            ctx.load_state_dict(torch.load(job.resume_from, map_location=device, weights_only=False))
    callbacks.on_fit_start(ctx)

    grads = GradientSync(list(model.parameters()), mesh, job.bucket_mb, world)
    params = [p for p in model.parameters() if p.requires_grad]
    rebalancer = Rebalancer(sum(ctx.shares), every=job.rebalance_every, hysteresis=job.hysteresis)
    amp = autocast_dtype(job.precision, device)
    timer = _Timer(device)
    losses: list[float] = []
    step_times: list[float] = []
    shares_history: list[tuple[int, list[int]]] = [(ctx.step, list(ctx.shares))]
    my_tokens = 0
    my_compute = 0.0
    scale = job.micro_batch / job.global_batch
    t_loop = time.perf_counter()
    while ctx.step < job.max_steps:
        t0 = timer.now()
        batch_idx = sampler.next_indices(job.global_batch)
        start = sum(ctx.shares[:rank]) * job.micro_batch
        mine = batch_idx[start : start + ctx.shares[rank] * job.micro_batch]
        num_targets = data.num_targets(batch_idx) if data.labels is not None else None
        loss_sum = torch.zeros((), dtype=torch.float64)
        grads.blocked_s = 0.0  # time waiting for peers is not this device's compute (see GradientSync)
        for k in range(ctx.shares[rank]):
            tm, blocked0 = timer.now(), grads.blocked_s
            micro = mine[k * job.micro_batch : (k + 1) * job.micro_batch]
            x = torch.from_numpy(data.batch(micro)).to(device)
            y = data.batch_labels(micro)
            with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
                loss = batch_loss(model, x, job.loss_fn, None if y is None else torch.from_numpy(y).to(device),
                                  num_targets)
            if k == ctx.shares[rank] - 1:
                grads.arm()  # the last backward: overlap the gradient all-reduce with it
            weight = scale if y is None else 1.0  # masked labels: already this micro-batch's part of the mean
            (loss * weight).backward()
            loss_sum += loss.detach().double().cpu() * weight
            callbacks.on_micro_batch_end(ctx, timer.now() - tm - (grads.blocked_s - blocked0))
        compute_s = timer.now() - t0 - grads.blocked_s
        grads.finish()
        norm = torch.nn.utils.clip_grad_norm_(params, job.grad_clip) if job.grad_clip > 0 else _grad_norm(params)
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        wall_s = timer.now() - t0
        # One small host-side exchange per step: every rank learns every rank's loss part and times.
        mine_t = torch.tensor([float(loss_sum), compute_s, wall_s], dtype=torch.float64)
        gathered = [torch.zeros(3, dtype=torch.float64) for _ in range(world)]
        if world > 1:
            dist.all_gather(gathered, mine_t, group=mesh.host_group)
        else:
            gathered = [mine_t]
        step_loss = float(sum(g[0] for g in gathered))
        compute_times = [float(g[1]) for g in gathered]
        step_times_r = [float(g[2]) for g in gathered]
        ctx.step += 1
        my_tokens += ctx.shares[rank] * job.micro_batch * job.seq_len
        my_compute += compute_s
        m = ctx.metrics
        m.loss = step_loss
        m.tokens_step = job.global_batch * job.seq_len
        m.tokens_total += m.tokens_step
        m.step_time_s = max(step_times_r)
        m.step_times_s = step_times_r
        m.compute_times_s = compute_times
        m.shares = list(ctx.shares)
        m.tokens_per_s = m.tokens_step / m.step_time_s if m.step_time_s > 0 else 0.0
        m.mfu = _step_mfu(job, ctx.shares, compute_times, m.step_time_s)
        m.lr = lr
        m.grad_norm = float(norm)
        losses.append(step_loss)
        step_times.append(m.step_time_s)
        rebalancer.observe(ctx.shares, compute_times)
        new = rebalancer.propose(ctx.step, ctx.shares)
        callbacks.on_step_end(ctx)
        if new is not None:
            ctx.shares = new
            shares_history.append((ctx.step, list(new)))
        if _agree_to_stop(ctx, mesh.host_group, world):
            break
    wall = time.perf_counter() - t_loop
    callbacks.on_fit_end(ctx)
    if rank == 0:
        final = job.run_dir / FINAL_WEIGHTS
        tmp = final.with_suffix(".tmp")
        torch.save({k: v.detach().cpu() for k, v in trainable_state_dict(model).items()}, tmp)
        tmp.replace(final)
    return {
        "step": ctx.step, "losses": losses, "tokens_total": ctx.metrics.tokens_total, "wall_s": wall,
        "step_times": step_times, "shares_history": shares_history, "stop_reason": ctx.stop_reason,
        "tokens": my_tokens, "compute_s": my_compute, "share": ctx.shares[rank],
    }


def _grad_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    norms = [p.grad.detach().norm() for p in params if p.grad is not None]
    return torch.stack(norms).norm() if norms else torch.zeros(())


def _step_mfu(job: _FitJob, shares: Sequence[int], compute_times: Sequence[float], step_s: float) -> float | None:
    if any(p is None for p in job.peaks_tflops) or step_s <= 0:
        return None
    flops = job.global_batch * job.seq_len * job.flops_per_token
    return flops / step_s / (sum(p for p in job.peaks_tflops if p) * 1e12)


def _agree_to_stop(ctx: TrainContext, group: Any, world: int) -> bool:
    """All ranks stop together if any asked; the reason of the lowest asking rank is adopted everywhere."""
    import torch.distributed as dist

    if world == 1:
        return ctx.stop_reason is not None
    vote = torch.tensor([0 if ctx.stop_reason is None else 1], dtype=torch.int64)
    dist.all_reduce(vote, group=group)
    if int(vote) == 0:
        return False
    if ctx.stop_reason is None:
        ctx.stop_reason = "stop requested by another rank"
    return True
