"""``scripts/loso.py``'s command line: a real ``--help``, and bad input as one line naming the file and the fix,
exit 2 (no traceback), as the ``starverse`` CLI reports a ``ConfigError``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _loso(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REPO / "scripts" / "loso.py"), *args], capture_output=True,
                          text=True, timeout=120, check=False)


def test_help_describes_the_script_and_its_argument() -> None:
    res = _loso("--help")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("usage: loso.py [-h] [FOLDER ...]")
    assert "Refit every fitted constant" in res.stdout and "data/validation" in res.stdout
    assert res.stderr == ""


def test_bad_input_is_one_line_naming_the_file_and_exit_2(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-folder"
    (tmp_path / "empty").mkdir()
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "case.yaml").write_text("plan: 1\n")
    for args, expected in [
        ([str(missing)], f"error: {missing}: no such file or folder; pass validation case files or folders of them"),
        ([str(tmp_path / "empty")], f"error: {tmp_path / 'empty'}: no validation cases (*.yaml) here; pass case "
                                    "files or folders of them (data/validation holds the bundled ones)"),
        ([str(bad)], f"error: {bad / 'case.yaml'}:1: plan: unknown field; known fields: model, train, groups, "
                     "network, pricing, measured, source"),
    ]:
        res = _loso(*args)
        assert res.returncode == 2, (args, res.stderr)
        assert res.stderr.splitlines() == [expected], res.stderr
        assert res.stdout == ""


def test_an_unknown_option_is_a_usage_error() -> None:
    res = _loso("--bogus")
    assert res.returncode == 2
    assert res.stderr.splitlines()[-1] == "loso.py: error: unrecognized arguments: --bogus"
    assert "Traceback" not in res.stderr
