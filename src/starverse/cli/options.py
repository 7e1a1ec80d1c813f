"""Checks shared by command-line options (typer callbacks).

click's ``FloatRange`` lets ``inf`` and ``nan`` through (``nan`` compares false with both bounds): a float
option that means a finite quantity takes ``callback=finite``, and a non-finite value is one error line
naming the option, exit 2, like any bad input.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import typer

from starverse.checks import check_model
from starverse.config import where
from starverse.errors import ConfigError


def _option_name(param: typer.CallbackParam) -> str:
    """The option as a user types it (its longest spelling, ``--hours``), for messages."""
    return max(param.opts, key=len) if param.opts else str(param.name)


def finite(ctx: typer.Context, param: typer.CallbackParam, value: float | None) -> float | None:
    """The option's value if it is finite (or not given); ``ConfigError`` otherwise."""
    if value is not None and not math.isfinite(value):
        name = _option_name(param)
        raise ConfigError(f"{name}: must be a finite number (got {value})")
    return value


def finite_at_most(limit: float) -> Callable[[typer.Context, typer.CallbackParam, float | None], float | None]:
    """A ``callback`` like :func:`finite` that also refuses a value above ``limit`` (a range's ``max=`` would
    be checked first, and say nothing of ``inf``)."""

    def check(ctx: typer.Context, param: typer.CallbackParam, value: float | None) -> float | None:
        value = finite(ctx, param, value)
        if value is not None and value > limit:
            name = _option_name(param)
            raise ConfigError(f"{name}: must be at most {limit:,g} (got {value:g}). To fix: pass a smaller {name}")
        return value

    return check


@contextmanager
def at_line(source: Path) -> Iterator[None]:
    """Errors found after ``source`` was loaded (its plan against the model and the catalog) that name a field
    (``ConfigError.loc``) get the file and the field's line in front, like the loader's own errors."""
    try:
        yield
    except ConfigError as e:
        if e.loc is None:
            raise
        raise type(e)(f"{where(source, e.loc)}: {e}", e.loc) from None


def model_of(source: Path, ref: str) -> Any:
    """The model ``source`` names in its ``model:`` field; an unknown or malformed one is an error at that line."""
    return check_model(ref, source, base_dir=source.parent)
