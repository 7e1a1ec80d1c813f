"""Per-stage weight loading: each pipeline rank reads only its stage's tensors from the model folder's safetensors.

When the model passed to ``Trainer.fit`` still holds the weights of the folder it was built from
(:func:`unchanged_weights_folder` compares them), the trainer writes the initial model as a *skeleton*
(:func:`skeleton`): the parameters the folder holds are on the ``meta`` device (no bytes), the rest (LoRA
adapters, buffers) are real. A rank cuts its chunks from the skeleton and fills each chunk's meta parameters
from the files (:func:`load_chunk_weights`), reading by the tensor's name in the unsplit model, so a stage of
``k`` layers reads ``k`` layers' tensors (plus the embedding or head at the ends), memory-mapped, one at a time.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from starverse.errors import ModelError

log = logging.getLogger(__name__)

_LORA_BASE = ".base_layer"
"""peft's LoRA wrapper keeps the wrapped linear under this name; the files name it without."""


def file_key(name: str) -> str:
    """The safetensors name of a model tensor (a LoRA-wrapped linear's base weight under its plain name)."""
    return name.replace(_LORA_BASE, "")


def _files(folder: Path) -> tuple[Path, ...]:
    from starverse.models.folder import inspect_folder

    return inspect_folder(folder).weight_files


def unchanged_weights_folder(model: nn.Module) -> Path | None:
    """The folder ``model`` was built from (``config._name_or_path``) when every tensor the folder holds is still
    equal in ``model`` (None otherwise: trained, edited or not from a folder; then ranks load the whole model)."""
    from safetensors import safe_open

    name = str(getattr(getattr(model, "config", None), "_name_or_path", "") or "")
    folder = Path(name)
    if not name or not (folder / "config.json").is_file():
        return None
    try:
        files = _files(folder)
    except ModelError:
        return None
    if not files:
        return None
    state = {file_key(k): v for k, v in model.state_dict().items()}
    seen = 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for k in f.keys():  # noqa: SIM118 (safe_open handles are not mappings)
                mine = state.get(k)
                if mine is None or mine.is_meta:
                    return None
                t = f.get_tensor(k)
                if t.shape != mine.shape or not torch.equal(t.to(mine.dtype), mine.detach().cpu()):
                    return None
                seen += 1
    return folder if seen else None


def skeleton(model: nn.Module, folder: Path) -> nn.Module:
    """A copy of ``model`` whose parameters that the folder's files hold are on the meta device (shape and dtype
    kept; nothing allocated); other parameters and all buffers are copied."""
    from safetensors import safe_open

    keys: set[str] = set()
    for file in _files(folder):
        with safe_open(str(file), framework="pt") as f:
            keys.update(f.keys())
    memo: dict[int, object] = {}
    for name, p in model.named_parameters():
        if file_key(name) in keys:
            memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    return copy.deepcopy(model, memo)


def load_chunk_weights(body: nn.Module, names: Mapping[str, str], folder: Path) -> int:
    """Replace ``body``'s meta parameters with the folder's tensors, read by their unsplit names (``names``: name
    in ``body`` -> name in the unsplit model); returns how many tensors were read. Tied parameters are one tensor.

    Raises :class:`ModelError` when the files lack one of them or its shape differs.
    """
    from safetensors import safe_open

    wanted: dict[str, nn.Parameter] = {}
    for local, p in body.named_parameters():
        if p.is_meta:
            wanted[file_key(names[local])] = p
    if not wanted:
        return 0
    new: dict[int, nn.Parameter] = {}
    for file in _files(folder):
        with safe_open(str(file), framework="pt") as f:
            for k in f.keys():  # noqa: SIM118
                if k not in wanted:
                    continue
                p = wanted[k]
                t = f.get_tensor(k)
                if tuple(t.shape) != tuple(p.shape):
                    raise ModelError(f"{file}: {k} has shape {list(t.shape)} but the model's is {list(p.shape)}. "
                                     "To fix: use the config.json saved with these weights.")
                new[id(p)] = nn.Parameter(t.to(p.dtype), requires_grad=p.requires_grad)
    missing = sorted(k for k, p in wanted.items() if id(p) not in new)
    if missing:
        raise ModelError(f"{folder}: the safetensors files lack {len(missing)} tensor(s) of this stage "
                         f"({', '.join(missing[:3])}). To fix: use the config.json saved with these weights.")
    for mod in body.modules():
        for attr, old in list(mod._parameters.items()):
            if old is not None and id(old) in new:
                mod._parameters[attr] = new[id(old)]
    log.info("loaded %d tensors of this stage from %s", len(new), folder)
    return len(new)
