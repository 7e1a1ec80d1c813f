"""Failure and straggler injection for tests and benchmarks: never reached by a user by accident.

These are ordinary :class:`~starverse.runtime.callbacks.Callback` objects that a test passes to
``Trainer(callbacks=[...])`` explicitly; no configuration key or environment variable turns them on.
"""

from __future__ import annotations

import os
import signal as _signal
import time
from dataclasses import dataclass
from pathlib import Path

from starverse.runtime.callbacks import Callback, TrainContext


@dataclass
class SlowRank(Callback):
    """Make rank ``rank`` ``factor`` times slower: after each micro-batch it sleeps (factor-1)× its compute time.

    The sleep happens inside the timed compute of the micro-batch, so the rebalancer sees a device that
    is ``factor`` times slower, as it would see a slower accelerator.
    """

    rank: int
    """The rank to slow down."""
    factor: float
    """Slow-down factor (> 1)."""

    def __post_init__(self) -> None:
        if self.factor < 1:
            raise ValueError(f"SlowRank.factor must be >= 1 (got {self.factor})")

    def on_micro_batch_end(self, ctx: TrainContext, compute_s: float) -> None:
        """Sleep so this micro-batch takes ``factor`` times its real compute time."""
        if ctx.rank == self.rank:
            time.sleep((self.factor - 1.0) * compute_s)


@dataclass
class KillRank(Callback):
    """Kill rank ``rank`` with ``signal`` right after optimizer step ``step`` (a lost spot device)."""

    rank: int
    """The rank to kill."""
    step: int
    """Kill after this many optimizer steps."""
    signal: int = _signal.SIGKILL
    """Signal to send (SIGKILL: hard loss; SIGTERM: a provider's preemption notice)."""

    def on_step_end(self, ctx: TrainContext) -> None:
        """Send the signal to this process when the step is reached on the chosen rank."""
        if ctx.rank == self.rank and ctx.step == self.step:
            os.kill(os.getpid(), self.signal)


@dataclass
class KillReplicaMidStep(Callback):
    """In-place recovery runs: SIGKILL replica ``replica`` in the middle of step ``step`` (after its first
    micro-batch's backward, before the gradient all-reduce: the step is in flight on every replica).

    A replica is known by ``$RANK`` (set by the launcher in each rank process); ``on_micro_batch_end`` runs on
    every replica (other hooks of an in-place run only on the leader). A replacement started for the same rank
    is not killed again (``$STARVERSE_JOINER``)."""

    replica: int
    """The replica (rank) to kill."""
    step: int
    """The step (1-based) during which it dies."""

    def on_micro_batch_end(self, ctx: TrainContext, compute_s: float) -> None:
        """Die when the chosen replica is computing the chosen step."""
        if (int(os.environ.get("RANK", "-1")) == self.replica and ctx.step + 1 == self.step
                and not os.environ.get("STARVERSE_JOINER")):
            os.kill(os.getpid(), _signal.SIGKILL)


HUNG_FILE = "hung-{rank}.pid"
"""Run-directory file :class:`HangReplicaMidStep` writes: the stopped replica's pid, and its socket holder's."""


@dataclass
class HangReplicaMidStep(Callback):
    """In-place recovery runs: SIGSTOP replica ``replica`` in the middle of step ``step`` (where
    :class:`KillReplicaMidStep` kills): the process lives, silent, its connections open, until someone kills it.

    ``keep_connections``: first fork a child that holds copies of every socket of the replica and stops itself
    too, so that killing the replica does not close its connections: its peers see what they see of a host lost
    off the network (connections that stay open and carry nothing), not a closed socket. The pids (replica,
    then holder) are written to ``run_dir/hung-<rank>.pid``; the test kills the holder."""

    replica: int
    """The replica (rank) to stop."""
    step: int
    """The step (1-based) during which it stops."""
    keep_connections: bool = False
    """Leave its connections open after it is killed (a socket-holding child, see above)."""

    def on_micro_batch_end(self, ctx: TrainContext, compute_s: float) -> None:
        """Stop when the chosen replica is computing the chosen step."""
        if (int(os.environ.get("RANK", "-1")) != self.replica or ctx.step + 1 != self.step
                or os.environ.get("STARVERSE_JOINER")):
            return
        pids = [os.getpid()]
        if self.keep_connections:
            holder = os.fork()
            if holder == 0:  # the child: only async-signal-safe calls (a fork of a threaded process)
                os.kill(os.getpid(), _signal.SIGSTOP)
                os._exit(0)
            pids.append(holder)
        (Path(ctx.run_dir) / HUNG_FILE.format(rank=self.replica)).write_text(" ".join(map(str, pids)))
        os.kill(os.getpid(), _signal.SIGSTOP)


@dataclass
class WaitForReplicas(Callback):
    """In-place recovery runs: after step ``after_step``, slow every micro-batch (``pause_s``) while fewer than
    ``replicas`` replicas took part in the last step, so that a replacement has time to join before the run
    ends (tests of joining; bounded by the job's timeout)."""

    replicas: int
    """Replicas to wait for."""
    after_step: int
    """Wait only after this step (the loss happens before it)."""
    pause_s: float = 0.2
    """Sleep per micro-batch while waiting."""

    def on_micro_batch_end(self, ctx: TrainContext, compute_s: float) -> None:
        """Pause while the last step had fewer participants than wanted."""
        if ctx.step >= self.after_step and len(ctx.metrics.shares) < self.replicas:
            time.sleep(self.pause_s)


HOLD_FILE = "hold"
"""Run-directory file :class:`HoldAfterStep` creates and waits on."""


@dataclass
class HoldAfterStep(Callback):
    """Hold the run after step ``step`` until someone removes ``run_dir/hold`` (the file appears when the hold
    starts): a test or benchmark does something from outside at a known step (remove a Ray node) although a tiny
    model's steps take milliseconds. Runs where ``on_step_end`` runs (rank 0; an in-place run's leader)."""

    step: int
    """Hold after this step."""
    max_hold_s: float = 120.0
    """Go on after this long even if the file is still there."""

    def on_step_end(self, ctx: TrainContext) -> None:
        """Create the hold file after ``step``; wait until it is gone."""
        if ctx.step != self.step:
            return
        flag = Path(ctx.run_dir) / HOLD_FILE
        flag.write_text("")
        deadline = time.monotonic() + self.max_hold_s
        while flag.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
