"""Fixtures shared by the unit tests."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


CACHE_DIR = Path(tempfile.gettempdir()) / "starverse-test-cache"
"""Where :func:`loso_document` keeps the script's output, under a key of everything it read."""


def _loso_key() -> str:
    """A hash of what ``scripts/loso.py``'s output depends on: the script, every file of the package (the cost
    model, the catalog, the fit), the validation cases, the catalog's extra inputs (a probe profile: their
    stamps, ``catalog_version``), and the Python, NumPy and SciPy that ran it."""
    from starverse.catalog.loader import catalog_version

    h = hashlib.sha256(catalog_version().encode())
    files = [REPO / "scripts" / "loso.py"]
    for top in (REPO / "src" / "starverse", REPO / "data" / "validation"):
        files += sorted(p for p in top.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    for p in files:
        h.update(str(p.relative_to(REPO)).encode() + b"\0" + p.read_bytes() + b"\0")
    h.update(sys.version.encode())
    for dist in ("numpy", "scipy"):
        h.update(metadata.version(dist).encode())
    return h.hexdigest()


@pytest.fixture(scope="session")
def loso_document() -> dict[str, Any]:
    """What ``scripts/loso.py`` prints for the repository's data/validation (run once per session: the
    leave-one-source-out refits take minutes on 2 cores; test_loso checks it, test_docs_tables renders from it).
    A run's output is kept under a hash of every file it read (:func:`_loso_key`): a later session on the same
    files reads it back instead of refitting; any change to the package, the script or the cases refits."""
    cached = CACHE_DIR / f"loso-{_loso_key()}.json"
    if cached.is_file():
        doc: dict[str, Any] = json.loads(cached.read_text())
        return doc
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "loso.py")], capture_output=True, text=True,
                         timeout=600, check=False)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".{id(doc)}.tmp")  # written whole, then renamed: a reader never sees half of it
    tmp.write_text(res.stdout)
    tmp.replace(cached)
    return doc
