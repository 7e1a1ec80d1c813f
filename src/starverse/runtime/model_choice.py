"""Which model ``accelerate()`` builds: the requested config when its training state fits the smallest rank,
else an honest scaled-down copy of the same architecture (never for pretrained weights); generated configs are
saved content-addressed so that a plan can name them by path."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from starverse.errors import ModelError
from starverse.runtime.launch import RankSpec
from starverse.runtime.modeling import WEIGHTS_KEY

log = logging.getLogger(__name__)

TRAIN_BYTES_PER_PARAM = 16
"""fp32 weights + gradients + two Adam moments (mixed precision adds a bf16 copy, ignored here)."""

CPU_MAX_PARAMS = 20_000_000
"""Largest model trained on CPU ranks by default: a step then takes seconds, not hours."""


def memory_per_rank_gb(spec: RankSpec, num_cpu_ranks: int) -> float:
    """Device memory of a GPU rank, or this host's RAM shared by its CPU ranks, GB."""
    if spec.device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_properties(torch.device(spec.device)).total_memory / 1e9
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError):
        total = 16.0
    return total / max(1, num_cpu_ranks)


def save_config(cfg: dict[str, Any]) -> Path:
    """Write a generated model config to the cache (content-addressed) so a plan can name it by path."""
    import hashlib
    import json

    from starverse.runtime.data import cache_dir

    text = json.dumps(cfg, sort_keys=True, indent=1, default=str)
    path = cache_dir() / "models" / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}" / "config.json"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return path


_SMALL_LLAMA: dict[str, Any] = {
    "model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 8192, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu",
}


def model_name(ref: Any) -> str:
    """How a model reference is named in notes and plans."""
    if isinstance(ref, torch.nn.Module):
        cfg = getattr(ref, "config", None)
        return str(getattr(cfg, "_name_or_path", "") or type(ref).__name__)
    return str(ref)


def choose_model(
    model_ref: Any, ranks: tuple[RankSpec, ...], max_params: int | None, mode: str = "full"
) -> tuple[dict[str, Any], int, list[str], bool]:
    """The config to build: the requested one if it fits the smallest rank, else a scaled-down copy.

    A pretrained model (a folder with weights, a ``transformers`` model) is never scaled: its weights only fit
    the model as saved, so one that does not fit is an error.
    """
    from starverse.runtime.modeling import count_params, describe_config, hf_config_dict, scale_config

    if model_ref == "llama":
        cfg = dict(_SMALL_LLAMA)
        return cfg, int(cfg["num_hidden_layers"]), [f"model: small Llama ({describe_config(cfg)})"], False
    cfg = hf_config_dict(model_ref)
    pretrained = WEIGHTS_KEY in cfg or isinstance(model_ref, torch.nn.Module)
    name = model_name(model_ref) if isinstance(model_ref, (str, Path, torch.nn.Module)) else (
        f"the given {cfg.get('model_type')} config")
    n = count_params(cfg)
    num_cpu = sum(1 for r in ranks if r.device == "cpu")
    mem_gb = min(memory_per_rank_gb(r, num_cpu) for r in ranks)
    # lora: the frozen base in the plan's precision (fp32 on CPU ranks, bf16 on GPUs); qlora: 4-bit base
    per_param = {"full": float(TRAIN_BYTES_PER_PARAM), "qlora": 0.6}.get(mode, 4.0 if num_cpu else 2.0)
    limit = int(mem_gb * 1e9 * 0.6 / per_param)  # 40 % left for activations and the runtime
    why = f"its training state needs ~{n * per_param / 1e9:,.0f} GB per rank, the smallest rank has {mem_gb:,.0f} GB"
    if pretrained:
        if n > limit:
            raise ModelError(
                f"model: {name} has {n:,} parameters with pretrained weights and cannot be trained here ({why}); "
                "a pretrained model is not scaled down. To fix: train.mode: lora (or qlora on CUDA), more "
                "devices, or a smaller model."
            )
        if max_params is not None and n > max_params:
            raise ModelError(
                f"model: {name} has {n:,} parameters with pretrained weights, above max_params={max_params:,}; "
                "a pretrained model is not scaled down. To fix: raise or remove max_params."
            )
        layers = next((cfg[k] for k in ("num_hidden_layers", "n_layer", "n_layers") if cfg.get(k)), 1)
        source = "weights from the folder" if WEIGHTS_KEY in cfg else "weights of the given model"
        return cfg, int(layers), [f"model: {name}, pretrained ({source}), {n:,} parameters, mode {mode}"], False
    if any(r.device == "cpu" for r in ranks) and limit > CPU_MAX_PARAMS and max_params is None:
        limit = CPU_MAX_PARAMS
        why = f"CPU ranks train at most {CPU_MAX_PARAMS / 1e6:.0f}M parameters by default (pass max_params= to change)"
    if max_params is not None:
        if max_params < limit:
            why = f"max_params={max_params:,}"
        limit = min(limit, max_params)
    layers = next((cfg[k] for k in ("num_hidden_layers", "n_layer", "n_layers") if cfg.get(k)), 1)
    if n <= limit:
        return cfg, int(layers), [f"model: {name} as requested ({n:,} parameters)"], False
    small = scale_config(cfg, limit)
    m = count_params(small)
    note = (
        f"model: {name} has {n:,} parameters and cannot be trained here ({why}); training a scaled-down copy "
        f"of the same architecture instead: {describe_config(small)}, {m:,} parameters"
    )
    log.info("%s", note)
    small_layers = next((small[k] for k in ("num_hidden_layers", "n_layer", "n_layers") if small.get(k)), 1)
    return small, int(small_layers), [note], True
