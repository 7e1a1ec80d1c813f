"""Checkpoints inside ``Trainer.fit``: resume, periodic asynchronous saves, and a final/emergency save.

``CheckpointCallback`` is the only thing the runtime needs to know about checkpoints. It

- resumes (``resume_from``: a step, ``"latest"``, or None) in ``on_fit_start``: model and optimizer
  through DCP (any world size), LR schedule, sampler position, step, token count, shares, RNG;
- saves every ``interval_steps`` steps, or, by default, at the Young/Daly interval computed from the
  save cost it measures (after a first save at step 1) and the job's MTBF; the choice is logged with its
  reason and recorded in every manifest;
- saves once more, synchronously, in ``on_fit_end`` (reason ``notice`` after a preemption notice, so no
  step is lost, else ``final``).
"""

from __future__ import annotations

import logging
import math
import re
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from starverse.checkpoint.checkpointer import Checkpointer, LoadedState
from starverse.checkpoint.store import CheckpointInfo, CheckpointStore, resolve_root
from starverse.elastic.interval import DEFAULT_MAX_INTERVAL_S, IntervalChoice, choose_interval
from starverse.runtime.callbacks import Callback, CommittedCheckpoint, TrainContext

log = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"^step-\d+$")


class CheckpointCallback(Callback):
    """Periodic, asynchronous, atomic checkpoints of a training run, and resume from them."""

    def __init__(
        self,
        directory: str | Path | None = None,
        *,
        interval_steps: int | None = None,
        mtbf_s: float = math.inf,
        max_interval_s: float = DEFAULT_MAX_INTERVAL_S,
        keep_last: int | None = 3,
        keep_every: int | None = None,
        async_save: bool = True,
        resume_from: int | str | None = None,
        final_save: bool = True,
        billing_cursor: Callable[[TrainContext], Mapping[str, Any]] | None = None,
        collective_timeout_s: float = 120.0,
        writer_factory: Any = None,
    ):
        """``directory``: checkpoint root (default ``RUN_DIR/checkpoints``); ``interval_steps``: fixed
        interval (None: Young/Daly from the measured save cost and ``mtbf_s``); ``resume_from``: a step,
        ``"latest"`` (resume if any checkpoint exists) or None; ``billing_cursor(ctx)``: the billing
        engineer's opaque cursor saved in each manifest."""
        self.directory = Path(directory) if directory is not None else None
        self.interval_steps = interval_steps
        self.mtbf_s = mtbf_s
        self.max_interval_s = max_interval_s
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.async_save = async_save
        self.resume_from = resume_from
        self.final_save = final_save
        self.billing_cursor = billing_cursor
        self.collective_timeout_s = collective_timeout_s
        self.writer_factory = writer_factory
        self.checkpointer: Checkpointer | None = None
        self.choice: IntervalChoice | None = None
        """The current interval and why (logged, and written into each manifest)."""
        self.resumed: LoadedState | None = None
        """What this rank resumed from (None: a fresh start)."""
        self._loaded = False
        self._last_saved_step = -1
        self._pending: tuple[int, float] | None = None  # (step, blocked_s before) of the save in flight
        self._step_times: list[float] = []

    # pickled into every rank process: the live Checkpointer (threads, groups) is never pickled
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["checkpointer"] = None
        return state

    # ---- hooks -------------------------------------------------------------------------------------------
    def _setup(self, ctx: TrainContext) -> Checkpointer:
        """Create the checkpoint group and Checkpointer once per rank (``on_resume`` may come first)."""
        if self.checkpointer is not None:
            return self.checkpointer
        root = self.directory or Path(ctx.run_dir) / "checkpoints"
        store = CheckpointStore(root, keep_last=self.keep_last, keep_every=self.keep_every)
        group = None
        if ctx.world_size > 1:
            # Own group: background saves must never interleave with the trainer's collectives.
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.collective_timeout_s))
        self.checkpointer = Checkpointer(
            store,
            rank=ctx.rank,
            world_size=ctx.world_size,
            group=group,
            device_kind=ctx.device_kind,
            async_save=self.async_save,
            writer_factory=self.writer_factory,
        )
        return self.checkpointer

    def on_resume(self, ctx: TrainContext, path: Path) -> bool:
        """Load the checkpoint at ``path`` (a ``step-N`` folder, or a run/checkpoint directory: its latest)."""
        ck = self._setup(ctx)
        path = Path(path)
        if _STEP_DIR.match(path.name):
            info = CheckpointStore(path.parent).get(int(path.name.split("-", 1)[1]))
        else:
            store = CheckpointStore(resolve_root(path))
            store.require_any()
            latest = store.latest()
            assert latest is not None  # require_any raised otherwise
            info = latest
        self._load(ctx, ck, info)
        return True

    def on_fit_start(self, ctx: TrainContext) -> None:
        """Create the Checkpointer; resume if asked (and not already resumed through ``on_resume``)."""
        ck = self._setup(ctx)
        # Import DCP (~1.7 s) while the first steps run instead of blocking the first save.
        threading.Thread(target=_import_dcp, name="dcp-import", daemon=True).start()
        if not self._loaded:
            info = None
            if self.resume_from == "latest":
                info = ck.store.latest()
            elif self.resume_from is not None:
                info = ck.store.get(int(self.resume_from))
            if info is not None:
                self._load(ctx, ck, info)
            self._loaded = True
        if ctx.rank == 0:
            # Torn writes of earlier, crashed attempts: garbage, never loadable (see store.py).
            n = ck.store.clean_partials(keep_attempt=ck.attempt)
            if n:
                log.info("removed %d torn checkpoint write(s) in %s", n, ck.store.root)
        self._last_saved_step = ctx.step
        if self.interval_steps is not None:
            self.choice = choose_interval(
                step_time_s=1.0, save_cost_s=0.0, write_s=0.0, mtbf_s=math.inf, override_steps=self.interval_steps
            )
            self._announce(ctx)

    def _load(self, ctx: TrainContext, ck: Checkpointer, info: CheckpointInfo) -> LoadedState:
        """Load ``info`` into the context; a rollback (not the latest) moves newer checkpoints aside."""
        loaded = ck.load(info, ctx.model, ctx.optimizer)
        apply_extras(ctx, loaded.extras)
        if ctx.world_size > 1:
            dist.barrier(group=ck.group)  # every rank has loaded before rank 0 moves anything
        if ctx.rank == 0 and ck.store.root == info.path.parent:
            ck.store.set_aside_after(info.step)
        self.resumed, self._loaded = loaded, True
        log.info("rank %d resumed from %s (step %d, written by %d ranks%s)", ctx.rank, info.path, info.step,
                 info.world_size, ", resharded" if loaded.resharded else "")
        return loaded

    def on_step_end(self, ctx: TrainContext) -> None:
        """Save when the interval is due; refine the automatic interval once a save finished."""
        ck = self.checkpointer
        assert ck is not None
        if ctx.metrics.step_time_s > 0:
            self._step_times.append(ctx.metrics.step_time_s)
            del self._step_times[:-20]
        if self._pending is not None and not ck.in_flight:
            self._measured(ctx)
        self._publish(ctx)
        if ctx.notice is not None:
            return  # the stop is agreed; on_fit_end writes the emergency checkpoint
        due = (
            ctx.step - self._last_saved_step >= self.choice.steps
            if self.choice is not None
            else self._pending is None and ctx.step - self._last_saved_step >= 1  # first save: measures C, W
        )
        if due and ctx.step < ctx.max_steps:
            self._save(ctx, "interval", blocking=None)

    def on_fit_end(self, ctx: TrainContext) -> None:
        """Wait for the save in flight, then write the final (or emergency) checkpoint synchronously."""
        ck = self.checkpointer
        if ck is None:
            return
        notice = ctx.notice
        try:
            if self.final_save and ctx.step != self._last_saved_step:
                self._save(ctx, "notice" if notice is not None else "final", blocking=True)
            else:
                ck.wait()
            self._publish(ctx)
            if notice is not None:
                elapsed = time.monotonic() - notice.received_at
                grace = ctx.grace_s
                level = logging.INFO if elapsed <= grace else logging.ERROR
                log.log(level, "emergency checkpoint of step %d done %.1f s after the notice (grace %.0f s)",
                        ctx.step, elapsed, grace)
        finally:
            ck.close()

    # ---- internals -----------------------------------------------------------------------------------------
    def _save(self, ctx: TrainContext, reason: str, blocking: bool | None) -> None:
        ck = self.checkpointer
        assert ck is not None
        if self._pending is not None:
            ck.wait()
            self._measured(ctx)
        manifest: dict[str, Any] = {
            "plan": ctx.plan.to_yaml() if ctx.plan is not None else None,
            "model": {"name": getattr(ctx.plan, "model", None)},
            "metrics": {"loss": ctx.metrics.loss, "tokens_total": ctx.metrics.tokens_total,
                        "step_time_s": ctx.metrics.step_time_s},
            "interval": {"steps": self.choice.steps, "reason": self.choice.reason} if self.choice else None,
        }
        if self.billing_cursor is not None and ctx.rank == 0:
            manifest["billing_cursor"] = dict(self.billing_cursor(ctx))
        self._pending = (ctx.step, ck.stats.blocked_s)
        ck.save(ctx.step, ctx.model, ctx.optimizer, extras=extras_of(ctx), manifest=manifest, reason=reason,
                blocking=blocking)
        self._last_saved_step = ctx.step
        if blocking:
            self._measured(ctx)

    def _measured(self, ctx: TrainContext) -> None:
        """A save finished: its blocked time and write time update the automatic interval."""
        ck = self.checkpointer
        assert ck is not None and self._pending is not None
        _, blocked_before = self._pending
        self._pending = None
        if self.interval_steps is not None or not self._step_times:
            return
        cost = ck.stats.blocked_s - blocked_before
        choice = choose_interval(
            step_time_s=statistics.median(self._step_times),
            save_cost_s=cost,
            write_s=ck.stats.last_write_s,
            mtbf_s=self.mtbf_s,
            max_interval_s=self.max_interval_s,
        )
        if self.choice is None or choice.steps != self.choice.steps:
            self.choice = choice
            self._announce(ctx)

    def _publish(self, ctx: TrainContext) -> None:
        """Tell later callbacks (billing, metrics) about the last committed checkpoint (rank 0)."""
        ck = self.checkpointer
        info = ck.last_committed if ck is not None else None
        if ck is None or info is None or ctx.rank != 0:
            return
        if ctx.committed is not None and ctx.committed.step == info.step:
            return
        ctx.committed = CommittedCheckpoint(
            step=info.step, at_s=int(datetime.fromisoformat(info.created_at).timestamp()),
            seconds=float(ck.stats.last_write_s), path=str(info.path), reason=info.reason,
        )

    def _announce(self, ctx: TrainContext) -> None:
        assert self.choice is not None
        if ctx.rank == 0:
            log.info("checkpoint interval: %s", self.choice.reason)


