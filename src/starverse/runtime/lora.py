"""LoRA / QLoRA as the plan says (``train.mode``, ``train.lora_rank``), with ``peft``.

``apply_mode(model, train, devices)`` prepares a model for the plan's mode before training: ``full`` leaves it
as it is; ``lora`` injects low-rank adapters in place (``peft.inject_adapter_in_model``: the module stays the
user's module, its base weights frozen, only ``lora_A``/``lora_B`` trainable); ``qlora`` needs 4-bit base
weights, which ``bitsandbytes`` provides on CUDA only: on a CPU rank it is a :class:`ConfigError` naming
``train.mode`` and what runs instead (``lora``), before anything is launched.

Because only the adapters are trainable, heterogeneous DP syncs only their gradients and AdamW holds state for
them alone; checkpoints keep only trainable tensors (the frozen base is referenced by the plan's ``model``).
:func:`merge_lora` folds the adapters into the base weights for export.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from starverse.errors import ConfigError

log = logging.getLogger(__name__)

LORA_ALPHA_RATIO = 2
"""``lora_alpha = 2 × rank`` (the usual choice: the adapters' scale does not change with the rank)."""


@dataclass(frozen=True)
class LoraSettings:
    """The adapters' shape (saved next to adapter-only weights so they can be merged later)."""

    rank: int
    """Rank of each adapter."""
    alpha: int
    """Scale numerator (the update is ``alpha / rank × B A``)."""
    target_modules: tuple[str, ...]
    """Names (suffixes) of the linear layers that carry adapters."""

    def peft_config(self) -> Any:
        """The ``peft.LoraConfig`` of these settings."""
        from peft import LoraConfig

        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=0.0, target_modules=list(self.target_modules),
                          bias="none")

    def as_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"rank": self.rank, "alpha": self.alpha, "target_modules": list(self.target_modules)}


def default_targets(model: torch.nn.Module) -> tuple[str, ...]:
    """Every linear layer but the output head: what the cost model's ``lora`` memory and the planner assume
    (``adapter_params_per_layer``: attention and MLP projections), and what QLoRA trains."""
    head = output_head(model)
    names = [n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head]
    if head is None and names:
        names = names[:-1]  # a plain module: its last linear layer is taken to be the output head
    if not names:
        raise ConfigError(f"train.mode: lora: {type(model).__name__} has no linear layers to put adapters on.")
    return tuple(dict.fromkeys(names))


def output_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model's output projection (a transformers model's ``get_output_embeddings()``), None if unknown."""
    get: Any = getattr(model, "get_output_embeddings", None)
    return get() if callable(get) else None


def is_lora(model: torch.nn.Module) -> bool:
    """True when the model carries LoRA adapters."""
    return any(".lora_A." in n for n, _ in model.named_parameters())


def lora_settings_of(model: torch.nn.Module) -> LoraSettings | None:
    """The settings of the adapters peft injected into ``model`` (None without adapters)."""
    cfg = (getattr(model, "peft_config", None) or {}).get("default")
    if cfg is None:
        return None
    return LoraSettings(int(cfg.r), int(cfg.lora_alpha), tuple(sorted(cfg.target_modules)))


def qlora_support(devices: Sequence[str]) -> str | None:
    """None when 4-bit QLoRA can run on all ``devices``; else why not (one phrase)."""
    cpu = [d for d in devices if not str(d).startswith("cuda")]
    if cpu:
        return (f"{len(cpu)} of the {len(devices)} ranks are not CUDA devices ({cpu[0]}); bitsandbytes' 4-bit "
                "weights run on CUDA only")
    if importlib.util.find_spec("bitsandbytes") is None:
        return "bitsandbytes is not installed (pip install bitsandbytes)"
    return None


def check_mode(mode: str, devices: Sequence[str], source: str = "plan") -> None:
    """Raise ConfigError when ``mode`` cannot run on ``devices`` (see the module docstring)."""
    if mode not in ("full", "lora", "qlora"):
        raise ConfigError(f"{source}: train.mode: must be full, lora or qlora (got {mode!r}).")
    if mode == "qlora":
        why = qlora_support(devices)
        if why is not None:
            raise ConfigError(
                f"{source}: train.mode: qlora needs 4-bit base weights, not available here: {why}. What runs on "
                "these devices: mode: lora (same adapters, base weights in the plan's precision). To fix: set "
                "train.mode: lora, or run on CUDA GPUs with bitsandbytes."
            )


def apply_lora(model: torch.nn.Module, rank: int, *, alpha: int | None = None,
               target_modules: Sequence[str] | None = None) -> LoraSettings:
    """Inject LoRA adapters into ``model`` in place; freezes everything else. Returns the settings used."""
    from peft import inject_adapter_in_model

    if rank <= 0:
        raise ConfigError(f"train.lora_rank: must be > 0 (got {rank}).")
    settings = LoraSettings(rank, int(alpha if alpha is not None else LORA_ALPHA_RATIO * rank),
                            tuple(target_modules or default_targets(model)))
    for p in model.parameters():
        p.requires_grad_(False)
    inject_adapter_in_model(settings.peft_config(), model)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    log.info("LoRA rank %d on %s: %s of %s parameters trainable (%.2f %%)", rank, ",".join(settings.target_modules),
             f"{trainable:,}", f"{total:,}", 100.0 * trainable / max(1, total))
    return settings


def apply_mode(model: torch.nn.Module, mode: str, lora_rank: int, devices: Sequence[str],
               source: str = "plan") -> LoraSettings | None:
    """Prepare ``model`` for the plan's training mode (see the module docstring); None for ``full``."""
    check_mode(mode, devices, source)
    if is_lora(model):
        return lora_settings_of(model)  # adapters already there (build_model(cluster), or the user's own)
    if mode == "full":
        return None
    if mode == "qlora":
        quantize_4bit(model)
    return apply_lora(model, lora_rank)


def quantize_4bit(model: torch.nn.Module) -> None:
    """Replace the linear layers (not the output head) by bitsandbytes NF4 layers (CUDA only; see check_mode).

    Runs where ``check_mode('qlora', ...)`` passed. The weights are quantized when the model moves to CUDA.
    """
    import bitsandbytes as bnb

    head = output_head(model)
    for name, module in list(model.named_modules()):
        if not isinstance(module, torch.nn.Linear) or module is head:
            continue
        q = bnb.nn.Linear4bit(module.in_features, module.out_features, bias=module.bias is not None,
                              compute_dtype=torch.bfloat16, quant_type="nf4")
        q.weight = bnb.nn.Params4bit(module.weight.data.float(), requires_grad=False, quant_type="nf4")
        if module.bias is not None:
            q.bias = torch.nn.Parameter(module.bias.data, requires_grad=False)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, q)


def merge_lora(model: torch.nn.Module) -> torch.nn.Module:
    """Fold every adapter into its base layer and put the plain base layer back (in place; returns ``model``)."""
    from peft.tuners.lora import LoraLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer) and hasattr(module, "base_layer"):
            module.merge()
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, module.get_base_layer())
    return model


def trainable_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint of ``model`` needs: all of them, or only the trainable ones (adapters) when the
    base is frozen."""
    sd = model.state_dict()
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    return sd if not frozen else {k: v for k, v in sd.items() if k not in frozen}
