"""One exception base for everything a user can cause.

The CLI prints a ``StarverseError`` as one line and exits 2; any other exception is a bug and keeps its
traceback. Messages say what failed, why, and what to do.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum


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
        self.message = message
        self.reasons = tuple(reasons)
        super().__init__(message if not self.reasons else message + " " + "; ".join(self.reasons))


class SearchTimeLimitError(StarverseError):
    """The planner's search ran past the time it was given (the service's ``plan_time_limit_s``): the request
    is larger than the service plans; nothing was cached."""


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


class LossCause(StrEnum):
    """How a rank was lost (a device or its process gone, not a bug in the model)."""

    SIGNAL = "signal"
    """Its process was killed by a signal (SIGKILL: the OOM killer, a spot reclaim, ``kill -9``)."""
    EXIT_CODE = "exit code"
    """Its process exited with a non-zero code without reporting an error."""
    HEARTBEAT = "heartbeat timeout"
    """It stopped answering heartbeats (a hung process or an unreachable node)."""
    ACTOR_DIED = "actor death"
    """Its Ray actor died (killed, out of memory, or its node left the cluster)."""
    REPLICA = "replica lost"
    """In-place recovery: another rank of its replica (a pipeline's stage) was lost, so the launcher stopped it
    (its device is sound; the replica cannot train without the lost stage)."""


class RankFailedError(DistributedError):
    """A rank of the job failed; the other ranks were stopped. The supervisor acts on the subclass."""

    def __init__(self, message: str, *, rank: int, device_kind: str, device: str = "cpu", node: str | None = None):
        super().__init__(message)
        self.rank = rank
        """The failed rank (in the job's numbering)."""
        self.device_kind = device_kind
        """Its accelerator id."""
        self.device = device
        """Its torch device string."""
        self.node = node
        """The node it ran on (an IP for Ray; None: this machine)."""

    @property
    def failed_rank(self) -> int:
        """Alias of ``rank``."""
        return self.rank


class LostRankError(RankFailedError):
    """A rank's device or process is gone (killed, exited, silent, actor or node lost): a lost device, which
    the supervisor drops before re-planning on the survivors."""

    def __init__(self, message: str, *, rank: int, device_kind: str, cause: LossCause, device: str = "cpu",
                 node: str | None = None, signal: int | None = None, exit_status: int | None = None):
        super().__init__(message, rank=rank, device_kind=device_kind, device=device, node=node)
        self.cause = cause
        """How it was lost."""
        self.signal = signal
        """The signal number that killed it (cause SIGNAL)."""
        self.exit_status = exit_status
        """Its process's exit code (cause EXIT_CODE; ``exit_code`` is the CLI's)."""

    @property
    def rank_exitcode(self) -> int | None:
        """``multiprocessing``'s convention: negative for a signal, else the exit code (None: unknown)."""
        return -self.signal if self.signal is not None else self.exit_status


class RankCodeError(RankFailedError):
    """A rank raised an exception (a bug or bad data in the model code, or a collective that timed out
    because a peer hung): not a lost device; the supervisor retries on the same devices."""

    def __init__(self, message: str, *, rank: int, device_kind: str, error: str, device: str = "cpu",
                 node: str | None = None, traceback: str | None = None, exit_status: int | None = None):
        super().__init__(message, rank=rank, device_kind=device_kind, device=device, node=node)
        self.error = error
        """The exception's one line (``ValueError: ...``)."""
        self.traceback = traceback
        """Its traceback in the rank, when it could be sent."""
        self.exit_status = exit_status
        """The rank process's exit code, when known."""

    @property
    def rank_exitcode(self) -> int | None:
        """The rank process's exit code, when known."""
        return self.exit_status


class JobTimeoutError(DistributedError):
    """The whole job ran past its ``timeout_s``; every rank was stopped."""

    def __init__(self, message: str, *, timeout_s: float, num_done: int, world_size: int):
        super().__init__(message)
        self.timeout_s = timeout_s
        """The limit."""
        self.num_done = num_done
        """Ranks that had finished."""
        self.world_size = world_size
        """Ranks of the job."""
