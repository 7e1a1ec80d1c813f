"""Training checkpoints: DCP-based, asynchronous, atomic, reshardable; snapshots and rollback.

``store`` (pure file handling, no torch) lists, verifies, commits and retires ``step-N`` folders;
``checkpointer.Checkpointer`` saves and loads one rank's part with ``torch.distributed.checkpoint``;
``callback.CheckpointCallback`` plugs both into the runtime's ``Trainer``. See docs/insurance.md.
"""

from __future__ import annotations

from typing import Any

from starverse.checkpoint.store import CheckpointInfo, CheckpointStore, resolve_root

__all__ = ["CheckpointCallback", "CheckpointInfo", "CheckpointStore", "Checkpointer", "resolve_root"]


def __getattr__(name: str) -> Any:
    # torch-backed parts load on first use, so `starverse checkpoints list` starts without torch
    if name == "Checkpointer":
        from starverse.checkpoint.checkpointer import Checkpointer

        return Checkpointer
    if name == "CheckpointCallback":
        from starverse.checkpoint.callback import CheckpointCallback

        return CheckpointCallback
    raise AttributeError(f"module 'starverse.checkpoint' has no attribute {name!r}")
