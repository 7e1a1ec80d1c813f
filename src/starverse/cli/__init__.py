"""The ``starverse`` command line: subcommands are plain functions over the library.

Each area registers its commands from its own module (``cli/<area>.py`` with ``register(app)``), so the
CLI grows without one giant file. Modules import heavy dependencies (torch) inside the command function,
never at import time: ``starverse plan`` must start fast on machines without torch.
"""

from __future__ import annotations

import importlib
import sys

import typer
from rich.console import Console

from starverse.errors import StarverseError

app = typer.Typer(
    name="starverse",
    help="Plan, run and account for training on mixed rented accelerators.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

err_console = Console(stderr=True, highlight=False, soft_wrap=True)



@app.callback()
def _root() -> None:
    """Plan, run and account for training on mixed rented accelerators."""


@app.command()
def version() -> None:
    """Print the Starverse version."""
    from starverse import __version__

    typer.echo(__version__)


_AREAS = ("catalog", "models", "estimate", "plan", "runtime", "checkpoints", "bill", "runs", "serve")
for _area in _AREAS:
    importlib.import_module(f"starverse.cli.{_area}").register(app)


def main(argv: list[str] | None = None) -> int:
    """Entry point: user errors become one line on stderr and exit code 2 (or the error's own code).

    Usage errors (unknown option, missing argument) are handled by typer itself, also with exit code 2.
    """
    try:
        app(args=argv, prog_name="starverse")
    except StarverseError as e:
        err_console.print(f"error: {e}", markup=False)
        return e.exit_code
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
