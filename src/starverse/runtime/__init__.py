"""The heterogeneous training runtime: launch ranks, build the mixed mesh, train with hetero DP.

Submodules import torch; this package itself stays light so ``import starverse.runtime`` is cheap.
Public names are loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Callback": "starverse.runtime.callbacks",
    "CallbackList": "starverse.runtime.callbacks",
    "StepMetrics": "starverse.runtime.callbacks",
    "TrainContext": "starverse.runtime.callbacks",
    "RankEnv": "starverse.runtime.launch",
    "RankSpec": "starverse.runtime.launch",
    "launch": "starverse.runtime.launch",
    "Trainer": "starverse.runtime.trainer",
    "FitResult": "starverse.runtime.trainer",
    "Cluster": "starverse.runtime.cluster",
    "accelerate": "starverse.runtime.cluster",
    "MixedMesh": "starverse.runtime.mesh",
    "build_model": "starverse.runtime.modeling",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'starverse.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
