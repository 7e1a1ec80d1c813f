"""What ``Trainer.fit`` prepares before any rank starts: its arguments checked against the plan and the model
(:func:`check_runs`, :func:`max_positions`), the initial shares of the global batch (:func:`initial_shares`), and
the training data tokenised, packed, split and written under ``RUN_DIR/data`` (:func:`prepare_data`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from starverse.errors import ConfigError
from starverse.plan import Plan
from starverse.runtime.data import (
    HFTokenizer,
    TokenizedCorpus,
    load_tokenizer,
    model_tokenizer,
    pack,
    tokenize_corpus,
)
from starverse.runtime.hetero_dp import proportional_shares
from starverse.runtime.parallel.pipeline import (
    check_pipeline_loss_fn,
    micro_batch_count_error,
    min_micro_batches,
)
from starverse.runtime.parallel.pipeline_layout import PipelineLayout
from starverse.runtime.runlog import EvalCallback
from starverse.runtime.steps import LossFn, config_int

if TYPE_CHECKING:
    from starverse.runtime.cluster import Cluster


@dataclass(frozen=True)
class FitData:
    """The training data of a fit, written under ``RUN_DIR/data`` for the ranks to read."""

    tokens_path: Path
    """The packed training sequences (``tokens.npy``)."""
    labels_path: Path | None
    """Their labels where some tokens are masked (chat data; ``labels.npy``), else None."""
    eval_callback: EvalCallback | None
    """The held-out split's evaluation (None: no held-out split)."""
    tokenizer: Any
    """What tokenised the corpus: ``"bpe"``, ``"bytes"`` or an :class:`~starverse.runtime.data.HFTokenizer`."""
    corpus: TokenizedCorpus
    """The tokenised corpus (its ``tokenizer`` names the tokenizer, ``bpe:FILE`` for a trained BPE)."""


def prepare_data(
    run_dir: Path, model: torch.nn.Module, dataset: Any, tokenizer: str | Any, *, seq_len: int, global_batch: int,
    eval_fraction: float, eval_every: int, micro_batch: int, precision: str, max_corpus_bytes: int | None,
) -> FitData:
    """Tokenise ``dataset`` for ``model`` (``tokenizer``: see ``Trainer.fit``), pack it into ``seq_len`` sequences
    (at least one global batch), hold out ``eval_fraction`` of them, and write it all under ``run_dir/data``."""
    vocab = vocab_size(model)
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
    packed = pack(corpus, seq_len, min_sequences=global_batch)
    num_eval = math.ceil(len(packed) * eval_fraction) if eval_fraction else 0
    eval_callback = None
    if num_eval:
        packed, held_out = packed.split(num_eval)
        pack(TokenizedCorpus(packed.tokens, 0, 0, ""), seq_len, min_sequences=global_batch)  # still one step's worth
        np.save(run_dir / "data" / "eval_tokens.npy", held_out.tokens)
        eval_callback = EvalCallback(
            run_dir / "data" / "eval_tokens.npy", seq_len, every=eval_every,
            micro_batch=micro_batch, precision=precision,
            labels_path=save_array(run_dir / "data" / "eval_labels.npy", held_out.labels),
        )
    tokens_path = run_dir / "data" / "tokens.npy"
    np.save(tokens_path, packed.tokens)
    labels_path = save_array(run_dir / "data" / "labels.npy", packed.labels)
    return FitData(tokens_path, labels_path, eval_callback, hf_tok, corpus)


def save_array(path: Path, arr: np.ndarray | None) -> Path | None:
    """Save ``arr`` at ``path`` (``.npy``); its path, or None (nothing written) without an array."""
    if arr is None:
        return None
    np.save(path, arr)
    return path


def max_positions(model: torch.nn.Module) -> int | None:
    """The longest sequence ``model``'s config allows (None: it does not say)."""
    return config_int(model, "max_position_embeddings", "n_positions", "max_seq_len")


def vocab_size(model: torch.nn.Module) -> int | None:
    """``model``'s vocabulary: its config's ``vocab_size``, else its first embedding's rows (None: neither)."""
    v = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(v, int):
        return v
    emb = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    return emb[0].num_embeddings if emb else None


def check_runs(plan: Plan, layout: PipelineLayout, loss_fn: LossFn | None) -> None:
    """What this runtime does not run yet, refused rather than silently run as something else."""
    # tensor parallelism: checked by parallel.parallelize.check_parallel_plan (with the shares)
    if layout.is_pipelined and loss_fn is not None:
        check_pipeline_loss_fn(loss_fn)  # the last stage calls loss_fn(logits, labels)
    if layout.is_pipelined and plan.train.mode == "qlora":
        raise ConfigError(
            "the cluster's plan: train.mode: qlora is not run with pipeline stages yet (a stage is a copy of the "
            "model's part, and 4-bit weights are not copied). To fix: mode: lora, or one stage per group for QLoRA."
        )


def initial_shares(
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
