"""Fixtures shared by the unit tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def loso_document() -> dict[str, Any]:
    """What ``scripts/loso.py`` prints for the repository's data/validation (run once per session: the
    leave-one-source-out refits take minutes on 2 cores; test_loso checks it, test_docs_tables renders from it)."""
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "loso.py")], capture_output=True, text=True,
                         timeout=600, check=False)
    assert res.returncode == 0, res.stderr
    doc: dict[str, Any] = json.loads(res.stdout)
    return doc
