"""A local Hugging Face model folder: its config, which weight files it has, and its tokenizer files.

``inspect_folder(path)`` reads only JSON (no torch): ``config.json`` (required), the weights it declares
(``model.safetensors``, or ``model.safetensors.index.json`` with its shards; a ``pytorch_model.bin`` is
reported but not loaded: pickles run code) and the tokenizer files. The runtime loads the weights from
what this returns (:mod:`starverse.runtime.pretrained`); the planner only needs the config.

A folder that declares weights (an index, or safetensors files) must load them all: a shard named by the
index but missing is an error here, before anything is built, never a silent random initialisation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starverse.errors import ModelError

SAFETENSORS = "model.safetensors"
"""The single-file weights name ``save_pretrained`` writes."""
SAFETENSORS_INDEX = "model.safetensors.index.json"
"""The index of sharded safetensors weights (``weight_map``: tensor name -> shard file)."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
"""Files whose presence means the folder carries its own tokenizer."""
BASE_MODEL_FILE = "starverse_base.json"
"""Written next to adapter-only weights: which base model folder (and LoRA settings) they apply to."""


@dataclass(frozen=True)
class ModelFolder:
    """What a Hugging Face model folder holds (read without torch)."""

    path: Path
    """The folder."""
    config: dict[str, Any]
    """``config.json`` as a dict."""
    weight_files: tuple[Path, ...]
    """Safetensors files to load, in order (empty: the folder has no weights; the model starts from scratch)."""
    weight_map: dict[str, str] | None
    """Tensor name -> file name from the index (None for a single file)."""
    has_tokenizer: bool
    """True when the folder has tokenizer files (``tokenizer.json`` or a sentencepiece/BPE vocabulary)."""

    @property
    def has_weights(self) -> bool:
        """True when the folder declares weights."""
        return bool(self.weight_files)


def is_model_folder(ref: Any) -> bool:
    """True when ``ref`` is a path to an existing folder (a model folder or a broken one: ``inspect_folder`` says)."""
    if not isinstance(ref, str | Path):
        return False
    return Path(ref).expanduser().is_dir()


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelError(f"{path}:{e.lineno}: malformed JSON in the {what}: {e.msg}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ModelError(f"{path}: cannot read the {what} ({e.__class__.__name__})") from None


def inspect_folder(path: str | Path) -> ModelFolder:
    """Read a model folder's config, weight files and tokenizer presence; raise ModelError when it is unusable.

    Errors: no ``config.json`` (the folder is not a model folder), an index whose shards are missing, only
    ``pytorch_model.bin`` weights (convert them to safetensors).
    """
    folder = Path(path).expanduser().resolve()
    cfg_path = folder / "config.json"
    if not folder.is_dir():
        raise ModelError(f"{folder}: not a folder. To fix: pass a Hugging Face model folder (with config.json).")
    if not cfg_path.is_file():
        raise ModelError(
            f"{folder}: no config.json, so this is not a Hugging Face model folder. To fix: point model: at the "
            "folder save_pretrained wrote (config.json next to the weights)."
        )
    config = _read_json(cfg_path, "model config")
    if not isinstance(config, dict) or not config.get("model_type"):
        raise ModelError(f"{cfg_path}: no 'model_type'. To fix: use the config.json save_pretrained wrote.")
    weight_map: dict[str, str] | None = None
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        raw = _read_json(index, "weights index")
        wm = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(wm, dict) or not wm:
            raise ModelError(f"{index}: no 'weight_map'. To fix: re-save the model with save_pretrained.")
        weight_map = {str(k): str(v) for k, v in wm.items()}
        files = tuple(folder / f for f in dict.fromkeys(weight_map.values()))
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelError(
                f"{index}: names {len(files)} weight shard(s) but {len(missing)} are missing "
                f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}). To fix: copy the whole folder."
            )
    elif (folder / SAFETENSORS).is_file():
        files = (folder / SAFETENSORS,)
    else:
        files = tuple(sorted(folder.glob("*.safetensors")))
        if not files and any(folder.glob("pytorch_model*.bin")):
            raise ModelError(
                f"{folder}: has only pytorch_model*.bin weights, which are pickles (they can run code) and are "
                "not loaded. To fix: re-save with save_pretrained(..., safe_serialization=True)."
            )
    return ModelFolder(
        path=folder, config=config, weight_files=files, weight_map=weight_map,
        has_tokenizer=any((folder / f).is_file() for f in TOKENIZER_FILES),
    )
