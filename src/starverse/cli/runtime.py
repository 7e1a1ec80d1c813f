"""`starverse` subcommands of this area (see cli/__init__.py)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this area's commands to ``app``."""
