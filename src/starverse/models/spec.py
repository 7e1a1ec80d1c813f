"""ModelSpec: the architecture facts of a decoder-only transformer that planning needs.

Built from a Hugging Face ``config.json`` by :mod:`starverse.models.families`; parameter counts equal what
``transformers`` builds from the same config (tested on the meta device for every bundled config).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from starverse.catalog.core import FrozenDict

FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "gpt2", "gpt_neox", "opt", "bloom", "mpt", "falcon")
"""Model families (HF ``model_type``) that :func:`starverse.models.load_model` understands."""
ESTIMATE_ONLY_FAMILIES = ("maxtext",)
"""Families read for estimates only, which the runtime cannot build (``transformers`` has no such class):
``maxtext``, a model as Google's MaxText (JAX) configures it (``models.families``' reader names the keys)."""


def estimate_only(model_type: object) -> str | None:
    """Why a model of ``model_type`` cannot be trained here (one sentence with the fix), or None if it can."""
    if model_type not in ESTIMATE_ONLY_FAMILIES:
        return None
    return (f"model_type {model_type!r} is read for estimates only (transformers has no such model). To fix: train a "
            "Hugging Face config of the same shape (`starverse models` lists families)")


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only transformer (dense or mixture-of-experts)."""

    name: str
    """Short id (``llama-2-70b``) for bundled models, else the config's name or file stem."""
    family: str
    """HF ``model_type``: llama, mistral, mixtral, qwen2, gpt2, gpt_neox, opt, bloom, mpt, falcon; or an
    estimate-only family (:data:`ESTIMATE_ONLY_FAMILIES`)."""
    num_layers: int
    """Transformer layers."""
    hidden_size: int
    """Model (residual stream) width."""
    num_heads: int
    """Attention (query) heads."""
    num_kv_heads: int
    """Key/value heads (== num_heads for MHA, fewer for GQA, 1 for MQA)."""
    head_dim: int
    """Width of one attention head."""
    ffn_hidden_size: int
    """MLP inner width (per expert for MoE)."""
    vocab_size: int
    """Embedding rows (padded vocabulary as in the config)."""
    max_seq_len: int
    """Longest sequence the config declares (max_position_embeddings / n_positions / max_seq_len)."""
    gated_mlp: bool
    """SwiGLU-style MLP with 3 matrices (gate, up, down) vs a 2-matrix GELU MLP."""
    num_experts: int
    """Experts per MoE layer; 0 = dense."""
    experts_per_token: int
    """Experts each token is routed to (top-k); 0 = dense."""
    tie_embeddings: bool
    """LM head shares the input embedding matrix."""
    position: str
    """Position encoding: rope | alibi | learned."""
    norm: str
    """rmsnorm | layernorm."""
    qkv_bias: bool
    """Q, K, V projections have biases."""
    attn_out_bias: bool
    """Attention output projection has a bias."""
    mlp_bias: bool
    """MLP matrices have biases."""
    hf_config: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)
    """The raw config.json dict (to build the torch model with transformers)."""
    hf_id: str | None = None
    """Hugging Face repo id, where known (``meta-llama/Llama-2-70b-hf``)."""
    num_positions: int = 0
    """Rows of the learned position-embedding table (0 for rope/alibi)."""
    norm_params_per_layer: int = 0
    """Parameters of the normalisation layers inside one transformer layer."""
    other_params: int = 0
    """Parameters outside layers, embeddings and LM head: final norm, embedding norm, projections."""
    embedding_dim: int = 0
    """Width of the token embedding if it differs from hidden_size (OPT-350m); 0 = hidden_size."""
    parallel_attn_mlp: bool = False
    """Attention and MLP read the same input (GPT-J/NeoX/Falcon style) rather than one after the other."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "hf_config", FrozenDict(self.hf_config))

    # ---- parameter counts -------------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        """Width of the concatenated query heads (num_heads * head_dim)."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the concatenated key (or value) heads (num_kv_heads * head_dim)."""
        return self.num_kv_heads * self.head_dim

    @property
    def attn_params_per_layer(self) -> int:
        """Q, K, V and output projections of one layer, biases included."""
        h = self.hidden_size
        weights = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        biases = (self.q_size + 2 * self.kv_size if self.qkv_bias else 0) + (h if self.attn_out_bias else 0)
        return weights + biases

    @property
    def mlp_params_per_expert(self) -> int:
        """One MLP (one expert for MoE), biases included."""
        h, f = self.hidden_size, self.ffn_hidden_size
        num_in = 2 if self.gated_mlp else 1
        weights = (num_in + 1) * h * f
        biases = num_in * f + h if self.mlp_bias else 0
        return weights + biases

    @property
    def router_params_per_layer(self) -> int:
        """MoE router (a bias-free linear map hidden -> experts); 0 for dense models."""
        return self.hidden_size * self.num_experts if self.num_experts else 0

    def _layer_params(self, experts: int) -> int:
        """Parameters of one transformer layer counting ``experts`` MLPs."""
        return (
            self.attn_params_per_layer
            + experts * self.mlp_params_per_expert
            + self.router_params_per_layer
            + self.norm_params_per_layer
        )

    @property
    def params_per_layer(self) -> int:
        """All parameters of one transformer layer (every expert counted)."""
        return self._layer_params(max(self.num_experts, 1))

    @property
    def active_params_per_layer(self) -> int:
        """Parameters one token passes through in one layer (top-k experts for MoE)."""
        return self._layer_params(self.experts_per_token if self.num_experts else 1)

    @property
    def embedding_params(self) -> int:
        """Input token embeddings plus learned position embeddings."""
        return self.vocab_size * (self.embedding_dim or self.hidden_size) + self.num_positions * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        """Output projection to the vocabulary; 0 when tied to the input embedding."""
        return 0 if self.tie_embeddings else self.vocab_size * (self.embedding_dim or self.hidden_size)

    def _model_params(self, per_layer: int) -> int:
        """Embeddings, ``num_layers`` layers of ``per_layer`` parameters, LM head and the rest."""
        return self.embedding_params + self.num_layers * per_layer + self.lm_head_params + self.other_params

    @property
    def num_params(self) -> int:
        """Total parameters, counting a tied matrix once (what transformers' ``parameters()`` yields)."""
        return self._model_params(self.params_per_layer)

    @property
    def num_active_params(self) -> int:
        """Parameters one token passes through (all of them for dense models)."""
        return self._model_params(self.active_params_per_layer)

    @property
    def is_moe(self) -> bool:
        """Mixture-of-experts model."""
        return self.num_experts > 0

    def summary(self) -> dict[str, Any]:
        """JSON-ready description (``starverse models --json``)."""
        return {
            "id": self.name,
            "hf_id": self.hf_id,
            "family": self.family,
            "num_params": self.num_params,
            "num_active_params": self.num_active_params,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "ffn_hidden_size": self.ffn_hidden_size,
            "vocab_size": self.vocab_size,
            "max_seq_len": self.max_seq_len,
            "num_experts": self.num_experts,
            "experts_per_token": self.experts_per_token,
            "gated_mlp": self.gated_mlp,
            "tie_embeddings": self.tie_embeddings,
            "position": self.position,
            "norm": self.norm,
        }
