"""The planner's tables in README.md and docs/planner.md are what `make docs` writes from the commands' --json:
a hand edit, or a planner change that moves a figure, fails here until `make docs` is rerun."""

from __future__ import annotations

import importlib.util
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
# scripts/loso.py's refits (minutes at load)
@pytest.mark.timeout(900)
def test_committed_tables_are_what_make_docs_writes(loso_document):
    make_docs = _make_docs()
    make_docs.LOSO_DOCUMENT = loso_document  # scripts/loso.py's output of this session, not a second refit
    for path, tables in make_docs.render().items():
        text = path.read_text()
        for name, make in tables.items():
            assert make_docs.rewrite(text, name, make()) == text, (
                f"{path.name}: table '{name}' differs from what scripts/make_docs.py writes; run `make docs`")


def test_a_hand_edit_is_caught():
    make_docs = _make_docs()
    text = "intro\n<!-- table:bench -->\n| figure | value |\n<!-- /table:bench -->\nafter\n"
    assert make_docs.rewrite(text, "bench", "| new |") == "intro\n<!-- table:bench -->\n| new |\n<!-- /table:bench -->\nafter\n"
    assert make_docs.rewrite(text, "bench", "| figure | value |") == text
