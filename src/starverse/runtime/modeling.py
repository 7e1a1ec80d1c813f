"""Build a causal LM from a registry config (or an honest scaled-down copy of one), with no weights downloaded.

``build_model(config)`` takes a registry id / Hugging Face id / config.json path (through
``starverse.models.load_model``), a ``ModelSpec``, a ``transformers.PretrainedConfig`` or a config dict,
and builds the ``transformers`` causal-LM class for it with freshly initialised weights.

``scale_config`` makes a smaller model *of the same architecture* (same family, attention layout,
MLP type, norm, position encoding, tied embeddings; fewer and narrower layers, a smaller vocabulary)
for devices the full model does not fit on. The cluster says when it did this, never silently.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from starverse.errors import ConfigError, ModelError
from starverse.models.folder import inspect_folder, is_model_folder
from starverse.runtime.lora import apply_mode
from starverse.runtime.pretrained import load_weights, weights_dtype

log = logging.getLogger(__name__)

_ALIASES: dict[str, tuple[str, ...]] = {
    "layers": ("num_hidden_layers", "n_layer", "n_layers", "num_layers"),
    "hidden": ("hidden_size", "n_embd", "d_model"),
    "heads": ("num_attention_heads", "n_head", "n_heads"),
    "kv_heads": ("num_key_value_heads", "num_kv_heads", "multi_query_group_num"),
    "ffn": ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size"),
    "positions": ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"),
    "experts": ("num_local_experts", "num_experts"),
}

# (layers, hidden) rungs for scaled copies; head_dim 64 throughout (the common choice of the families).
_LADDER = ((2, 128), (4, 256), (6, 384), (8, 512), (12, 768), (16, 1024), (24, 1536), (24, 2048), (32, 2560))


def _get(cfg: Mapping[str, Any], what: str) -> tuple[str | None, Any]:
    for key in _ALIASES[what]:
        if cfg.get(key) is not None:
            return key, cfg[key]
    return None, None


WEIGHTS_KEY = "_starverse_weights"
"""Key of a model config dict (``Cluster.model_config``) naming the model folder whose weights ``build_model``
loads; scaled-down copies drop it (their shapes differ), so only the model as saved ever loads them."""


def hf_config_dict(config: Any) -> dict[str, Any]:
    """The Hugging Face config dict of ``config`` (id/path/folder, ModelSpec, PretrainedConfig, model or dict).

    A model folder with weights gives its config plus :data:`WEIGHTS_KEY` (so ``build_model`` loads them).
    """
    if isinstance(config, Mapping):
        return dict(config)
    model_cfg: Any = getattr(config, "config", None) if isinstance(config, torch.nn.Module) else None
    if model_cfg is not None and hasattr(model_cfg, "to_dict"):
        return dict(model_cfg.to_dict())
    if is_model_folder(config):
        folder = inspect_folder(config)
        cfg = dict(folder.config)
        if folder.has_weights:
            cfg[WEIGHTS_KEY] = str(folder.path)
        return cfg
    if hasattr(config, "hf_config"):
        return dict(config.hf_config)
    if hasattr(config, "to_dict") and hasattr(config, "model_type"):
        return dict(config.to_dict())
    if isinstance(config, str) or hasattr(config, "__fspath__"):
        try:
            from starverse.models import load_model
        except ImportError as e:  # the registry is a separate part of the package
            raise ModelError(f"cannot resolve model {str(config)!r}: the model registry is unavailable ({e}).") from None
        return dict(load_model(config).hf_config)
    raise ModelError(f"cannot build a model from {type(config).__name__}; pass a model id, ModelSpec, config or dict.")


def _to_pretrained(cfg: Mapping[str, Any]) -> Any:
    from transformers import AutoConfig

    from starverse.models import estimate_only

    model_type = cfg.get("model_type")
    if not model_type:
        raise ModelError("the model config has no 'model_type'; cannot pick the transformers class.")
    reason = estimate_only(model_type)
    if reason:
        raise ModelError(f"{reason}.")
    drop = ("model_type", "architectures", "transformers_version", WEIGHTS_KEY)
    fields = {k: v for k, v in cfg.items() if k not in drop}
    try:
        return AutoConfig.for_model(model_type, **fields)
    except ValueError as e:
        raise ModelError(f"transformers does not know model_type {model_type!r}: {e}") from None


@contextlib.contextmanager
def _collector_off() -> Iterator[None]:
    """The garbage collector off for a block that first imports transformers (its model classes: ~10^5 objects, no
    garbage; the collector's walks over them were ~15 % of the import's CPU); as it was afterwards."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def count_params(config: Any) -> int:
    """Parameters of the model ``config`` describes.

    A config of a family the model registry reads (:data:`starverse.models.FAMILIES`, by ``model_type``) is
    counted from its shapes (:attr:`~starverse.models.ModelSpec.num_params`, equal to what transformers builds:
    tested for every bundled config and its scaled copies), without importing transformers (seconds of CPU
    when a job is checked, before anything builds the model). Any other config is built on the meta device (no
    memory, no init) and counted.
    """
    from starverse.models import FAMILIES, spec_from_config

    cfg = hf_config_dict(config)
    if cfg.get("model_type") in FAMILIES:
        try:
            return spec_from_config({k: v for k, v in cfg.items() if k != WEIGHTS_KEY}, "model config", "").num_params
        except ModelError:
            pass  # let transformers say what is wrong with it, as before
    return count_built_params(cfg)