def extras_of(ctx: TrainContext) -> dict[str, Any]:
    """The global, non-tensor state a checkpoint saves besides model and optimizer."""
    return {
        "lr_scheduler": ctx.lr_scheduler.state_dict() if ctx.lr_scheduler is not None else None,
        "sampler": ctx.sampler.state_dict() if ctx.sampler is not None else None,
        "shares": list(ctx.shares),
        "tokens_total": ctx.metrics.tokens_total,
        "world_size": ctx.world_size,
    }


def apply_extras(ctx: TrainContext, extras: Mapping[str, Any]) -> None:
    """Restore what :func:`extras_of` saved (shares only on the same world size, as the runtime does)."""
    if ctx.lr_scheduler is not None and extras.get("lr_scheduler") is not None:
        ctx.lr_scheduler.load_state_dict(extras["lr_scheduler"])
    if ctx.sampler is not None and extras.get("sampler") is not None:
        ctx.sampler.load_state_dict(extras["sampler"])
    ctx.step = int(extras["step"])
    ctx.metrics.tokens_total = int(extras.get("tokens_total", 0))
    shares = [int(s) for s in extras.get("shares") or []]
    if len(shares) == len(ctx.shares) and sum(shares) == sum(ctx.shares or shares):
        ctx.shares = shares


def _import_dcp() -> None:
    import torch.distributed.checkpoint
    import torch.distributed.checkpoint.state_dict  # noqa: F401
