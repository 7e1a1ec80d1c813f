"""Fixtures shared by the unit tests."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest

import slow_scripts


def _needs(item: pytest.Item, fixture: str) -> bool:
    return fixture in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests that wait for tests/slow_scripts.py's results run last (in collection order otherwise), so the
    scripts have the whole run to use idle CPU."""
    items.sort(key=lambda item: _needs(item, "loso_document"))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def loso_document() -> dict[str, Any]:
    """What ``scripts/loso.py`` prints for the repository's data/validation (run once per session: the
    leave-one-source-out refits take minutes on 2 cores; test_loso checks it, test_docs_tables renders from it).
    A run's output is kept under a hash of every file it read (``slow_scripts.loso_key``): a later session on the same
    files reads it back instead of refitting; any change to the package, the script or the cases refits."""
    doc: dict[str, Any] = slow_scripts.wait_for("loso")
    return doc


@pytest.fixture(scope="session")
def docs_check(loso_document: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """``scripts/make_docs.py --check --loso FILE`` (FILE: :func:`loso_document`) as it ran in this session."""
    res: subprocess.CompletedProcess[str] = slow_scripts.wait_for("docs")
    return res
