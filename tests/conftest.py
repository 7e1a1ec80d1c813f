"""Shared pytest fixtures and settings."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import slow_scripts

REPO = Path(__file__).resolve().parents[1]

# Ranks, servers and tests bind to loopback only.
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
# Never let a test pick up a user's catalog override or probe profile by accident.
os.environ.pop("STARVERSE_CATALOG", None)
# Under pytest-xdist each worker has its own cache of tokenizers and tokenised corpora: two workers tokenising
# one corpus at once would write the same temporary file.
if (_worker := os.environ.get("PYTEST_XDIST_WORKER")) and not os.environ.get("STARVERSE_CACHE"):
    os.environ["STARVERSE_CACHE"] = str(Path.home() / ".cache" / f"starverse-{_worker}")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist starts its workers: they inherit the folder's name
def pytest_sessionstart(session: pytest.Session) -> None:
    """Start ``scripts/loso.py`` and ``scripts/make_docs.py --check`` in the background (tests/slow_scripts.py)
    where the session may run the tests that check them; in the process that starts the session, not in
    pytest-xdist's workers."""
    config = session.config
    if hasattr(config, "workerinput") or config.option.collectonly or slow_scripts.FOLDER_ENV in os.environ:
        return
    names = slow_scripts.wanted(list(config.args), config.invocation_params.dir)
    if names:
        config.stash[_SCRIPTS] = slow_scripts.start(names)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if (scripts := session.config.stash.get(_SCRIPTS, None)) is not None:
        scripts.close()


_SCRIPTS = pytest.StashKey[slow_scripts.SlowScripts]()


@pytest.fixture
def repo_root() -> Path:
    """The repository root (for data/ and examples/)."""
    return REPO


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Group tests for ``--dist loadgroup`` and skip ``@pytest.mark.gpu`` tests when no CUDA device is present.

    Under pytest-xdist each test module runs in one worker, so a module-scoped fixture (a trained model, a
    PostgreSQL server, a Ray session) is built once; a test already in an ``xdist_group`` keeps it (the Ray tests: ``helpers.RAY_GROUP``).
    """
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))
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
