"""Pieces several test modules share: a tiny trainable LM and its data, the CLI and a tiny llama config.

Importable as ``helpers`` (``tests/`` is on ``sys.path`` through its conftest), also in rank processes: the
local launcher's spawned ranks and the Ray provider's actors inherit the caller's ``sys.path``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

VOCAB, SEQ = 48, 16
"""Vocabulary of :class:`TinyLM` and the sequence length :func:`ramp_tokens` is sized for."""

CLI = [str(Path(sys.executable).parent / "starverse")]
"""The ``starverse`` command of this environment."""

TINY = {
    "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 320, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu",
}
"""A one-layer llama config.json that trains in seconds on CPU ranks."""


class TinyLM(torch.nn.Module):
    """Embedding -> 2-layer MLP with LayerNorm -> logits (a plain module: the trainer computes the loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.fc1 = torch.nn.Linear(32, 64)
        self.fc2 = torch.nn.Linear(64, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits for token ids."""
        return self.fc2(torch.tanh(self.fc1(self.norm(self.emb(ids)))))


def ramp_tokens() -> list[torch.Tensor]:
    """Documents with structure (repeating ramps) so the loss moves; 40 sequences' worth."""
    g = torch.Generator().manual_seed(7)
    return [(torch.arange(SEQ * 4) * (i + 1) + torch.randint(0, 3, (SEQ * 4,), generator=g)) % VOCAB for i in range(10)]


def new_user_env(tmp: Path) -> dict[str, str]:
    """The environment of a new user under ``tmp``: no probe profile, no user ledger, no catalog override."""
    env = dict(os.environ)
    env.update(STARVERSE_CACHE=str(tmp / "cache"), HOME=str(tmp), COLUMNS="200")
    for k in ("STARVERSE_CATALOG", "STARVERSE_PROFILE", "STARVERSE_LEDGER", "XDG_DATA_HOME"):
        env.pop(k, None)
    return env
