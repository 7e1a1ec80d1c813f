"""count_params counts a registry family's config from its shapes (no transformers import): the count must be the
built model's, for every shipped model config, every scaled-down copy the runtime may train instead, and the small
configs jobs and tests train."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import TINY
from starverse.models import bundled_ids, load_model
from starverse.runtime.model_choice import _SMALL_LLAMA
from starverse.runtime.modeling import (
    _LADDER,
    _get,
    _scaled,
    count_built_params,
    count_params,
    hf_config_dict,
)


def _rungs(cfg: dict) -> list[dict]:
    """The scaled copies ``scale_config`` may pick for ``cfg`` (every ladder rung it may try)."""
    _, layers0 = _get(cfg, "layers")
    _, hidden0 = _get(cfg, "hidden")
    return [_scaled(cfg, layers, hidden, 8192, 2048) for layers, hidden in _LADDER
            if layers <= layers0 and hidden <= hidden0]


@pytest.mark.parametrize("short", list(bundled_ids()))
def test_count_equals_the_built_model_for_a_shipped_config_and_its_scaled_copies(short: str) -> None:
    cfg = hf_config_dict(short)
    for c in [cfg, *_rungs(cfg)]:
        assert count_params(c) == count_built_params(c), c


def test_count_equals_the_built_model_for_the_small_configs_jobs_train() -> None:
    cfg = {**TINY, "attention_bias": True, "mlp_bias": True, "head_dim": 8}
    for c in (TINY, _SMALL_LLAMA, cfg, {**TINY, "model_type": "qwen2"}, {**TINY, "tie_word_embeddings": True}):
        assert count_params(c) == count_built_params(c), c
    assert count_params(load_model("llama-tiny")) == count_built_params("llama-tiny")


def test_counting_a_family_config_does_not_import_transformers() -> None:
    code = ("import sys, json; from starverse.runtime.modeling import count_params; "
            f"print(count_params(json.loads({__import__('json').dumps(TINY)!r}))); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert int(out[0]) == count_built_params(TINY) and out[1] == "[]"
