"""The devices of this machine as ranks: every CUDA GPU (named by its accelerator id), else CPU ranks.

Device discovery is the runtime's own business (``accelerate()`` and ``probe`` need it); the launchers that start
processes on these devices are providers (``providers/local.py``, ``providers/ray.py``).
"""

from __future__ import annotations

import os
import re

from starverse.errors import ConfigError
from starverse.runtime.launch import RankSpec

DEFAULT_CPU_RANKS = 2
"""CPU ranks when the machine has no GPU and nothing else is asked for."""

# (pattern on the lower-cased CUDA device name, memory threshold GB or None, accelerator id). First match wins.
_CUDA_NAMES: tuple[tuple[str, float | None, str], ...] = (
    (r"h200", None, "h200-141gb-sxm"),
    (r"h100.*nvl", None, "h100-94gb-nvl"),
    (r"h100.*pcie", None, "h100-80gb-pcie"),
    (r"h100", None, "h100-80gb-sxm"),
    (r"b200", None, "b200"),
    (r"a100.*pcie", 60.0, "a100-80gb-pcie"),
    (r"a100.*pcie", None, "a100-40gb-pcie"),
    (r"a100", 60.0, "a100-80gb-sxm"),
    (r"a100", None, "a100-40gb-sxm"),
    (r"l40s", None, "l40s"),
    (r"rtx a6000", None, "rtx-a6000"),
    (r"4090", None, "rtx-4090"),
    (r"3090", None, "rtx-3090"),
    (r"2080", None, "rtx-2080"),
    (r"titan rtx", None, "titan-rtx"),
    (r"v100", 24.0, "v100-32gb-sxm"),
    (r"v100", None, "v100-16gb-sxm"),
    (r"\bt4\b", None, "t4"),
    (r"mi300x", None, "mi300x"),
    (r"mi250", None, "mi250x"),
)


def accelerator_id(device_name: str, memory_gb: float) -> str:
    """Catalog id for a CUDA/ROCm device name (``NVIDIA H100 80GB HBM3`` -> ``h100-80gb-sxm``).

    An unknown device gets a slug of its name (``cuda-<name>``); the catalog then has no datasheet for it
    and ``starverse probe`` measures it.
    """
    name = device_name.lower()
    for pattern, min_gb, acc in _CUDA_NAMES:
        if re.search(pattern, name) and (min_gb is None or memory_gb >= min_gb):
            return acc
    return "cuda-" + re.sub(r"[^a-z0-9]+", "-", name).strip("-")


def max_cpu_ranks() -> int:
    """Most CPU ranks one machine starts (one process each): 8 per core, at least 64. More only share the cores,
    and a million (a typo, or a hostile job) would fork the machine to a halt before training anything."""
    return max(64, 8 * (os.cpu_count() or 1))


def cpu_rank_count(num_cpu_ranks: int | None = None) -> int:
    """CPU ranks to start: the argument, else ``$STARVERSE_CPU_RANKS``, else 2 (at most :func:`max_cpu_ranks`)."""
    n = num_cpu_ranks
    if n is None:
        env = os.environ.get("STARVERSE_CPU_RANKS")
        if env:
            try:
                n = int(env)
            except ValueError:
                raise ConfigError(f"$STARVERSE_CPU_RANKS must be an integer (got {env!r}).") from None
    n = DEFAULT_CPU_RANKS if n is None else n
    if n < 1:
        raise ConfigError(f"the number of CPU ranks must be >= 1 (got {n}).")
    if n > max_cpu_ranks():
        raise ConfigError(f"the number of CPU ranks: {n:,} is more than the {max_cpu_ranks()} this machine starts (one "
                          f"process each, {os.cpu_count()} cores). To fix: ask for at most {max_cpu_ranks()}")
    return n


def local_ranks(num_cpu_ranks: int | None = None, use_gpus: bool | None = None) -> list[RankSpec]:
    """One :class:`RankSpec` per local device: every CUDA GPU, else ``cpu_rank_count`` CPU ranks.

    ``use_gpus=False`` forces CPU ranks even where GPUs exist (tests, the demo's fixed setting).
    """
    import torch

    if use_gpus is not False and torch.cuda.is_available() and torch.cuda.device_count() > 0:
        ranks = []
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            acc = accelerator_id(props.name, props.total_memory / 1e9)
            ranks.append(RankSpec(rank=i, device_kind=acc, device=f"cuda:{i}"))
        return ranks
    n = cpu_rank_count(num_cpu_ranks)
    threads = max(1, (os.cpu_count() or 1) // n)
    return [RankSpec(rank=r, device_kind="cpu", device="cpu", num_threads=threads) for r in range(n)]
