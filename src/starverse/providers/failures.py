"""The typed errors both launchers raise for a failed job, built in one place so they read the same.

A launcher decides *what* happened (a process killed by a signal or exited, a heartbeat lost, an actor dead,
an exception reported by a rank, the job's time up); these functions turn that into the error the supervisor
acts on by type: :class:`LostRankError` (drop the device, re-plan), :class:`RankCodeError` (retry on the same
devices), :class:`JobTimeoutError`, or a user error found inside a rank, re-raised as itself.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Mapping, Sequence

from starverse.errors import JobTimeoutError, LossCause, LostRankError, RankCodeError, StarverseError
from starverse.runtime.launch import RankError, RankSpec

log = logging.getLogger(__name__)


def describe_exit(code: int | None) -> str:
    """``multiprocessing``'s exit code in words: ``killed by signal SIGKILL``, ``exit code 1``."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def lost_process(spec: RankSpec, exitcode: int, *, node: str | None = None) -> LostRankError:
    """A rank whose process ended (``exitcode``: negative for a signal) without reporting a result."""
    where = f" on node {node}" if node else ""
    cause = LossCause.SIGNAL if exitcode < 0 else LossCause.EXIT_CODE
    return LostRankError(
        f"rank {spec.rank} ({spec.device_kind}, {spec.device}) {describe_exit(exitcode)}{where} without reporting a "
        "result; the other ranks were stopped. To fix: check that rank's log and memory (an out-of-memory kill "
        "shows as SIGKILL).",
        rank=spec.rank, device_kind=spec.device_kind, device=spec.device, node=node, cause=cause,
        signal=-exitcode if exitcode < 0 else None, exit_status=exitcode if exitcode >= 0 else None,
    )


def lost_heartbeat(spec: RankSpec, silent_s: float, *, node: str | None = None,
                   survived: bool = False) -> LostRankError:
    """A rank whose process is alive but has not sent a heartbeat for ``silent_s`` (stopped, or its host hung); it is
    killed. ``survived``: the other ranks went on (in-place recovery) instead of being stopped."""
    where = f" on node {node}" if node else ""
    others = "it was killed and the other replicas went on without it" if survived else \
        "it was stopped with the other ranks"
    return LostRankError(
        f"rank {spec.rank} ({spec.device_kind}, {spec.device}){where} sent no heartbeat for {silent_s:.0f} s; {others}. "
        "To fix: check that rank's host (a stopped process, swapping, a hung device).",
        rank=spec.rank, device_kind=spec.device_kind, device=spec.device, node=node, cause=LossCause.HEARTBEAT,
    )


def lost_actor(spec: RankSpec, detail: str, *, node: str | None = None, survived: bool = False) -> LostRankError:
    """A rank whose Ray actor died without reporting a result (killed, out of memory, its node lost);
    ``survived``: the other ranks went on (in-place recovery) instead of being stopped."""
    others = "the other replicas went on without it" if survived else "the other ranks were stopped"
    return LostRankError(
        f"rank {spec.rank} ({spec.device_kind}, {spec.device}) died on node {node}: its Ray actor is gone without "
        f"reporting a result ({detail}); {others}. To fix: check that rank's log (`ray logs`), "
        "its memory (an out-of-memory kill ends the worker) and whether its node was lost.",
        rank=spec.rank, device_kind=spec.device_kind, device=spec.device, node=node, cause=LossCause.ACTOR_DIED,
    )


def user_error(
    errors: Mapping[int, RankError], kind: type[StarverseError] = StarverseError
) -> BaseException | None:
    """A typed error raised inside a rank (the lowest such rank), re-raised as itself, whatever the launcher.

    Launchers ask twice: first for bad input (``kind=ConfigError``), which outranks everything; then, after a
    lost rank (whose peers' errors are consequences: a checkpoint whose collective lost its peer ends in a
    :class:`CheckpointError` on the survivors), for any other :class:`StarverseError`.
    """
    for rank in sorted(errors):
        user = errors[rank][2]
        if isinstance(user, kind):
            return user
    return None


def code_error(ranks: Sequence[RankSpec], errors: Mapping[int, RankError], *, node: str | None = None,
               exit_status: int | None = None) -> RankCodeError:
    """The error for the lowest rank that reported an exception."""
    rank = min(errors)
    text, tb, _ = errors[rank]
    if tb:
        log.error("rank %d traceback:\n%s", rank, tb)
    spec = ranks[rank]
    hint = ""
    if "timed out" in text.lower() or "timeout" in text.lower():
        hint = (
            " A peer did not join a collective within collective_timeout_s: it hung or is far slower. "
            "To fix: look at the other ranks' logs, or raise collective_timeout_s."
        )
    where = f" on node {node}" if node else ""
    return RankCodeError(
        f"rank {rank} ({spec.device_kind}, {spec.device}) failed{where}: {text}; the other ranks were stopped.{hint}",
        rank=rank, device_kind=spec.device_kind, device=spec.device, node=node, error=text, traceback=tb,
        exit_status=exit_status,
    )


def overrun(timeout_s: float, done: int, world: int, why: str = "") -> JobTimeoutError:
    """The error for a job past its ``timeout_s`` with ``done`` of ``world`` ranks finished."""
    return JobTimeoutError(
        f"job did not finish within {timeout_s:g} s ({done}/{world} ranks done{why}); all ranks were stopped. "
        "To fix: raise the timeout or lower max_steps.",
        timeout_s=timeout_s, num_done=done, world_size=world,
    )
