"""Where ranks run: the local machine (embedded default) and a Ray cluster (``RayLauncher``, multi-node)."""

from __future__ import annotations

from starverse.providers.local import accelerator_id, cpu_rank_count, local_ranks
from starverse.providers.ray import RayLauncher

__all__ = ["RayLauncher", "accelerator_id", "cpu_rank_count", "local_ranks"]
