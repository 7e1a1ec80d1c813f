"""Held-out evaluation through pipeline stages (forward only, through each replica's schedule).

With a pipelined plan no rank holds the whole model, so the held-out split is scored by the pipelines: replica
``r`` of ``R`` takes the held-out sequences ``r, r + R, ...`` and runs them forward only through its stages
(:meth:`PipelineRunner.evaluate`: ``schedule.eval`` on stages of its own), ``n`` micro-batches of ``micro_batch``
sequences per schedule step (``n`` = the replica's stages, the fewest every schedule runs). The last stage sums
the next-token loss over the labelled tokens and counts them; :class:`~starverse.runtime.runlog.EvalCallback`
sums these over all ranks, so the result is the exact mean token loss of the whole split, as one process scores it.

Every replica runs the same number of schedule steps (the last one padded with rows whose labels are all -100:
no loss, no count), so replicas whose stages are sharded together (ZeRO inside stages) gather in step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from starverse.runtime.data import IGNORE_INDEX, PackedDataset
from starverse.runtime.parallel.pipeline import PipelineRunner


@dataclass(frozen=True)
class PipelineScorer:
    """Scores this rank's part of a held-out split through its pipeline (``TrainContext.held_out_scorer``)."""

    runner: PipelineRunner
    """This rank's chunks and pipeline group."""
    replica: int
    """This rank's data-parallel replica."""
    num_replicas: int
    """Replicas in the plan (all groups)."""
    micro_batch: int
    """Sequences per micro-batch."""
    reports: bool
    """This rank's sums count: the last stage, TP rank 0 (the other TP ranks compute the same loss)."""

    def __call__(self, data: PackedDataset) -> torch.Tensor:
        """``[loss summed over labelled tokens, labelled tokens]`` (float64) of this rank: zeros unless it reports."""
        n = max(1, self.runner.num_stages)
        rows = n * self.micro_batch
        most = -(-len(data) // self.num_replicas)  # held-out sequences of the replica that has the most
        mine = np.arange(self.replica, len(data), self.num_replicas)
        total = torch.zeros(2, dtype=torch.float64)
        for s in range(-(-most // rows)):
            idx = mine[s * rows : (s + 1) * rows]
            x = np.zeros((rows, data.seq_len), dtype=np.int64)
            y = np.full((rows, data.seq_len), IGNORE_INDEX, dtype=np.int64)
            if len(idx):
                x[: len(idx)] = data.batch(idx)
                lab = data.batch_labels(idx)
                y[: len(idx)] = x[: len(idx)] if lab is None else lab
            loss = self.runner.evaluate(torch.from_numpy(x), torch.from_numpy(y), n)
            if self.reports:
                total += torch.tensor([loss, float((y[:, 1:] != IGNORE_INDEX).sum())], dtype=torch.float64)
        return total
