"""Where ranks run: the local machine (embedded default); multi-node providers plug in beside it."""

from __future__ import annotations

from starverse.providers.local import accelerator_id, cpu_rank_count, local_ranks

__all__ = ["accelerator_id", "cpu_rank_count", "local_ranks"]
