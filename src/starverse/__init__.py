"""Starverse: plan, run and account for training large models on mixed rented accelerators.

The public API is loaded lazily: ``import starverse`` does not import torch (planning runs anywhere, fast);
``starverse.Trainer`` and friends import it on first use.

    import starverse
    cluster = starverse.accelerate(model_id="meta-llama/Llama-2-7b-hf", policy="cost-performance", max_budget=28)
    with cluster.mixed_mesh():
        model = starverse.build_model(cluster.model_config)
    starverse.Trainer(cluster).fit(model, dataset="path/to/texts", per_device_batch_size=4, max_steps=1000)
"""

from __future__ import annotations

import atexit
import gc
import importlib
from typing import Any

__version__ = "0.1.0"

# The interpreter's last garbage collection at exit walks every object it holds: with torch and transformers
# loaded that was ~3 s of CPU per process (a job's supervisor, a service runner, a spawned rank) after its work
# was done. Registered first, this runs after every atexit handler registered later (they all still run) and
# leaves the objects alive then to the process's end; Python never promised their __del__ at exit.
atexit.register(gc.freeze)

_EXPORTS = {
    "accelerate": "starverse.runtime.cluster",
    "Cluster": "starverse.runtime.cluster",
    "Trainer": "starverse.runtime.trainer",
    "FitResult": "starverse.runtime.trainer",
    "build_model": "starverse.runtime.modeling",
    "Callback": "starverse.runtime.callbacks",
    "TrainContext": "starverse.runtime.callbacks",
    "Plan": "starverse.plan",
    "load_plan": "starverse.plan",
    "save_plan": "starverse.plan",
    "load_model": "starverse.models",
    "estimate": "starverse.costmodel",
    "load_catalog": "starverse.catalog",
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'starverse' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
