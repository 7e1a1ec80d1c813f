"""Hugging Face ``config.json`` -> :class:`ModelSpec`, one reader per family.

Defaults for keys a config omits are those of the matching ``transformers`` config class (5.x), so that a
partial config means here what it means to ``AutoConfig``; the unit tests build every bundled config with
transformers on the meta device and compare parameter counts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from starverse.errors import ModelError
from starverse.models.spec import ESTIMATE_ONLY_FAMILIES, FAMILIES, ModelSpec

Reader = Callable[[Mapping[str, Any], str], ModelSpec]

MAX_CONFIG_INT = 1 << 27
"""Largest size a config may give (134,217,728 positions; hidden sizes, vocabularies are far smaller): the cost
model multiplies them and the runtime allocates them."""
MAX_LAYERS = 1 << 14
"""Most layers (16,384; the largest published models have ~130); the planner enumerates their divisors."""


class _Cfg:
    """Typed access to a config dict with the family's defaults; errors name the key and the file."""

    def __init__(self, raw: Mapping[str, Any], where: str):
        self.raw = raw
        self.where = where

    def get(self, *keys: str, default: Any = None) -> Any:
        """First present key among ``keys`` (aliases), else ``default``."""
        for k in keys:
            if k in self.raw and self.raw[k] is not None:
                return self.raw[k]
        return default

    def required(self, key: str) -> Any:
        """A field the family has no default for; ModelError if missing."""
        value = self.get(key)
        if value is None:
            raise ModelError(f"{self.where}: required key '{key}' is missing")
        return value

    def int(self, *keys: str, default: int | None = None, positive: bool = True) -> int:
        """An integer field (> 0 unless ``positive=False``); ModelError if missing and without default."""
        value = self.get(*keys, default=default)
        if value is None:
            raise ModelError(f"{self.where}: required key '{keys[0]}' is missing")
        if isinstance(value, bool) or not isinstance(value, int):
            raise ModelError(f"{self.where}: {keys[0]} must be an integer (got {value!r})")
        if positive and value <= 0:
            raise ModelError(f"{self.where}: {keys[0]} must be > 0 (got {value})")
        bound = MAX_LAYERS if "layer" in keys[0] else MAX_CONFIG_INT
        if value > bound:
            got = f"{value:,}" if value < 10**18 else f"a {len(str(value))}-digit number"
            raise ModelError(f"{self.where}: {keys[0]} must be at most {bound:,} (got {got})")
        return value

    def bool(self, *keys: str, default: bool) -> bool:
        """A boolean field."""
        value = self.get(*keys, default=default)
        if not isinstance(value, bool):
            raise ModelError(f"{self.where}: {keys[0]} must be true or false (got {value!r})")
        return value


