"""The model registry: bundled configs by short id or Hugging Face id, or any config.json by path.

``configs/index.json`` maps each short id to its config file and Hugging Face id; each bundled config also
carries its HF id in ``_name_or_path``. Nothing is downloaded: an unknown id is an error with close matches.
"""

from __future__ import annotations

import difflib
import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from starverse.config import read_text_file
from starverse.errors import ConfigError, ModelError
from starverse.models.families import spec_from_config
from starverse.models.folder import inspect_folder
from starverse.models.spec import ModelSpec

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
INDEX_FILE = CONFIG_DIR / "index.json"


@functools.lru_cache(maxsize=1)
def _index() -> dict[str, dict[str, Any]]:
    """Short id -> {"file": ..., "hf_id": ..., "aliases": [...]} (bundled, read once)."""
    data = json.loads(INDEX_FILE.read_text())
    return dict(data["models"])


@functools.lru_cache(maxsize=1)
def _lookup() -> dict[str, str]:
    """Lower-cased short id, HF id or alias -> short id."""
    table: dict[str, str] = {}
    for short, entry in _index().items():
        for key in (short, entry.get("hf_id"), *entry.get("aliases", ())):
            if key:
                table[key.lower()] = short
    return table


@functools.cache
def _bundled(short: str) -> ModelSpec:
    entry = _index()[short]
    path = CONFIG_DIR / entry["file"]
    raw = _read_json(path)
    spec = spec_from_config(raw, str(path), short)
    if entry.get("hf_id") and spec.hf_id != entry["hf_id"]:
        # the index and the config must agree; a mismatch is a packaging bug, not a user error
        raise RuntimeError(f"{path}: _name_or_path {spec.hf_id!r} != index hf_id {entry['hf_id']!r}")
    return spec


def _read_json(path: Path) -> Any:
    try:  # not a folder, a device read forever, a symlink loop or a binary file
        text = read_text_file(path, "a model's config.json")
    except ConfigError as e:
        raise ModelError(str(e)) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ModelError(f"{path}:{e.lineno}: malformed JSON: {e.msg}") from None
    except (ValueError, RecursionError) as e:  # a number beyond 4300 digits; nesting deeper than Python's stack
        raise ModelError(f"{path}: malformed JSON: {str(e).split(';')[0] or type(e).__name__}") from None


def _from_path(path: Path) -> ModelSpec:
    if path.is_dir():
        folder = inspect_folder(path)  # a folder without config.json says so, not "file not found"
        return spec_from_config(folder.config, str(folder.path / "config.json"), folder.path.name)
    raw = _read_json(path)
    name = path.parent.name if path.stem == "config" else path.stem
    return spec_from_config(raw, str(path), name)


def _unknown(ref: str) -> ModelError:
    known = sorted(_lookup())
    close = difflib.get_close_matches(ref.lower(), known, n=4, cutoff=0.6)
    shorts = list(dict.fromkeys(_lookup()[c] for c in close))[:3]
    # answer in the form asked: HF ids (properly cased) for an HF-style ref, short ids otherwise
    ids = [(_index()[s].get("hf_id") or s) if "/" in ref else s for s in shorts]
    hint = f"did you mean {', '.join(repr(i) for i in ids)}? " if ids else ""
    return ModelError(
        f"unknown model '{ref}'; {hint}`starverse models` lists the bundled ids; otherwise pass a path to a "
        "Hugging Face config.json (nothing is downloaded)"
    )


def load_model(ref: str | Path | Any, base_dir: str | Path | None = None) -> ModelSpec:
    """A ModelSpec from a short id, a Hugging Face id, a path to a config.json, or a PretrainedConfig.

    ``base_dir``: directory that a relative path is relative to (the plan file's). A transformers
    ``PretrainedConfig`` (anything with ``to_dict()``) is read without importing torch. Raises ModelError for
    unknown ids (with close matches) and unsupported or malformed configs.
    """
    if isinstance(ref, ModelSpec):
        return ref
    if not isinstance(ref, str | Path) and callable(getattr(ref, "to_dict", None)):
        raw = ref.to_dict()
        name = str(raw.get("_name_or_path") or raw.get("model_type") or type(ref).__name__)
        return spec_from_config(raw, f"<{type(ref).__name__}>", _lookup().get(name.lower(), name))
    if isinstance(ref, Mapping):
        return spec_from_config(ref, "<config dict>", str(ref.get("_name_or_path") or ref.get("model_type")))
    if not isinstance(ref, str | Path):
        raise ModelError(
            f"cannot load a model from {type(ref).__name__}; pass a model id, a path to a config.json or a "
            "transformers PretrainedConfig"
        )
    text = str(ref)
    if isinstance(ref, str):
        short = _lookup().get(text.strip().lower())
        if short is not None:
            return _bundled(short)
    path = Path(text).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    if path.exists():
        return _from_path(path)
    if isinstance(ref, Path) or text.endswith(".json") or "/" in text.rstrip("/").split("/", 1)[-1]:
        # clearly meant as a file (a .json name, or a path deeper than an HF "org/name" id)
        raise ModelError(f"{path}: file not found; pass an existing config.json or a model id (`starverse models`)")
    raise _unknown(text)


def list_models() -> list[ModelSpec]:
    """Every bundled model, in index order."""
    return [_bundled(short) for short in _index()]


def bundled_ids() -> dict[str, str | None]:
    """Short id -> Hugging Face id of every bundled model."""
    return {short: entry.get("hf_id") for short, entry in _index().items()}
