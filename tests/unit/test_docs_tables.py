"""The planner's tables in README.md and docs/planner.md are what `make docs` writes from the commands' --json:
a hand edit, or a planner change that moves a figure, fails here until `make docs` is rerun."""

from __future__ import annotations

import importlib.util
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


# pytest-timeout counts the set-up: the wait for tests/slow_scripts.py (scripts/loso.py's refits, then
# `make_docs.py --check` on their output, both started in the background when the session starts)
@pytest.mark.timeout(900)
def test_committed_tables_are_what_make_docs_writes(docs_check: subprocess.CompletedProcess[str]) -> None:
    assert docs_check.returncode == 0, docs_check.stdout + docs_check.stderr


def test_a_hand_edit_is_caught():
    make_docs = _make_docs()
    text = "intro\n<!-- table:bench -->\n| figure | value |\n<!-- /table:bench -->\nafter\n"
    assert make_docs.rewrite(text, "bench", "| new |") == "intro\n<!-- table:bench -->\n| new |\n<!-- /table:bench -->\nafter\n"
    assert make_docs.rewrite(text, "bench", "| figure | value |") == text
