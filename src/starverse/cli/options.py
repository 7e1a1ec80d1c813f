"""Checks shared by command-line options (typer callbacks).

click's ``FloatRange`` lets ``inf`` and ``nan`` through (``nan`` compares false with both bounds): a float
option that means a finite quantity takes ``callback=finite``, and a non-finite value is one error line
naming the option, exit 2, like any bad input.
"""

from __future__ import annotations

import math

import typer

from starverse.errors import ConfigError


def finite(ctx: typer.Context, param: typer.CallbackParam, value: float | None) -> float | None:
    """The option's value if it is finite (or not given); ``ConfigError`` otherwise."""
    if value is not None and not math.isfinite(value):
        name = max(param.opts, key=len) if param.opts else param.name
        raise ConfigError(f"{name}: must be a finite number (got {value})")
    return value
