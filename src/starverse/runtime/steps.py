"""Per-rank training pieces: loss of a batch, FLOPs per token, optimizer and schedule.

Kept apart from the trainer loop so the single-process reference in tests uses the very same code.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from starverse.errors import ConfigError

LossFn = Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]


def _accepts_labels(model: torch.nn.Module) -> bool:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return "labels" in params and "input_ids" in params


def batch_loss(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    loss_fn: LossFn | None = None,
    labels: torch.Tensor | None = None,
    num_targets: int | None = None,
) -> torch.Tensor:
    """Mean next-token loss of a batch of token sequences ``[batch, seq_len]``.

    ``loss_fn(model, input_ids)`` if given; else a Hugging Face causal LM's own loss (``labels=input_ids``);
    else ``model(input_ids)`` read as: a scalar loss, an object with ``.loss``, or logits
    ``[batch, seq_len, vocab]`` scored with shifted cross-entropy.

    With ``labels`` (-100 where a token is not a target, e.g. a chat prompt) the loss is the *sum* over this
    batch's targets divided by ``num_targets`` (the targets of the whole global batch): summed over the
    micro-batches of all ranks, that is exactly the global batch's mean token loss, however unevenly the
    targets fall.
    """
    if labels is not None:
        return _masked_loss(model, input_ids, labels, num_targets or 1, loss_fn)
    if loss_fn is not None:
        return loss_fn(model, input_ids)
    if _accepts_labels(model):
        out = model(input_ids=input_ids, labels=input_ids)
        return out.loss if hasattr(out, "loss") else out[0]
    out = model(input_ids)
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out
    loss = getattr(out, "loss", None)
    if loss is not None:
        return loss
    return shifted_cross_entropy(_logits(model, out), input_ids)


def shifted_cross_entropy(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of logits ``[batch, seq, vocab]`` against the same sequences' ids."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(), input_ids[:, 1:].reshape(-1))


def config_int(model: torch.nn.Module, *keys: str) -> int | None:
    """The first of ``keys`` that the model's (Hugging Face) ``config`` holds as an int; None if none."""
    cfg = getattr(model, "config", None)
    for key in keys:
        v = getattr(cfg, key, None)
        if isinstance(v, int):
            return v
    return None


def _logits(model: torch.nn.Module, out: Any) -> torch.Tensor:
    logits = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
    if logits is None or logits.dim() != 3:
        raise TypeError(
            f"{type(model).__name__}(input_ids) returned {type(out).__name__}; expected a scalar loss, an object "
            "with .loss, or logits [batch, seq, vocab]. To fix: pass loss_fn=."
        )
    return logits


def _masked_loss(
    model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, num_targets: int, loss_fn: LossFn | None
) -> torch.Tensor:
    if loss_fn is not None:
        raise TypeError("loss_fn= cannot be combined with masked labels (chat data). To fix: drop loss_fn.")
    return masked_cross_entropy(_logits(model, model(input_ids)), labels, num_targets)


def masked_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, num_targets: int) -> torch.Tensor:
    """Next-token cross-entropy summed over the labelled tokens (-100: none) of ``labels`` ``[batch, seq]``,
    divided by ``num_targets`` (the labelled tokens of the whole global batch)."""
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)).float(), labels[:, 1:].reshape(-1), ignore_index=-100,
        reduction="sum",
    ) / num_targets


def flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """Training FLOPs per token: 6 × matmul parameters + 12 × layers × hidden × seq_len (attention scores).

    Input-embedding lookups are not matmuls and are left out; a tied output head counts once as a matmul.
    The attention term uses the model's ``config`` (Hugging Face) when it has one.
    """
    emb_ids = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    get_out = getattr(model, "get_output_embeddings", None)
    out_emb = get_out() if callable(get_out) else None
    head_ids = {id(out_emb.weight)} if out_emb is not None else set()
    n = sum(p.numel() for p in model.parameters() if id(p) not in emb_ids or id(p) in head_ids)
    cfg = getattr(model, "config", None)
    attn = 0.0
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None)
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None)
    if layers and hidden:
        attn = 12.0 * layers * hidden * seq_len
    return 6.0 * n + attn


SGD_MOMENTUM = 0.9
"""Momentum of ``optimizer: sgd`` (Megatron-LM's ``--sgd-momentum`` default, torch's usual choice)."""


def make_optimizer(
    model: torch.nn.Module, lr: float, weight_decay: float, betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8, kind: str = "adamw",
) -> torch.optim.Optimizer:
    """AdamW (``kind`` adamw) or SGD with momentum :data:`SGD_MOMENTUM` (``kind`` sgd: the plan's
    ``train.optimizer``); no weight decay on biases, norms and other 1-D parameters."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups: list[dict[str, Any]] = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    # foreach=False: the same kernel on every device kind, so ranks compute bit-identical updates.
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=SGD_MOMENTUM, foreach=False)
    if kind != "adamw":
        raise ConfigError(f"optimizer {kind!r} is not one of adamw, sgd. To fix: set train.optimizer to one of them.")
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=False)


def make_schedule(
    optimizer: torch.optim.Optimizer, warmup_steps: int, max_steps: int, min_lr_ratio: float = 0.1
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``warmup_steps``, then cosine decay to ``min_lr_ratio`` × lr at ``max_steps``."""

    def factor(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        span = max(1, max_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for ``precision`` on ``device``, or None for plain fp32.

    bf16 on CUDA devices that support it; fp16 on CUDA; on CPU, bf16 autocast only when asked for
    explicitly with ``precision="bf16-cpu"`` (most CPUs have no fast bf16 matmul, and it costs accuracy).
    """
    if device.type == "cuda":
        if precision in ("bf16", "fp8") and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        if precision in ("fp16", "bf16", "fp8"):
            return torch.float16
        return None
    if precision == "bf16-cpu":
        return torch.bfloat16
    return None
