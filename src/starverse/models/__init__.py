"""Model registry: ModelSpec from Hugging Face configs (bundled by id, or any config.json), no torch."""

from __future__ import annotations

from starverse.models.families import family_of, spec_from_config
from starverse.models.registry import CONFIG_DIR, bundled_ids, list_models, load_model
from starverse.models.spec import ESTIMATE_ONLY_FAMILIES, FAMILIES, ModelSpec, estimate_only

__all__ = [
    "CONFIG_DIR",
    "ESTIMATE_ONLY_FAMILIES",
    "FAMILIES",
    "ModelSpec",
    "bundled_ids",
    "estimate_only",
    "family_of",
    "list_models",
    "load_model",
    "spec_from_config",
]
