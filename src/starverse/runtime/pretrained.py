"""Pretrained weights: load a Hugging Face folder's safetensors (sharded too) into a built model, checked.

``load_weights(model, folder)`` reads tensor by tensor with ``safetensors.safe_open`` (memory-mapped), so a
caller that builds only part of a model (a pipeline stage) passes ``keys=`` and reads only those tensors.
Every parameter and persistent buffer of the model must come from the files, except tied copies
(``lm_head.weight`` tied to the embedding): a weight the files lack, a shape that differs, a tensor the model
has no place for, or files that match nothing at all, is a :class:`~starverse.errors.ModelError` naming the
tensors and the fix. A model never silently keeps its random initialisation.

``weights_dtype(mode, precision)`` is the dtype weights are held in for the plan's training mode: full
training keeps fp32 master weights (the runtime autocasts to the plan's precision); LoRA keeps the frozen base
in the plan's precision (the cost model's ``lora`` memory assumes that), QLoRA in 4 bits on CUDA.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import torch

from starverse.errors import ModelError
from starverse.models.folder import ModelFolder, inspect_folder

log = logging.getLogger(__name__)

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16, "fp32": torch.float32}


def weights_dtype(mode: str, precision: str) -> torch.dtype:
    """The dtype a model's weights are built and loaded in for training ``mode`` at ``precision`` (see module)."""
    if mode == "full":
        return torch.float32
    return _DTYPES.get(precision.replace("-cpu", ""), torch.float32)


@dataclass(frozen=True)
class LoadReport:
    """What :func:`load_weights` loaded."""

    folder: Path
    """The model folder."""
    num_tensors: int
    """Tensors loaded."""
    num_params: int
    """Elements loaded (parameters and buffers)."""
    tied: tuple[str, ...]
    """Model tensors not in the files because they share storage with a loaded one."""


def _aliases(model: torch.nn.Module) -> dict[str, frozenset[str]]:
    """Name -> every name of the same tensor (tied weights are one tensor under several names)."""
    by_id: dict[int, set[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), set()).add(name)
    return {n: frozenset(names) for names in by_id.values() for n in names}


def _short(names: Collection[str], n: int = 3) -> str:
    items = sorted(names)
    return ", ".join(items[:n]) + (f", ... ({len(items)} in all)" if len(items) > n else "")


def load_weights(
    model: torch.nn.Module, folder: str | Path | ModelFolder, *, keys: Collection[str] | None = None
) -> LoadReport:
    """Load the folder's safetensors into ``model`` in place (cast to each tensor's dtype); see the module.

    ``keys``: load only these model tensors (a stage of a pipeline); None: all of them.
    """
    from safetensors import safe_open

    mf = folder if isinstance(folder, ModelFolder) else inspect_folder(folder)
    if not mf.has_weights:
        raise ModelError(f"{mf.path}: has no safetensors weights to load.")
    expected = model.state_dict()
    wanted = set(expected) if keys is None else set(keys) & set(expected)
    aliases = _aliases(model)
    loaded: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    mismatched: list[str] = []
    for file in mf.weight_files:
        try:
            handle = safe_open(str(file), framework="pt")
        except Exception as e:  # safetensors raises its own error types for a truncated or foreign file
            raise ModelError(f"{file}: not a readable safetensors file ({' '.join(str(e).split())[:120]}). To fix: "
                             "copy the file again, or re-save the model with save_pretrained.") from None
        with handle as f:
            for name in f.keys():  # noqa: SIM118 (safe_open handles are not mappings)
                if name not in expected:
                    unexpected.append(name)
                    continue
                if name not in wanted:
                    continue
                shape = tuple(f.get_slice(name).get_shape())
                if shape != tuple(expected[name].shape):
                    mismatched.append(f"{name} {list(shape)} vs the model's {list(expected[name].shape)}")
                    continue
                loaded[name] = f.get_tensor(name).to(expected[name].dtype)
    where = f"{mf.path} ({len(mf.weight_files)} safetensors file{'s' if len(mf.weight_files) != 1 else ''})"
    if not loaded and not mismatched:
        raise ModelError(
            f"{where}: none of its tensors match the model built from its config.json (file has e.g. "
            f"{_short(unexpected, 2) or 'nothing'}; the model wants e.g. {_short(expected, 2)}). To fix: the "
            "weights and config.json must come from the same save_pretrained."
        )
    if mismatched:
        raise ModelError(
            f"{where}: weights do not match config.json: {len(mismatched)} tensor shape(s) differ "
            f"({'; '.join(mismatched[:2])}). To fix: use the config.json saved with these weights."
        )
    missing = {n for n in wanted - set(loaded) if not aliases.get(n, frozenset()) & set(loaded)}
    if missing:
        raise ModelError(
            f"{where}: weights do not match config.json: {len(missing)} tensor(s) of the model are not in the "
            f"files ({_short(missing)}). To fix: use the config.json saved with these weights."
        )
    if unexpected:
        raise ModelError(
            f"{where}: weights do not match config.json: {len(unexpected)} tensor(s) in the files have no place "
            f"in the model ({_short(unexpected)}). To fix: use the config.json saved with these weights."
        )
    model.load_state_dict(loaded, strict=False)
    num = sum(t.numel() for t in loaded.values())
    log.info("loaded %d tensors (%s elements) from %s", len(loaded), f"{num:,}", where)
    return LoadReport(mf.path, len(loaded), num, tuple(sorted(set(wanted) - set(loaded))))
