"""The ``starverse`` command line: subcommands are plain functions over the library.

Each area registers its commands from its own module (``cli/<area>.py`` with ``register(app)``), so the
CLI grows without one giant file. Modules import heavy dependencies (torch) inside the command function,
never at import time: ``starverse plan`` must start fast on machines without torch.
"""

from __future__ import annotations

import errno
import importlib
import sys

import typer
from rich.console import Console

from starverse.errors import StarverseError

try:  # typer >= 0.20 vendors click; older typers use it
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover - depends on the installed typer
    from click import exceptions as click_errors  # type: ignore[no-redef]

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


_PATH_ERRORS = {
    errno.ENAMETOOLONG: "file name too long (at most 255 bytes between slashes, 4096 in all). To fix: give a "
                        "shorter path",
    errno.ELOOP: "a symlink loop (links that point at each other, or at themselves). To fix: give the path of a "
                 "real file or folder (`ls -l` shows where each link points)",
}
"""OS errors of a path the user gave, whatever reached it first, and what they mean."""


def _shown(filename: object) -> str:
    """A path of at most ~60 characters: its start and its end (the file's own name) kept."""
    name = str(filename or "")
    return name if len(name) <= 60 else name[:20] + "..." + name[-37:]


def _symlink_loop(e: RuntimeError) -> OSError | None:
    """The ELOOP error behind ``Path.resolve()``'s RuntimeError (Python before 3.13 raises one for a symlink
    loop, from ``pathlib``'s ``check_eloop``, holding the OSError); None for any other RuntimeError."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None or tb.tb_frame.f_code.co_name != "check_eloop":
        return None
    cause = tb.tb_frame.f_locals.get("e")
    return cause if isinstance(cause, OSError) and cause.errno == errno.ELOOP else None


def main(argv: list[str] | None = None) -> int:
    """Entry point: user errors become one line on stderr and exit code 2 (or the error's own code).

    Usage errors (unknown option, missing argument, an option out of its range) are one line too, naming the
    command and its ``--help``, exit code 2: click raises them (``standalone_mode=False``) instead of drawing
    its multi-line panel.
    """
    try:
        code = app(args=argv, prog_name="starverse", standalone_mode=False)
    except StarverseError as e:
        err_console.print(f"error: {e}", markup=False)
        return e.exit_code
    except click_errors.NoArgsIsHelpError as e:  # `starverse` or a group alone: its help, as before
        e.show()
        return e.exit_code
    except click_errors.UsageError as e:
        command = e.ctx.command_path if e.ctx is not None else "starverse"
        message = " ".join(e.format_message().split()).rstrip(".")
        err_console.print(f"error: {command}: {message}. To fix: see `{command} --help`", markup=False)
        return e.exit_code
    except click_errors.ClickException as e:
        err_console.print(f"error: {' '.join(e.format_message().split())}", markup=False)
        return e.exit_code
    except OSError as e:
        if e.errno not in _PATH_ERRORS:  # any other OS error is a bug here: its traceback is kept
            raise
        # a path argument longer than the OS takes or a symlink loop (checked by no command before a stat)
        err_console.print(f"error: {_shown(e.filename)}: {_PATH_ERRORS[e.errno]}", markup=False)
        return 2
    except RuntimeError as e:
        loop = _symlink_loop(e)
        if loop is None:
            raise
        err_console.print(f"error: {_shown(loop.filename)}: {_PATH_ERRORS[errno.ELOOP]}", markup=False)
        return 2
    except typer.Abort:
        err_console.print("Aborted.", markup=False)
        return 1
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
