"""Hardware catalog: accelerators (datasheet or measured figures, each with a source), offers, currencies.

Pure data and arithmetic (no torch). ``load_catalog()`` gives the bundled catalog extended by the user's file
(``--catalog FILE`` / ``$STARVERSE_CATALOG``) and the probe profile; ``convert()`` converts money.
"""

from __future__ import annotations

import os
from pathlib import Path

from starverse.catalog.core import (
    BACKENDS,
    FLOAT_FIELDS,
    LINKS,
    PRECISIONS,
    STACKS,
    Accelerator,
    Catalog,
    Currency,
    Offer,
)
from starverse.catalog.loader import (
    CATALOG_ENV,
    PROFILE_ENV,
    bundled_catalog,
    default_profile_path,
    load_catalog,
)

__all__ = [
    "BACKENDS",
    "CATALOG_ENV",
    "FLOAT_FIELDS",
    "LINKS",
    "PRECISIONS",
    "PROFILE_ENV",
    "STACKS",
    "Accelerator",
    "Catalog",
    "Currency",
    "Offer",
    "bundled_catalog",
    "convert",
    "default_profile_path",
    "load_catalog",
]

_rates_cache: dict[tuple[str, float], Catalog] = {}


def _rates_catalog() -> Catalog:
    """Bundled + $STARVERSE_CATALOG (no profile: rates do not depend on it), re-read when that file changes."""
    env = os.environ.get(CATALOG_ENV, "")
    mtime = Path(env).stat().st_mtime if env and Path(env).is_file() else 0.0
    key = (env, mtime)
    if key not in _rates_cache:
        _rates_cache.clear()
        _rates_cache[key] = load_catalog(profile="")
    return _rates_cache[key]


def convert(amount: float, from_ccy: str, to_ccy: str, catalog: Catalog | None = None) -> float:
    """Convert ``amount`` from one currency to another (ISO codes) with the catalog's rate table.

    ``catalog`` defaults to the bundled one extended by ``$STARVERSE_CATALOG``. Raises CatalogError for an
    unknown currency code.
    """
    return (catalog or _rates_catalog()).convert(amount, from_ccy.upper(), to_ccy.upper())
