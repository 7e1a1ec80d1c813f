"""What a run trained, recorded in its run directory, and its export to a Hugging Face folder for inference.

``record_model(run_dir, model, ...)`` (called by ``Trainer.fit`` before launching) writes ``RUN_DIR/model/``:
``config.json`` of the model, ``starverse_base.json`` (the pretrained folder the base weights come from, the
mode and the LoRA settings) and the tokenizer the data was tokenised with (a model's own tokenizer, or the
corpus-trained BPE as a ``PreTrainedTokenizerFast``; raw bytes have no Hugging Face tokenizer).

``export_run(run_dir, out)`` turns the run's ``final_model.pt`` into a folder that
``AutoModelForCausalLM.from_pretrained`` loads: config, safetensors weights, tokenizer. A LoRA run's final
weights hold only the adapters: the base is rebuilt from the referenced folder, the adapters loaded on top
(checked: every adapter tensor must be present), then either merged into the weights (``merge_lora=True``: a
plain model) or written as a ``peft`` adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``,
``base_model_name_or_path`` = the base folder) next to the base's config and tokenizer.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from starverse.errors import ConfigError
from starverse.models.folder import BASE_MODEL_FILE
from starverse.runtime.lora import LoraSettings

log = logging.getLogger(__name__)

MODEL_DIR = "model"
"""Subfolder of the run directory describing the trained model."""
FINAL_WEIGHTS = "final_model.pt"
"""The trained weights rank 0 writes at the end of ``fit`` (adapters only for LoRA)."""


def record_model(run_dir: Path, model: torch.nn.Module, *, tokenizer: Any = None, bpe_file: str | None = None,
                 lora: LoraSettings | None = None, mode: str = "full") -> Path | None:
    """Describe the trained model in ``RUN_DIR/model`` (see the module docstring); None for a non-HF model."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "save_pretrained"):
        return None  # a plain torch module: nothing an inference library could load
    out = run_dir / MODEL_DIR
    out.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(str(out))
    base = str(getattr(cfg, "_name_or_path", "") or "")
    has_base = bool(base) and (Path(base) / "config.json").is_file()
    meta = {"base": str(Path(base).resolve()) if has_base else None, "mode": mode,
            "lora": lora.as_dict() if lora is not None else None}
    (out / BASE_MODEL_FILE).write_text(json.dumps(meta, indent=1))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    elif bpe_file is not None:
        from transformers import PreTrainedTokenizerFast

        from starverse.runtime.data import EOT

        PreTrainedTokenizerFast(tokenizer_file=bpe_file, eos_token=EOT).save_pretrained(str(out))
    return out


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_run` wrote."""

    out: Path
    """The folder."""
    merged: bool
    """True when LoRA adapters were merged into the weights (or there were none)."""
    adapter_only: bool
    """True when the folder holds a peft adapter over ``base`` instead of full weights."""
    base: str | None
    """The pretrained folder the base weights come from (None: trained from scratch)."""
    has_tokenizer: bool
    """True when a tokenizer was written."""
    num_params: int
    """Parameters of the exported model (base and adapters)."""


def _read_meta(run_dir: Path) -> tuple[Path, dict[str, Any], Path]:
    mdir = run_dir / MODEL_DIR
    final = run_dir / FINAL_WEIGHTS
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: not a run directory. To fix: pass the run_dir of a finished `starverse train`.")
    if not (mdir / "config.json").is_file() or not (mdir / BASE_MODEL_FILE).is_file():
        raise ConfigError(f"{run_dir}: no model description ({MODEL_DIR}/config.json); only runs of Hugging Face "
                          "models can be exported. To fix: train a transformers model (model: a config or folder).")
    if not final.is_file():
        raise ConfigError(f"{final}: missing; the run has not finished. To fix: let `starverse train` complete "
                          "(or resume it), then export.")
    return mdir, json.loads((mdir / BASE_MODEL_FILE).read_text()), final


def export_run(run_dir: str | Path, out: str | Path, *, merge_lora: bool = False) -> ExportResult:
    """Write the run's trained model as a Hugging Face folder at ``out`` (see the module docstring)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from starverse.runtime.modeling import build_model

    run = Path(run_dir).resolve()
    mdir, meta, final = _read_meta(run)
    dest = Path(out).resolve()
    if dest.exists() and any(dest.iterdir()):
        raise ConfigError(f"{dest}: exists and is not empty. To fix: pass a new folder to --out.")
    state = torch.load(final, map_location="cpu", weights_only=True)
    base = meta.get("base")
    lora = meta.get("lora")
    if lora is not None and base is None:
        raise ConfigError(f"{run}: LoRA run without a pretrained base folder; nothing to apply the adapters to.")
    if base is not None and not (Path(base) / "config.json").is_file():
        raise ConfigError(f"{run}: the base model {base} is gone. To fix: put the base folder back at that path.")
    model: Any = build_model(base) if base is not None else AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(str(mdir)))
    adapter_only = False
    if lora is not None:
        from peft import get_peft_model

        settings = LoraSettings(int(lora["rank"]), int(lora["alpha"]), tuple(lora["target_modules"]))
        peft_model = get_peft_model(model, settings.peft_config())
        inner = peft_model.base_model.model
        _load_checked(inner, state, final)
        if merge_lora:
            model = peft_model.merge_and_unload()
        else:
            peft_model.save_pretrained(str(dest))
            model, adapter_only = peft_model, True
    else:
        _load_checked(model, state, final)
    if not adapter_only:
        model.save_pretrained(str(dest))
    has_tok = any((mdir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
    for f in mdir.iterdir():
        if f.name != "config.json" and f.name != BASE_MODEL_FILE and f.is_file() and (
                "token" in f.name or f.suffix in (".model", ".txt") or f.name == "vocab.json"):
            shutil.copy2(f, dest / f.name)
    num = sum(p.numel() for p in model.parameters())
    log.info("exported %s to %s (%s parameters)", run, dest, f"{num:,}")
    return ExportResult(dest, lora is None or merge_lora, adapter_only, base, has_tok, num)


def _load_checked(model: torch.nn.Module, state: dict[str, torch.Tensor], source: Path) -> None:
    """Load ``state`` into ``model``: every tensor must fit, and every trainable tensor must be in it."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    trained = set(state)
    if unexpected:
        raise ConfigError(f"{source}: {len(unexpected)} tensor(s) do not belong to the model ({unexpected[0]}, ...). "
                          "To fix: export with the base model the run was trained from.")
    needed = [k for k in missing if ".lora_" in k or not any(".lora_" in t for t in trained)]
    if needed:
        raise ConfigError(f"{source}: {len(needed)} trained tensor(s) missing ({needed[0]}, ...); the file is "
                          "incomplete. To fix: resume the run to its end, then export.")
