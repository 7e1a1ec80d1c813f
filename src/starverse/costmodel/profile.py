"""Measured model profiles (``starverse probe --model M --plan P``): per-layer forward/backward times of
one model shape on one accelerator, which the estimator uses instead of its analytic compute terms.

Format (JSON, version :data:`PROFILE_VERSION`)::

    {
      "format": "starverse-model-profile",
      "version": 1,
      "accelerator": "cpu",                     # catalog id of the device kind measured
      "host": "node-1", "measured_at": "2026-11-30T16:00:00+00:00",
      "model": {"hidden_size": 256, "num_heads": 4, "num_kv_heads": 4, "head_dim": 64,
                "ffn_hidden_size": 688, "vocab_size": 8192, "gated_mlp": true, "num_experts": 0},
      "entries": [                              # one per (micro_batch, seq_len, tp, precision) measured
        {"micro_batch": 2, "seq_len": 256, "tp": 1, "precision": "fp32",
         "layer_forward_s": 0.0011, "layer_backward_s": 0.0023,   # one transformer layer (its TP shard)
         "head_forward_s": 0.0009, "head_backward_s": 0.0015}     # embedding + final norm + LM head + loss
      ],
      "links_gb_per_s": {"intra_node": 12.5},   # measured all-reduce bus bandwidth between local ranks
      "optimizer_s_per_param": 2.1e-9           # optional: measured AdamW step time per parameter
    }

The estimator uses an entry where a plan's stage runs on the profile's accelerator with the entry's
micro-batch, sequence length, TP degree and precision, and the analytic model elsewhere. A measured
layer time replaces the layer's matmul, attention and elementwise terms (they are what the measurement
contains); a measured optimizer time replaces the analytic Adam step; communication and memory stay
analytic. With full recompute the layer's forward is counted twice (under PyTorch's early stop,
``train.recompute_early_stop``, less the down projection's analytic share of that forward: it is not run again).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starverse.costmodel.shapes import ModelShape
from starverse.errors import ConfigError

PROFILE_FORMAT = "starverse-model-profile"
"""Value of the ``format`` field."""
PROFILE_VERSION = 1
"""Newest profile version this code reads."""
SHAPE_KEYS = ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "ffn_hidden_size", "vocab_size",
              "gated_mlp", "num_experts")
"""Model-shape fields a profile is keyed by (the per-layer times do not depend on the depth)."""
TIME_KEYS = ("layer_forward_s", "layer_backward_s", "head_forward_s", "head_backward_s")
"""Measured times of an entry (seconds per micro-batch)."""


def shape_key(shape: ModelShape) -> dict[str, Any]:
    """The model-shape fields a profile records."""
    return {k: getattr(shape, k) for k in SHAPE_KEYS}


@dataclass(frozen=True)
class ProfileEntry:
    """Times measured at one (micro-batch, sequence length, TP, precision)."""

    micro_batch: int
    """Sequences per micro-batch."""
    seq_len: int
    """Tokens per sequence."""
    tp: int
    """Tensor-parallel degree (the layer measured is one TP shard)."""
    precision: str
    """bf16 | fp16 | fp32."""
    layer_forward_s: float
    """Forward of one transformer layer, one micro-batch."""
    layer_backward_s: float
    """Backward of one transformer layer, one micro-batch."""
    head_forward_s: float
    """Forward of embedding, final norm, LM head and loss, one micro-batch."""
    head_backward_s: float
    """Their backward."""


@dataclass(frozen=True)
class ModelProfile:
    """A loaded, checked profile."""

    path: str
    """Where it was read from."""
    accelerator: str
    """Catalog id of the device kind measured."""
    model: dict[str, Any]
    """Shape fields (:data:`SHAPE_KEYS`)."""
    entries: tuple[ProfileEntry, ...]
    """Measured entries."""
    links_gb_per_s: dict[str, float]
    """Measured link bandwidths (GB/s), e.g. ``intra_node``."""
    optimizer_s_per_param: float | None = None
    """Measured AdamW step time per parameter (None: analytic)."""

    def entry(self, micro_batch: int, seq_len: int, tp: int, precision: str) -> ProfileEntry | None:
        """The entry measured at exactly these settings, or None."""
        for e in self.entries:
            if (e.micro_batch, e.seq_len, e.tp, e.precision) == (micro_batch, seq_len, tp, precision):
                return e
        return None

    def to_json(self) -> dict[str, Any]:
        """The JSON document (format in the module docstring), without host/time."""
        return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "accelerator": self.accelerator,
                "model": self.model, "entries": [vars(e) for e in self.entries],
                "links_gb_per_s": self.links_gb_per_s, "optimizer_s_per_param": self.optimizer_s_per_param}


def _positive(value: Any, where: str, fix: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{where}: must be a number > 0 (got {value!r}); {fix}")
    return float(value)


def parse_profile(doc: Any, path: str) -> ModelProfile:
    """Check a profile document; ConfigError naming the file and field otherwise."""
    again = "measure again with `starverse probe --model M --plan P`"
    if not isinstance(doc, dict) or doc.get("format") != PROFILE_FORMAT:
        raise ConfigError(f"{path}: not a starverse model profile (no \"format\": \"{PROFILE_FORMAT}\"); {again}")
    version = doc.get("version")
    if not isinstance(version, int) or version < 1:
        raise ConfigError(f"{path}: version: must be a positive integer (got {version!r}); {again}")
    if version > PROFILE_VERSION:
        raise ConfigError(f"{path}: version: {version} is newer than this starverse reads ({PROFILE_VERSION}); "
                          "upgrade starverse or measure again with this version's `starverse probe`")
    acc = doc.get("accelerator")
    model = doc.get("model")
    entries = doc.get("entries")
    if not isinstance(acc, str) or not acc:
        raise ConfigError(f"{path}: accelerator: missing; {again}")
    if not isinstance(model, dict) or set(SHAPE_KEYS) - set(model):
        missing = sorted(set(SHAPE_KEYS) - set(model)) if isinstance(model, dict) else list(SHAPE_KEYS)
        raise ConfigError(f"{path}: model: missing {', '.join(missing)}; {again}")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{path}: entries: must be a non-empty list; {again}")
    parsed = []
    for i, e in enumerate(entries):
        where = f"{path}: entries[{i}]"
        if not isinstance(e, dict):
            raise ConfigError(f"{where}: must be a mapping; {again}")
        try:
            settings = (int(e["micro_batch"]), int(e["seq_len"]), int(e["tp"]), str(e["precision"]))
        except (KeyError, TypeError, ValueError) as err:
            raise ConfigError(f"{where}: needs micro_batch, seq_len, tp and precision ({err}); {again}") from None
        times = [_positive(e.get(k), f"{where}.{k}", again) for k in TIME_KEYS]
        parsed.append(ProfileEntry(*settings, *times))
    links = doc.get("links_gb_per_s", {})
    if not isinstance(links, dict):
        raise ConfigError(f"{path}: links_gb_per_s: must be a mapping of link name to GB/s")
    fix = "a link bandwidth must be measured and > 0; remove it or measure again"
    checked = {str(k): _positive(v, f"{path}: links_gb_per_s.{k}", fix) for k, v in links.items()}
    opt = doc.get("optimizer_s_per_param")
    opt_s = None if opt is None else _positive(opt, f"{path}: optimizer_s_per_param", again)
    return ModelProfile(path, acc, dict(model), tuple(parsed), checked, opt_s)


def load_profile(path: str | Path) -> ModelProfile:
    """Read and check a profile file."""
    from starverse.config import read_text_file

    p = Path(path)
    if not p.exists() and not p.is_symlink():
        raise ConfigError(f"{p}: profile file not found; run `starverse probe --model M --plan P --out {p}`")
    # a folder, a device or FIFO (read forever, or blocked), a symlink loop or a binary file: one line
    text = read_text_file(p, "a profile file (`starverse probe --model M --plan P` writes one)")
    try:
        doc = json.loads(text)
    except (json.JSONDecodeError, RecursionError, ValueError) as e:
        raise ConfigError(f"{p}: corrupt profile (not JSON: {str(e)[:80]}); measure again with `starverse probe`"
                          ) from None
    return parse_profile(doc, str(p))


def check_profile_fits(profile: ModelProfile, accelerator: str, shape: ModelShape, where: str) -> None:
    """A profile must be of the stage's accelerator and the plan's model shape; ConfigError otherwise."""
    if profile.accelerator != accelerator:
        raise ConfigError(f"{where}: profile {profile.path} was measured on '{profile.accelerator}', not "
                          f"'{accelerator}'; name it under network.profiles.{profile.accelerator} or measure "
                          f"this device kind")
    want = shape_key(shape)
    diff = [k for k in SHAPE_KEYS if profile.model.get(k) != want[k]]
    if diff:
        got = ", ".join(f"{k}={profile.model.get(k)!r}" for k in diff)
        need = ", ".join(f"{k}={want[k]!r}" for k in diff)
        raise ConfigError(f"{where}: profile {profile.path} is of another model ({got}; the plan's model has "
                          f"{need}); measure this model with `starverse probe --model M --plan P`")
