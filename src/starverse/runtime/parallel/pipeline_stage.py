"""The ``torch.distributed.pipelining`` pieces a pipeline rank runs: a timed ``PipelineStage`` and the schedules.

Kept apart from :mod:`starverse.runtime.parallel.pipeline` so that importing the runtime does not import
``torch.distributed.pipelining`` (and ``torch._dynamo`` with it): only a rank that runs a pipeline pays for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from starverse.runtime.parallel.pipeline import PipelineTimes

SCHEDULES: dict[str, Any] = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}
"""The schedule class of each ``train.schedule`` value."""


class TimedStage(PipelineStage):
    """A ``PipelineStage`` that times each forward and backward of a micro-batch and reports it."""

    def __init__(self, *args: Any, times: Callable[[], PipelineTimes], on_compute: Callable[[float], None],
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._times = times
        self._on_compute = on_compute

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = super().forward_one_chunk(*args, **kwargs)
        self._on_compute(time.perf_counter() - t0)  # inside the timed span: a slowed rank is slow here
        self._times().forward_s.append(time.perf_counter() - t0)
        return out

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = super().backward_one_chunk(*args, **kwargs)
        self._on_compute(time.perf_counter() - t0)
        self._times().backward_s.append(time.perf_counter() - t0)
        return out
