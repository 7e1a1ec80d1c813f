"""One exception base for everything a user can cause.

The CLI prints a ``StarverseError`` as one line and exits 2; any other exception is a bug and keeps its
traceback. Messages say what failed, why, and what to do.
"""

from __future__ import annotations

from collections.abc import Sequence


class StarverseError(Exception):
    """Base of all user-facing errors (bad input, infeasible requests, lost devices)."""

    exit_code = 2


class ConfigError(StarverseError):
    """A file or argument the user gave is malformed or inconsistent.

    ``loc``: the field path inside the file (``("groups", 0, "stages", 0, "tp")``) when the check that failed
    ran after loading (the plan against its model, say), so that the caller who knows the file adds its line.
    """

    def __init__(self, message: str, loc: Sequence[int | str] | None = None):
        super().__init__(message)
        self.loc = None if loc is None else tuple(loc)


class CatalogError(ConfigError):
    """An unknown accelerator, offer or price, or a malformed catalog file."""


class ModelError(ConfigError):
    """An unknown model id or an unsupported/malformed model config."""


class InfeasiblePlanError(StarverseError):
    """Nothing in the search space satisfies the job; ``reasons`` says why and what would help."""

    def __init__(self, message: str, reasons: Sequence[str] = ()):
        self.reasons = tuple(reasons)
        super().__init__(message if not self.reasons else message + " " + "; ".join(self.reasons))


class PreemptedError(StarverseError):
    """The job stopped because devices were taken back (after writing what it could)."""

    exit_code = 3


class TrainingDivergedError(StarverseError):
    """The loss or the gradient became inf/NaN: training stopped at that step, before the optimizer applied it
    and before any checkpoint of it (restarting with the same settings would diverge again)."""


class CheckpointError(StarverseError):
    """A checkpoint is missing, foreign, torn or corrupted."""


class BillingError(StarverseError):
    """The ledger refused an operation (unknown currency, overlap, corrupted database)."""


class BudgetExceededError(BillingError):
    """A lease or plan would exceed the budget."""


class DistributedError(StarverseError):
    """A rank died or a collective timed out."""

    exit_code = 4
