"""Preemption notice -> stop at a step boundary, all ranks together, with an emergency checkpoint.

``PreemptionCallback`` polls its notice sources after every step; the ranks agree (one tiny all-reduce
on the context's gloo group: a notice on any rank stops every rank at the same step). The agreed notice is
left in ``ctx.notice`` and the stop requested; ``CheckpointCallback.on_fit_end`` then writes the emergency
checkpoint synchronously, so the step that was running when the notice came is not lost.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist

from starverse.elastic.notice import Notice, NoticeSource, NoticeWatcher, SignalNotice
from starverse.runtime.callbacks import Callback, TrainContext

log = logging.getLogger(__name__)


class PreemptionCallback(Callback):
    """Watch for preemption notices; on one, stop every rank at the next step boundary."""

    def __init__(self, sources: Sequence[NoticeSource] | None = None, *, grace_s: float = 30.0):
        """``sources``: default SIGTERM; ``grace_s``: time the provider allows between notice and loss
        (the emergency checkpoint is logged as an error if it takes longer)."""
        self.sources = list(sources) if sources is not None else None
        self.grace_s = grace_s
        self.watcher: NoticeWatcher | None = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["watcher"] = None
        return state

    def on_fit_start(self, ctx: TrainContext) -> None:
        """Start watching (signal handlers go in now, in the rank's main thread)."""
        self.watcher = NoticeWatcher(self.sources if self.sources is not None else [SignalNotice()])
        self.watcher.start()
        ctx.grace_s = self.grace_s

    def on_step_end(self, ctx: TrainContext) -> None:
        """Agree over all ranks whether any saw a notice; if so, record it and request the stop."""
        assert self.watcher is not None
        local = self.watcher.poll()
        if ctx.world_size > 1 and ctx.group is not None:
            flag = torch.tensor([1 if local is not None else 0], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ctx.group)
            agreed = bool(flag.item())
        else:
            agreed = local is not None
        if agreed and ctx.notice is None:
            local = local or self.watcher.check_now()  # a peer saw one: is it up on this device's endpoint too?
            notice = local or Notice(source="another rank", detail=f"a peer of rank {ctx.rank} got a notice")
            ctx.notice = notice
            ctx.request_stop(f"preempted ({notice.source}): emergency checkpoint at step {ctx.step}")

    def on_fit_end(self, ctx: TrainContext) -> None:
        """Stop watching (restores the previous SIGTERM handler)."""
        if self.watcher is not None:
            self.watcher.stop()
