"""Leave-one-source-out check of the cost model: refit every fitted constant without each source of
data/validation and score that source with it. Prints one JSON object (``costmodel.fit.leave_one_source_out``).

Usage: .venv/bin/python scripts/loso.py [FOLDER ...]   (default: data/validation)

Bad input (a folder that does not exist, a malformed case file, no cases) is one line on stderr and exit 2,
as the ``starverse`` CLI reports a ``StarverseError``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from starverse.catalog import load_catalog
from starverse.costmodel.fit import leave_one_source_out
from starverse.costmodel.validate import find_cases, load_case
from starverse.errors import ConfigError, StarverseError

DEFAULT_FOLDER = Path(__file__).resolve().parents[1] / "data" / "validation"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="loso.py",
        description="Refit every fitted constant of the cost model without each source of the validation cases "
        "and score that source with it; print one JSON object (fitted values per held-out source, held-out "
        "figures per source, pooled figures).",
    )
    ap.add_argument("folders", nargs="*", metavar="FOLDER",
                    help="validation case files or folders of *.yaml (default: the repository's data/validation)")
    return ap


def run(folders: list[str]) -> dict:
    """The leave-one-source-out document over the cases in ``folders``."""
    files = find_cases(folders)
    if not files:
        raise ConfigError(f"{', '.join(folders)}: no validation cases (*.yaml) here; pass case files or folders "
                          "of them (data/validation holds the bundled ones)")
    return leave_one_source_out([load_case(p) for p in files], load_catalog())


def main(argv: list[str]) -> int:
    """Run the check over the given folders and print the JSON document; user errors: one line, exit 2."""
    args = _parser().parse_args(argv)  # --help: usage and exit 0; an unknown option: usage line, exit 2
    try:
        doc = run(args.folders or [str(DEFAULT_FOLDER)])
    except StarverseError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
