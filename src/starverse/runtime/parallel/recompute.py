"""Activation recomputation as the plan says: ``none``, ``selective``, ``matmuls`` or ``full``.

- ``full`` checkpoints every decoder block (``checkpoint_wrapper``, non-reentrant): a block keeps only its
  input through the forward and is run again in the backward, up to the last tensor its backward saved
  (PyTorch's early stop; ``early_stop=False``: all of it). Activation memory per block falls from the
  whole block's to one tensor ``[batch, seq, hidden]``; compute rises by one forward (~33 %).
- ``matmuls`` (and ``selective``) is op-level selective activation checkpointing (``torch.utils.checkpoint``'s
  ``create_selective_checkpoint_contexts``, as torchtitan's op SAC): the outputs of the matmuls
  (``mm``/``addmm`` of the linear layers) are saved, everything else in the block is recomputed — the attention
  core (scores, softmax, dropout, or the fused SDPA kernel), activation functions, norms and rotary embeddings
  (JAX's ``checkpoint_dots``, MaxText's ``minimal``). It runs eagerly on every device, CPU included. Unlike
  torchtitan's list, the SDPA output is *not* saved. This keeps fewer tensors, and recomputes more, than
  Korthikanti et al.'s (2022) selective recompute (the attention core alone), which is what the cost model prices
  for ``selective`` (docs/costmodel.md, Limits: the estimate of a ``selective`` plan is high in memory and low in
  time); the cost model prices ``matmuls`` as this runs (``costmodel/memory.py``), and the planner searches it in
  the place of ``selective``. A policy by op cannot run Korthikanti's choice: it sees an op's inputs, not its
  output, so the score matmul of an eager attention cannot be told from a projection.

Recompute never changes the result: the same ops run on the same inputs (random state is preserved for
dropout), so losses and weights equal those without recompute; tests assert it.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from starverse.errors import ConfigError
from starverse.runtime.parallel.blocks import decoder_blocks

log = logging.getLogger(__name__)

RECOMPUTE_MODES = ("none", "selective", "matmuls", "full")

_SAVED_OPS = frozenset({
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten._scaled_mm.default,
})
"""Ops whose outputs the selective modes keep (the linear layers' matmuls); all others are recomputed.
``bmm`` is left out: in eager attention it computes the scores and the weighted values (the attention core)."""


def _keep_matmuls(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if func in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> Any:
    return create_selective_checkpoint_contexts(_keep_matmuls)


def apply_recompute(model: torch.nn.Module, mode: str, early_stop: bool = True) -> torch.nn.Module:
    """Wrap ``model``'s decoder blocks for ``mode`` recompute in place; returns ``model``.

    ``early_stop`` (``TrainSpec.recompute_early_stop``; PyTorch's default): ``full`` stops recomputing a block
    once the backward's saved tensors are back, so what follows the last of them (a llama block's down projection)
    is not run again; False runs the block's whole forward again, as Megatron-LM's checkpoint does.

    Apply after tensor parallelism and before ``fully_shard`` (torchtitan's order): FSDP then shards the
    wrapped blocks. State-dict keys are unchanged (the wrapper strips its prefix).
    """
    if mode not in RECOMPUTE_MODES:
        raise ConfigError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)} (got {mode!r}).")
    if mode == "none":
        return model
    _, blocks = decoder_blocks(model)
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        # A KV cache filled in the forward would be filled again by the recompute (the keys concatenated
        # twice); training needs no cache (transformers' own gradient checkpointing turns it off too).
        config.use_cache = False  # type: ignore[union-attr]
    wrap = checkpoint_wrapper if mode == "full" else partial(checkpoint_wrapper, context_fn=_selective_contexts)
    for i, block in enumerate(list(blocks)):
        blocks[i] = wrap(block, preserve_rng_state=True, early_stop=early_stop)
    log.info("recompute %s: %d blocks wrapped", mode, len(blocks))
    return model
