"""Shared pytest fixtures and settings."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Ranks, servers and tests bind to loopback only.
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
# Never let a test pick up a user's catalog override or probe profile by accident.
os.environ.pop("STARVERSE_CATALOG", None)


@pytest.fixture
def repo_root() -> Path:
    """The repository root (for data/ and examples/)."""
    return REPO


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``@pytest.mark.gpu`` tests when no CUDA device is present."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
