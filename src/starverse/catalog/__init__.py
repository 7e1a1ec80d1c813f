"""Hardware catalog: accelerators (datasheet or measured figures, each with a source), offers, currencies.

Pure data and arithmetic (no torch). ``load_catalog()`` gives the bundled catalog extended by the user's file
(``--catalog FILE`` / ``$STARVERSE_CATALOG``) and the probe profile; ``convert()`` converts money.
"""

from __future__ import annotations

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

def convert(amount: float, from_ccy: str, to_ccy: str, catalog: Catalog | None = None) -> float:
    """Convert ``amount`` from one currency to another (ISO codes) with the catalog's rate table.

    ``catalog`` defaults to the bundled one extended by ``$STARVERSE_CATALOG``. Raises CatalogError for an
    unknown currency code.
    """
    # no probe profile: rates do not depend on it (load_catalog caches, so this is cheap in loops)
    return (catalog or load_catalog(profile="")).convert(amount, from_ccy, to_ccy)