def count_built_params(config: Any) -> int:
    """Parameters of the model ``config`` describes, built with transformers on the meta device."""
    from transformers import AutoModelForCausalLM

    pcfg = _to_pretrained(hf_config_dict(config))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(pcfg)
    return sum(p.numel() for p in model.parameters())


def model_modules(config: Any) -> list[str]:
    """The ``transformers`` modules a process imports to build (or unpickle) the model ``config`` describes, by the
    library's layout (``transformers.models.<type>.modeling_<type>``), without importing it; for a fork server's
    preload, which skips a name that does not import."""
    model_type = str(hf_config_dict(config).get("model_type") or "").replace("-", "_")
    if not model_type.isidentifier():
        return []
    return ["transformers.modeling_utils", f"transformers.models.{model_type}.modeling_{model_type}"]


def scale_config(config: Any, max_params: int, vocab_size: int = 8192, max_positions: int = 2048) -> dict[str, Any]:
    """A same-architecture copy of ``config`` with at most ``max_params`` parameters (largest rung that fits).

    Keeps the family and every architectural switch; sets layers/hidden from a fixed ladder (head_dim
    64), scales the MLP width and the KV-head count by the original ratios (at least as many query heads as
    the grouped-query ratio, with narrower heads if needed), caps the vocabulary at
    ``vocab_size`` and positions at ``max_positions``, and at most 4 experts (same top-k) for MoE models.
    """
    cfg = hf_config_dict(config)
    _, layers0 = _get(cfg, "layers")
    _, hidden0 = _get(cfg, "hidden")
    _, heads0 = _get(cfg, "heads")
    if not (layers0 and hidden0 and heads0):
        raise ModelError("cannot scale this config: it has no recognisable layer/hidden/head sizes.")
    best: dict[str, Any] | None = None
    for layers, hidden in _LADDER:
        if layers > layers0 or hidden > hidden0:
            break
        cand = _scaled(cfg, layers, hidden, vocab_size, max_positions)
        if count_params(cand) > max_params:
            break
        best = cand
    if best is None:
        raise ModelError(
            f"even the smallest copy of this model ({_LADDER[0][0]} layers, hidden {_LADDER[0][1]}) has more than "
            f"{max_params:,} parameters. To fix: raise max_params."
        )
    return best


