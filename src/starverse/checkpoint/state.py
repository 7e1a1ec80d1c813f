"""What a checkpoint holds, in a form that survives a change of world size.

Model and optimizer state go through ``torch.distributed.checkpoint.state_dict`` so optimizer state is keyed
by parameter name (FQN), not by position: a checkpoint written by 3 ranks loads on 2 or 5. RNG states are
per rank; everything else (LR schedule, sampler position, step, shares) is global and written once.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping
from typing import Any, cast

import numpy as np
import torch

# torch.distributed.checkpoint costs ~1.7 s to import (DTensor ops); it is imported on first use, and
# CheckpointCallback warms it up in a background thread while the first steps run.


def train_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The DCP-ready state: ``{"model": ..., "optim": ...}`` keyed by parameter name (references, not copies)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    # a frozen base (LoRA) is not saved: the plan's model names it; only the adapters change
    sd: dict[str, Any] = {"model": get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))}
    if optimizer is not None:
        sd["optim"] = get_optimizer_state_dict(model, optimizer)
    return sd


def apply_train_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, sd: Mapping[str, Any]) -> None:
    """Load a state produced by :func:`train_state` (after DCP filled it in) into model and optimizer."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    frozen = any(not p.requires_grad for p in model.parameters())
    set_model_state_dict(model, sd["model"], options=StateDictOptions(strict=not frozen))
    if optimizer is not None and "optim" in sd:
        # not strict: an optimizer that shards its state (ZeRO-1's ShardedOptimizer) asks for its partition only;
        # every entry it asked for was checked present by dcp.load, which filled ``sd``
        set_optimizer_state_dict(model, optimizer, sd["optim"], options=StateDictOptions(strict=False))


def clone_tree(tree: Any) -> Any:
    """Deep copy of nested dicts/lists with every tensor cloned to CPU (the staged, frozen snapshot)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, Mapping):
        return {k: clone_tree(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(clone_tree(v) for v in tree)
    return tree


def plain(tree: Any) -> Any:
    """Numpy scalars/arrays -> Python/torch values, so files load with ``torch.load(weights_only=True)``."""
    if isinstance(tree, np.generic):
        return tree.item()
    if isinstance(tree, np.ndarray):
        return torch.from_numpy(tree.copy())
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, Mapping):
        return {k: plain(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(plain(v) for v in tree)
    return tree


def fingerprint(model: torch.nn.Module) -> tuple[str, int]:
    """(hash of parameter names, shapes and dtypes, number of parameters): a resume must match both.

    A rank that holds part of the model (a pipeline stage) fingerprints the whole model it is part of
    (``model.unsplit_signature``), so a checkpoint written under one layout loads under another.
    """
    h = hashlib.sha256()
    signature = getattr(model, "unsplit_signature", None)
    if signature is not None:
        for name, shape, dtype in signature.entries:
            h.update(f"{name}:{shape}:{dtype};".encode())
        return h.hexdigest()[:16], int(signature.num_params)
    # the module's own state_dict keys, as DCP's get_model_state_dict reports them for a plain module
    for name, t in sorted(model.state_dict().items()):
        if isinstance(t, torch.Tensor):
            h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
    num = sum(p.numel() for p in model.parameters())
    return h.hexdigest()[:16], num


def capture_rng() -> dict[str, Any]:
    """RNG states of this process (torch CPU, CUDA if present, Python, numpy)."""
    np_state = cast(tuple[Any, ...], np.random.get_state())
    out: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].copy()), *(plain(x) for x in np_state[2:])),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def restore_rng(state: Mapping[str, Any]) -> None:
    """Restore what :func:`capture_rng` saved (CUDA only when both sides have the same device count)."""
    torch.set_rng_state(state["torch"])
    random.setstate(_tuples(state["python"]))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy(), *rest))
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def _tuples(x: Any) -> Any:
    # torch.load returns tuples as written, but be lenient with lists (random.setstate needs tuples)
    return tuple(_tuples(v) for v in x) if isinstance(x, list | tuple) else x
