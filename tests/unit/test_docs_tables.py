"""The planner's tables in README.md and docs/planner.md are what `make docs` writes from the commands' --json:
a hand edit, or a planner change that moves a figure, fails here until `make docs` is rerun."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _make_docs():
    spec = importlib.util.spec_from_file_location("make_docs", ROOT / "scripts/make_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_docs"] = module  # its forked plan searches find their function by the module's name
    spec.loader.exec_module(module)
    return module


# pytest-timeout counts the set-up: the first test to ask for loso_document (this one) also pays for
# scripts/loso.py's refits (minutes at load). `make docs --check` runs as its own process: its planner searches
# fork workers, and a fork of this test process (its threads, the signal handlers earlier tests left) once hung
@pytest.mark.timeout(900)
def test_committed_tables_are_what_make_docs_writes(loso_document, tmp_path):
    loso = tmp_path / "loso.json"  # scripts/loso.py's output of this session, not a second refit
    loso.write_text(json.dumps(loso_document))
    res = subprocess.run([sys.executable, str(ROOT / "scripts/make_docs.py"), "--check", "--loso", str(loso)],
                         capture_output=True, text=True, timeout=780, check=False)
    assert res.returncode == 0, res.stdout + res.stderr


def test_a_hand_edit_is_caught():
    make_docs = _make_docs()
    text = "intro\n<!-- table:bench -->\n| figure | value |\n<!-- /table:bench -->\nafter\n"
    assert make_docs.rewrite(text, "bench", "| new |") == "intro\n<!-- table:bench -->\n| new |\n<!-- /table:bench -->\nafter\n"
    assert make_docs.rewrite(text, "bench", "| figure | value |") == text
