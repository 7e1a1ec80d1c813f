"""Find a model's repeated blocks: the unit that ZeRO-3 gathers and activation checkpointing recomputes.

A ``transformers`` causal LM keeps its decoder blocks in one ``nn.ModuleList`` under the base model
(``model.layers`` for Llama/Mistral/Qwen2, ``transformer.h`` for GPT-2/Falcon/BLOOM, ``gpt_neox.layers``,
``model.decoder.layers`` for OPT, ``transformer.blocks`` for MPT). A user's ``nn.Module`` is read the same
way: its largest ``nn.ModuleList`` (by parameters) is taken as its blocks.
"""

from __future__ import annotations

import torch

from starverse.errors import ConfigError


def decoder_blocks(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    """``(qualified name, ModuleList)`` of ``model``'s blocks: the ``nn.ModuleList`` holding most parameters.

    Raises :class:`ConfigError` when the model has no ``nn.ModuleList`` of modules with parameters (then
    neither per-block sharding nor per-block recompute has a unit to work on).
    """
    best: tuple[int, str, torch.nn.ModuleList] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) > 0:
            n = sum(p.numel() for p in mod.parameters())
            if n > 0 and (best is None or n > best[0]):
                best = (n, name, mod)
    if best is None:
        raise ConfigError(
            f"{type(model).__name__} has no nn.ModuleList of blocks, so ZeRO-3 and recompute have no unit to "
            "shard or recompute. To fix: keep the model's repeated layers in an nn.ModuleList, or set "
            "zero_stage: 0 and recompute: none."
        )
    return best[1], best[2]
