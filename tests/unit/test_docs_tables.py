"""The planner's tables in README.md and docs/planner.md are what `make docs` writes from the commands' --json:
a hand edit, or a planner change that moves a figure, fails here until `make docs` is rerun."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from helpers import load_script

ROOT = Path(__file__).resolve().parents[2]


def _make_docs():
    return load_script(ROOT / "scripts/make_docs.py", "make_docs")  # forked searches find it by that name


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