def _scaled(cfg: dict[str, Any], layers: int, hidden: int, vocab: int, positions: int) -> dict[str, Any]:
    out = {k: v for k, v in cfg.items() if k != WEIGHTS_KEY}  # other shapes: the saved weights do not apply
    _, hidden0 = _get(cfg, "hidden")
    _, heads0 = _get(cfg, "heads")
    heads = max(1, hidden // 64)
    kvkey, kv0 = _get(cfg, "kv_heads")
    ratio = max(1, heads0 // kv0) if kvkey is not None and kv0 else 1
    # Keep the grouped-query ratio: at least `ratio` query heads (narrower heads if needed).
    if ratio > heads and hidden % ratio == 0:
        heads = ratio
    for key in _ALIASES["layers"]:
        if key in cfg:
            out[key] = layers
    for key in _ALIASES["hidden"]:
        if key in cfg:
            out[key] = hidden
    for key in _ALIASES["heads"]:
        if key in cfg:
            out[key] = heads
    if kvkey is not None and kv0:
        out[kvkey] = max(1, heads // ratio)
    ffnkey, ffn0 = _get(cfg, "ffn")
    if ffnkey is not None and ffn0:
        out[ffnkey] = round(hidden * ffn0 / hidden0 / 8) * 8 or hidden * 4
    if "head_dim" in cfg and cfg.get("head_dim"):
        out["head_dim"] = hidden // heads
    if "word_embed_proj_dim" in cfg:
        out["word_embed_proj_dim"] = hidden
    for key in _ALIASES["positions"]:
        if key in cfg and isinstance(cfg[key], int):
            out[key] = min(cfg[key], positions)
    if cfg.get("vocab_size"):
        out["vocab_size"] = min(int(cfg["vocab_size"]), vocab)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
        if isinstance(out.get(key), int) and out[key] >= out.get("vocab_size", 1 << 30):
            out[key] = 0
    ekey, experts0 = _get(cfg, "experts")
    if ekey is not None and experts0:
        out[ekey] = min(int(experts0), 4)
    # Layer-type lists (Qwen2 sliding windows, Falcon alternation) must match the new depth.
    if isinstance(cfg.get("layer_types"), list):
        out["layer_types"] = list(cfg["layer_types"])[:layers]
    if "max_window_layers" in cfg and isinstance(cfg["max_window_layers"], int):
        out["max_window_layers"] = min(cfg["max_window_layers"], layers)
    return out


def describe_config(config: Any) -> str:
    """``llama: 4 layers, hidden 256, 4 heads (4 KV), MLP 688, vocab 8192`` (for logs and summaries)."""
    cfg = hf_config_dict(config)
    _, layers = _get(cfg, "layers")
    _, hidden = _get(cfg, "hidden")
    _, heads = _get(cfg, "heads")
    _, kv = _get(cfg, "kv_heads")
    _, ffn = _get(cfg, "ffn")
    parts = [f"{cfg.get('model_type', '?')}: {layers} layers, hidden {hidden}, {heads} heads"]
    if kv:
        parts[-1] += f" ({kv} KV)"
    if ffn:
        parts.append(f"MLP {ffn}")
    parts.append(f"vocab {cfg.get('vocab_size')}")
    return ", ".join(parts)


def build_model(
    config: Any, *, seed: int = 0, dtype: torch.dtype | None = None, attn_implementation: str = "sdpa"
) -> torch.nn.Module:
    """A ``transformers`` causal LM for ``config``: pretrained weights when it names them, else freshly initialised.

    ``config``: a model folder (``save_pretrained`` output: its safetensors are loaded, checked against its
    config.json), a ``Cluster`` (its model in the dtype of its plan's mode, with LoRA adapters for lora/qlora),
    a ``transformers`` model (returned as is, cast to ``dtype`` if given), a registry id / HF id / config.json path, a ``ModelSpec``,
    a ``PretrainedConfig`` or a dict. Nothing is downloaded. Initialisation is seeded (``seed``), so the
    same call gives the same weights everywhere. ``dtype``: None is fp32 (for a Cluster: the dtype its plan's
    mode keeps weights in, see :func:`~starverse.runtime.pretrained.weights_dtype`). ``attn_implementation``:
    ``sdpa`` (fused kernels where the device has them) falls back to ``eager`` for families without it.
    """
    from transformers import AutoModelForCausalLM

    if isinstance(config, torch.nn.Module):
        return config.to(dtype) if dtype is not None else config
    if hasattr(config, "model_config") and hasattr(config, "plan"):  # a Cluster: its model, ready for its mode
        train = config.plan.train
        given = config.pretrained_model
        model = build_model(given if given is not None else config.model_config, seed=seed,
                            dtype=dtype or (None if given is not None else weights_dtype(train.mode, train.precision)),
                            attn_implementation=attn_implementation)
        apply_mode(model, train.mode, train.lora_rank, [r.device for r in config.ranks], "plan")
        return model
    dtype = dtype or torch.float32
    cfg = hf_config_dict(config)
    state = torch.random.get_rng_state()
    try:
        with _collector_off():
            pcfg = _to_pretrained(cfg)
            torch.manual_seed(seed)
            try:
                model = AutoModelForCausalLM.from_config(pcfg, dtype=dtype, attn_implementation=attn_implementation)
            except ValueError:
                if attn_implementation == "eager":
                    raise
                torch.manual_seed(seed)
                model = AutoModelForCausalLM.from_config(pcfg, dtype=dtype, attn_implementation="eager")
    except (ValueError, TypeError) as e:
        raise ConfigError(f"transformers cannot build {cfg.get('model_type')!r} from this config: {e}") from None
    finally:
        torch.random.set_rng_state(state)
    weights = cfg.get(WEIGHTS_KEY)
    if weights:
        load_weights(model, weights)
        model.config._name_or_path = str(weights)  # the base a LoRA run's adapters and exports refer to
    log.info("built %s (%s params, %s)", describe_config(cfg), f"{sum(p.numel() for p in model.parameters()):,}",
             f"weights from {weights}" if weights else "freshly initialised")
    return model