def _heads(c: _Cfg, hidden: int, heads: int, kv_key: str | None, kv_default: int | None) -> tuple[int, int]:
    kv = c.int(kv_key, default=kv_default if kv_default is not None else heads) if kv_key else heads
    if heads % kv:
        raise ModelError(f"{c.where}: {kv_key} ({kv}) must divide the number of attention heads ({heads})")
    head_dim = c.int("head_dim", default=hidden // heads)
    return kv, head_dim


def _check_divisible(c: _Cfg, hidden: int, heads: int, what: str) -> None:
    if hidden % heads:
        raise ModelError(f"{c.where}: {what} ({hidden}) is not divisible by the number of heads ({heads})")


def _spec(raw: Mapping[str, Any], family: str, hidden: int, heads: int, bias: bool, **fields: Any) -> ModelSpec:
    """A ModelSpec whose fields default to the common case; ``fields`` state what a family changes.

    Defaults: multi-head attention (as many KV heads as heads, head_dim = hidden / heads), a dense
    non-gated MLP, LayerNorm, and ``bias`` on the QKV, attention-output and MLP projections.
    """
    common: dict[str, Any] = {
        "name": "",
        "family": family,
        "hidden_size": hidden,
        "num_heads": heads,
        "num_kv_heads": heads,
        "head_dim": hidden // heads,
        "gated_mlp": False,
        "num_experts": 0,
        "experts_per_token": 0,
        "norm": "layernorm",
        "qkv_bias": bias,
        "attn_out_bias": bias,
        "mlp_bias": bias,
        "hf_config": raw,
    }
    return ModelSpec(**{**common, **fields})


class _Defaults(NamedTuple):
    """Defaults of a transformers config class for keys a config.json may omit."""

    vocab: int
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv: int | None  # None: as many as attention heads
    positions: int


_LLAMA_DEFAULTS = {
    "llama": _Defaults(vocab=32000, hidden=4096, ffn=11008, layers=32, heads=32, kv=None, positions=2048),
    "mistral": _Defaults(vocab=32000, hidden=4096, ffn=14336, layers=32, heads=32, kv=8, positions=4096 * 32),
    "mixtral": _Defaults(vocab=32000, hidden=4096, ffn=14336, layers=32, heads=32, kv=8, positions=4096 * 32),
    "qwen2": _Defaults(vocab=151936, hidden=4096, ffn=22016, layers=32, heads=32, kv=32, positions=32768),
}


def _llama_like(raw: Mapping[str, Any], where: str, family: str) -> ModelSpec:
    """llama, mistral, mixtral, qwen2: RMSNorm, RoPE, SwiGLU, GQA."""
    c = _Cfg(raw, where)
    d = _LLAMA_DEFAULTS[family]
    hidden = c.int("hidden_size", default=d.hidden)
    heads = c.int("num_attention_heads", default=d.heads)
    kv, head_dim = _heads(c, hidden, heads, "num_key_value_heads", d.kv)
    experts = c.int("num_local_experts", "num_experts", default=8) if family == "mixtral" else 0
    top_k = c.int("num_experts_per_tok", default=2) if family == "mixtral" else 0
    if experts and top_k > experts:
        raise ModelError(f"{where}: num_experts_per_tok ({top_k}) exceeds num_local_experts ({experts})")
    qkv_bias = True if family == "qwen2" else (family == "llama" and c.bool("attention_bias", default=False))
    out_bias = family == "llama" and c.bool("attention_bias", default=False)
    mlp_bias = family == "llama" and c.bool("mlp_bias", default=False)
    return _spec(
        raw,
        family,
        hidden,
        heads,
        qkv_bias,
        num_layers=c.int("num_hidden_layers", default=d.layers),
        num_kv_heads=kv,
        head_dim=head_dim,
        ffn_hidden_size=c.int("intermediate_size", default=d.ffn),
        vocab_size=c.int("vocab_size", default=d.vocab),
        max_seq_len=c.int("max_position_embeddings", default=d.positions),
        gated_mlp=True,
        num_experts=experts,
        experts_per_token=top_k,
        tie_embeddings=c.bool("tie_word_embeddings", default=False),
        position="rope",
        norm="rmsnorm",
        attn_out_bias=out_bias,
        mlp_bias=mlp_bias,
        norm_params_per_layer=2 * hidden,
        other_params=hidden,  # final RMSNorm
    )


def _gpt2(raw: Mapping[str, Any], where: str) -> ModelSpec:
    """GPT-2 (and Megatron "gpt" configs written as gpt2): LayerNorm, learned positions, GELU MLP, biases."""
    c = _Cfg(raw, where)
    hidden = c.int("n_embd", "hidden_size", default=768)
    heads = c.int("n_head", "num_attention_heads", default=12)
    _check_divisible(c, hidden, heads, "n_embd")
    if c.bool("add_cross_attention", default=False):
        raise ModelError(f"{where}: add_cross_attention: encoder-decoder GPT-2 is not supported (decoder-only)")
    positions = c.int("n_positions", "max_position_embeddings", default=1024)
    return _spec(
        raw,
        "gpt2",
        hidden,
        heads,
        True,
        num_layers=c.int("n_layer", "num_hidden_layers", default=12),
        ffn_hidden_size=c.int("n_inner", default=4 * hidden),
        vocab_size=c.int("vocab_size", default=50257),
        max_seq_len=positions,
        tie_embeddings=c.bool("tie_word_embeddings", default=True),
        position="learned",
        num_positions=positions,
        norm_params_per_layer=4 * hidden,
        other_params=2 * hidden,  # ln_f
    )


def _gpt_neox(raw: Mapping[str, Any], where: str) -> ModelSpec:
    """GPT-NeoX / Pythia: LayerNorm, partial RoPE, GELU MLP with biases, parallel residual."""
    c = _Cfg(raw, where)
    hidden = c.int("hidden_size", default=6144)
    heads = c.int("num_attention_heads", default=64)
    _check_divisible(c, hidden, heads, "hidden_size")
    bias = c.bool("attention_bias", default=True)
    return _spec(
        raw,
        "gpt_neox",
        hidden,
        heads,
        bias,
        num_layers=c.int("num_hidden_layers", default=44),
        ffn_hidden_size=c.int("intermediate_size", default=24576),
        vocab_size=c.int("vocab_size", default=50432),
        max_seq_len=c.int("max_position_embeddings", default=2048),
        tie_embeddings=c.bool("tie_word_embeddings", default=False),
        position="rope",
        mlp_bias=True,  # transformers' GPT-NeoX MLP always has biases
        norm_params_per_layer=4 * hidden,
        other_params=2 * hidden,
        parallel_attn_mlp=c.bool("use_parallel_residual", default=True),
    )


def _opt(raw: Mapping[str, Any], where: str) -> ModelSpec:
    """OPT: LayerNorm, learned positions (2 extra rows), ReLU MLP, biases, optional embedding projection."""
    c = _Cfg(raw, where)
    hidden = c.int("hidden_size", default=768)
    heads = c.int("num_attention_heads", default=12)
    _check_divisible(c, hidden, heads, "hidden_size")
    emb = c.int("word_embed_proj_dim", default=hidden)
    bias = c.bool("enable_bias", default=True)
    affine = c.bool("layer_norm_elementwise_affine", default=True)
    ln = 2 * hidden if affine else 0
    final_ln = c.bool("do_layer_norm_before", default=True) and not c.bool(
        "_remove_final_layer_norm", default=False
    )
    projections = 2 * hidden * emb if emb != hidden else 0
    positions = c.int("max_position_embeddings", default=2048)
    return _spec(
        raw,
        "opt",
        hidden,
        heads,
        bias,
        num_layers=c.int("num_hidden_layers", default=12),
        ffn_hidden_size=c.int("ffn_dim", default=3072),
        vocab_size=c.int("vocab_size", default=50272),
        max_seq_len=positions,
        tie_embeddings=c.bool("tie_word_embeddings", default=True),
        position="learned",
        # OPT's learned position table has 2 extra rows (ids are offset by 2 for the padding convention)
        num_positions=positions + 2,
        norm_params_per_layer=2 * ln,
        other_params=(ln if final_ln else 0) + projections,
        embedding_dim=emb if emb != hidden else 0,
    )


def _bloom(raw: Mapping[str, Any], where: str) -> ModelSpec:
    """BLOOM: LayerNorm (plus one after the embedding), ALiBi, GELU MLP 4h, biases."""
    c = _Cfg(raw, where)
    hidden = c.int("hidden_size", "n_embed", default=64)
    heads = c.int("n_head", "num_attention_heads", default=8)
    _check_divisible(c, hidden, heads, "hidden_size")
    return _spec(
        raw,
        "bloom",
        hidden,
        heads,
        True,
        num_layers=c.int("n_layer", "num_hidden_layers", default=2),
        ffn_hidden_size=4 * hidden,  # fixed in BLOOM's architecture (no config key)
        vocab_size=c.int("vocab_size", default=250880),
        max_seq_len=c.int("seq_length", "max_position_embeddings", default=2048),
        tie_embeddings=c.bool("tie_word_embeddings", default=True),
        position="alibi",
        norm_params_per_layer=4 * hidden,
        other_params=4 * hidden,  # word_embeddings_layernorm + ln_f
    )


def _mpt(raw: Mapping[str, Any], where: str) -> ModelSpec:
    """MPT (MosaicML llm-foundry): LayerNorm without bias, ALiBi, GELU MLP of expansion_ratio * d."""
    c = _Cfg(raw, where)
    hidden = c.int("d_model", "hidden_size", default=2048)
    heads = c.int("n_heads", "num_attention_heads", default=16)
    _check_divisible(c, hidden, heads, "d_model")
    attn = raw.get("attn_config") or {}
    if not isinstance(attn, Mapping):
        raise ModelError(f"{where}: attn_config must be a mapping (got {attn!r})")
    alibi = attn.get("alibi", True)
    if alibi is not True:
        raise ModelError(
            f"{where}: attn_config.alibi: only ALiBi MPT models are supported (transformers' MPT has no "
            "learned positions); set alibi: true"
        )
    kv = attn.get("kv_n_heads") or heads
    if attn.get("attn_type", "multihead_attention") != "multihead_attention" or kv != heads:
        raise ModelError(
            f"{where}: attn_config.attn_type: only multihead_attention MPT models are supported "
            "(grouped/multi-query MPT is not in transformers)"
        )
    ratio = c.get("expansion_ratio", default=4)
    if not isinstance(ratio, int | float) or ratio <= 0 or (ratio * hidden) % 1:
        raise ModelError(f"{where}: expansion_ratio must be a positive number (got {ratio!r})")
    bias = not c.bool("no_bias", default=True)
    # LayerNorms carry a bias only when the model has biases (llm-foundry's low_precision_layernorm)
    ln = hidden * (2 if bias else 1)
    return _spec(
        raw,
        "mpt",
        hidden,
        heads,
        bias,
        num_layers=c.int("n_layers", "num_hidden_layers", default=24),
        ffn_hidden_size=int(ratio * hidden),
        vocab_size=c.int("vocab_size", default=50368),
        max_seq_len=c.int("max_seq_len", default=2048),
        tie_embeddings=c.bool("tie_word_embeddings", default=True),
        position="alibi",
        norm_params_per_layer=2 * ln,
        other_params=ln,
    )


def _falcon(raw: Mapping[str, Any], where: str) -> ModelSpec:
    """Falcon: LayerNorm, RoPE or ALiBi, multi-query / grouped attention, parallel attention + MLP."""
    c = _Cfg(raw, where)
    hidden = c.int("hidden_size", "n_embed", default=4544)
    heads = c.int("num_attention_heads", "n_head", default=71)
    _check_divisible(c, hidden, heads, "hidden_size")
    new_arch = c.bool("new_decoder_architecture", default=False)
    multi_query = c.bool("multi_query", default=True)
    parallel = c.bool("parallel_attn", default=True)
    if new_arch:
        kv = c.int("num_kv_heads", "n_head_kv", default=heads)
    elif multi_query:
        kv = 1
    else:
        kv = heads
    if heads % kv:
        raise ModelError(f"{where}: num_kv_heads ({kv}) must divide num_attention_heads ({heads})")
    bias = c.bool("bias", default=False)
    num_ln = c.get("num_ln_in_parallel_attn", default=2 if new_arch else None)
    # sequential blocks have 2 norms; parallel ones 1, or 2 (ln_attn, ln_mlp) in the new architecture
    norms = 2 if not parallel or (new_arch and num_ln == 2) else 1
    return _spec(
        raw,
        "falcon",
        hidden,
        heads,
        bias,
        num_layers=c.int("num_hidden_layers", "n_layer", default=32),
        num_kv_heads=kv,
        ffn_hidden_size=c.int("ffn_hidden_size", default=4 * hidden),
        vocab_size=c.int("vocab_size", default=65024),
        max_seq_len=c.int("max_position_embeddings", default=2048),
        tie_embeddings=c.bool("tie_word_embeddings", default=True),
        position="alibi" if c.bool("alibi", default=False) else "rope",
        norm_params_per_layer=norms * 2 * hidden,
        other_params=2 * hidden,
        parallel_attn_mlp=parallel,
    )


MAXTEXT_DECODER_BLOCKS = {"default": True, "llama2": False}
"""MaxText ``decoder_block`` values read, and whether attention and MLP run in parallel from one norm
(``layers/models.py`` ``DecoderLayer``) or one after the other with a norm each (``layers/llama2.py``)."""


def _maxtext(raw: Mapping[str, Any], where: str) -> ModelSpec:
    """A model as MaxText configures it (``model_type: maxtext``, estimates only): the keys of its ``base.yml`` as
    ``pyconfig`` resolves them — ``emb_dim``, ``num_query_heads``, ``num_kv_heads``, ``head_dim``, ``mlp_dim``,
    ``num_decoder_layers``, ``vocab_size``, ``max_target_length``, ``mlp_activations`` (one: a two-matrix MLP;
    two: gated), ``logits_via_embedding`` (tied head), ``decoder_block`` (:data:`MAXTEXT_DECODER_BLOCKS`) and
    ``dropout_rate``; required, since base.yml's defaults changed between MaxText's versions, except
    ``num_kv_heads`` (the query heads), ``max_target_length`` (2048) and ``logits_via_embedding`` (false).
    RMSNorm with a scale only, no biases, rotary positions. Not counted: the QK norms and T5 relative position
    biases of MaxText's 2023 default block (2 x head_dim + 32 x heads values per layer)."""
    c = _Cfg(raw, where)
    hidden = c.int("emb_dim")
    heads = c.int("num_query_heads")
    kv, _ = _heads(c, hidden, heads, "num_kv_heads", None)
    head_dim = c.int("head_dim")
    block = c.required("decoder_block")
    if block not in MAXTEXT_DECODER_BLOCKS:
        raise ModelError(f"{where}: decoder_block {block!r} is not read; read: {', '.join(MAXTEXT_DECODER_BLOCKS)}")
    parallel = MAXTEXT_DECODER_BLOCKS[block]
    acts = c.required("mlp_activations")
    if not isinstance(acts, list) or len(acts) not in (1, 2) or not all(isinstance(a, str) for a in acts):
        raise ModelError(f"{where}: mlp_activations must be a list of one or two activation names (got {acts!r})")
    return _spec(
        raw,
        "maxtext",
        hidden,
        heads,
        False,
        num_layers=c.int("num_decoder_layers"),
        num_kv_heads=kv,
        head_dim=head_dim,
        ffn_hidden_size=c.int("mlp_dim"),
        vocab_size=c.int("vocab_size"),
        max_seq_len=c.int("max_target_length", default=2048),
        gated_mlp=len(acts) == 2,
        tie_embeddings=c.bool("logits_via_embedding", default=False),
        position="rope",
        norm="rmsnorm",
        norm_params_per_layer=(1 if parallel else 2) * hidden,
        other_params=hidden,  # decoder_norm
        parallel_attn_mlp=parallel,
    )


READERS: dict[str, Reader] = {
    "llama": lambda raw, where: _llama_like(raw, where, "llama"),
    "mistral": lambda raw, where: _llama_like(raw, where, "mistral"),
    "mixtral": lambda raw, where: _llama_like(raw, where, "mixtral"),
    "qwen2": lambda raw, where: _llama_like(raw, where, "qwen2"),
    "gpt2": _gpt2,
    "gpt_neox": _gpt_neox,
    "opt": _opt,
    "bloom": _bloom,
    "mpt": _mpt,
    "falcon": _falcon,
    "maxtext": _maxtext,
}

# HF configs written before model_type existed name the family in "architectures" only
_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mixtral",
    "Qwen2ForCausalLM": "qwen2",
    "GPT2LMHeadModel": "gpt2",
    "GPTNeoXForCausalLM": "gpt_neox",
    "OPTForCausalLM": "opt",
    "BloomForCausalLM": "bloom",
    "MPTForCausalLM": "mpt",
    "MptForCausalLM": "mpt",
    "FalconForCausalLM": "falcon",
    "RWForCausalLM": "falcon",
}

# earlier names of the same families
_ALIASES = {"RefinedWeb": "falcon", "RefinedWebModel": "falcon", "gpt-neox": "gpt_neox"}


def family_of(raw: Mapping[str, Any], where: str) -> str:
    """The family of a config dict (``model_type``, else ``architectures``); ModelError if unsupported."""
    model_type = raw.get("model_type")
    if isinstance(model_type, str):
        model_type = _ALIASES.get(model_type, model_type)
    if model_type is None:
        for arch in raw.get("architectures") or ():
            if arch in _ARCHITECTURES:
                model_type = _ARCHITECTURES[arch]
                break
    if model_type not in READERS:
        what = f"model_type '{model_type}'" if model_type is not None else "no model_type"
        raise ModelError(
            f"{where}: {what} is not a supported family; supported: {', '.join(FAMILIES)} "
            f"(decoder-only Hugging Face configs), and for estimates {', '.join(ESTIMATE_ONLY_FAMILIES)}"
        )
    return str(model_type)


def spec_from_config(raw: Mapping[str, Any], where: str, name: str) -> ModelSpec:
    """Read ``raw`` (a config.json dict) into a ModelSpec named ``name``."""
    if not isinstance(raw, Mapping):
        raise ModelError(f"{where}: expected a JSON object (a Hugging Face config.json), got {type(raw).__name__}")
    spec = READERS[family_of(raw, where)](raw, where)
    hf_id = raw.get("_name_or_path") or None
    return dataclasses.replace(spec, name=name, hf_id=hf_id if isinstance(hf_id, str) else None)
