"""Run one rank's pipeline chunks with ``torch.distributed.pipelining`` (``PipelineStage`` + a schedule).

:class:`PipelineRunner` builds the rank's chunks (:mod:`.pipeline_split`) from the plan's uneven ``layers``,
wraps each in a ``PipelineStage`` over its replica's point-to-point group, and runs ``gpipe`` (``ScheduleGPipe``),
``1f1b`` (``Schedule1F1B``) or ``interleaved`` (``ScheduleInterleaved1F1B`` over ``virtual_stages`` chunks per
rank). As torchtitan does, the schedule is built with ``scale_grads=False`` and the loss already carries the
micro-batch's weight in the global batch (``micro_batch / global_batch``), so gradients summed over replicas are
those of the global batch's mean loss whatever each replica's share.

A replica's share of micro-batches changes when the rebalancer moves work; the stages and schedule are then
rebuilt for the new count (every rank of the replica does so at the same step: shares are agreed globally).

Point-to-point transfers use one group per pipeline: the device kind's native backend when all stages are of
one kind, else gloo with every chunk reading its input from and writing its output to host memory (the bridge:
device -> host -> gloo -> device; autograd carries gradients back the same way).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from starverse.errors import ConfigError
from starverse.runtime.launch import native_backend
from starverse.runtime.parallel.pipeline_layout import PipelineLayout
from starverse.runtime.parallel.pipeline_split import Chunk, cut
from starverse.runtime.steps import masked_cross_entropy, shifted_cross_entropy


def _summed_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A held-out micro-batch's next-token loss summed over its labelled tokens (the evaluation's loss)."""
    return masked_cross_entropy(logits, labels, 1)


def check_pipeline_loss_fn(loss_fn: Callable[..., torch.Tensor]) -> None:
    """:class:`ConfigError` unless ``loss_fn`` can be the last stage's loss: called as ``loss_fn(logits, labels)``
    per micro-batch (no stage holds the whole model, so it cannot take the model as ``fit``'s loss_fn does without
    pipelines), it may need no other argument."""
    import inspect

    try:
        params = list(inspect.signature(loss_fn).parameters.values())
    except (TypeError, ValueError):
        return  # a builtin or C function: called as (logits, labels)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    takes_two = len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)
    if len(required) > 2 or not takes_two or (positional and positional[0].name == "model"):
        names = ", ".join(p.name for p in params)
        raise ConfigError(
            f"loss_fn({names}): with pipeline stages the last stage calls loss_fn(logits, labels) per micro-batch "
            "(logits [batch, seq, vocab], labels: the micro-batch's token ids) and no stage holds the whole model. "
            "To fix: a loss_fn of (logits, labels) returning the micro-batch's mean loss, or one stage per group."
        )


def micro_batch_count_error(schedule: str, num_stages: int, n: int) -> str | None:
    """Why a pipeline of ``num_stages`` cannot run ``n`` micro-batches a step with ``schedule`` (None: it can)."""
    if num_stages <= 1:
        return None
    if schedule in ("1f1b", "interleaved") and n < num_stages:
        return f"{schedule} needs at least as many micro-batches as stages ({num_stages}), got {n}"
    rounds = max(1, n // num_stages)
    if schedule == "interleaved" and n % rounds:
        return f"interleaved needs a micro-batch count that is a multiple of its rounds ({rounds}), got {n}"
    return None


def min_micro_batches(schedule: str, num_stages: int) -> int:
    """The fewest micro-batches per step a replica of ``num_stages`` stages can run with ``schedule``."""
    return num_stages if schedule in ("1f1b", "interleaved") and num_stages > 1 else 1


@dataclass
class PipelineTimes:
    """What one rank's pipeline measured in the last step."""

    step_s: float = 0.0
    """Wall time of the schedule's step (forward and backward of all micro-batches, with the waits)."""
    forward_s: list[float] = field(default_factory=list)
    """Wall time of each chunk forward of the last step (one per chunk and micro-batch)."""
    backward_s: list[float] = field(default_factory=list)
    """Wall time of each chunk backward of the last step."""

    @property
    def busy_s(self) -> float:
        """Time this rank computed (forwards and backwards), without waiting for its neighbours."""
        return sum(self.forward_s) + sum(self.backward_s)

    @property
    def bubble(self) -> float:
        """Fraction of the step this rank waited (the pipeline bubble and transfers, as this rank saw it)."""
        return max(0.0, 1.0 - self.busy_s / self.step_s) if self.step_s > 0 else 0.0


def pipeline_groups(layout: PipelineLayout, rank_kinds: Sequence[str], rank_devices: Sequence[str]) -> dict[int, Any]:
    """The point-to-point group of every pipeline, keyed by the rank's replica (collective: every rank calls it).

    A pipeline of one device kind uses its native backend; one over several kinds uses gloo (the host bridge).
    Only the pipeline of this rank's TP index is returned under its replica.
    """
    me = dist.get_rank()
    mine: dict[int, Any] = {}
    for replica in range(layout.num_replicas):
        tps = sorted({layout.places[r].tp_rank for r in layout.replica_ranks[replica]})
        for t in tps:
            ranks = layout.stage_ranks(replica, t)
            kinds = {rank_kinds[r] for r in ranks}
            backend = native_backend(rank_devices[ranks[0]]) if len(kinds) == 1 else "gloo"
            pg = dist.new_group(list(ranks), backend=backend)
            if me in ranks:
                mine[replica] = pg
    return mine


@dataclass(frozen=True)
class UnsplitSignature:
    """The whole model's state-dict entries (name, shape, dtype) and parameter count, for a rank holding part."""

    entries: tuple[tuple[str, tuple[int, ...], str], ...]
    """Sorted ``(name, shape, dtype)`` of the unsplit model's state dict."""
    num_params: int
    """Parameters of the unsplit model."""

    @classmethod
    def of(cls, model: nn.Module) -> UnsplitSignature:
        """The signature of a whole model."""
        entries = tuple(
            (k, tuple(t.shape), str(t.dtype)) for k, t in sorted(model.state_dict().items())
            if isinstance(t, torch.Tensor)
        )
        return cls(entries, sum(p.numel() for p in model.parameters()))


class UnsplitView(nn.Module):
    """This rank's parameters under their names in the unsplit model: ``state_dict`` keys are the user's (the
    subset this rank holds), so optimizer state and checkpoints are keyed the same whatever the layout.
    ``unsplit_signature`` describes the whole model (a checkpoint's fingerprint is the whole model's)."""

    def __init__(self, named: Sequence[tuple[str, nn.Parameter]], signature: UnsplitSignature) -> None:
        super().__init__()
        self.unsplit_signature = signature
        for name, p in named:
            *path, leaf = name.split(".")
            mod: nn.Module = self
            for part in path:
                child = mod._modules.get(part)
                if child is None:
                    child = nn.Module()
                    mod.add_module(part, child)
                mod = child
            mod.register_parameter(leaf, p)


@dataclass
class PipelineRunner:
    """One rank's chunks, stages and schedule (built by :meth:`build`)."""

    chunks: list[Chunk]
    """This rank's chunks, in pipeline order."""
    group: Any
    """Point-to-point group of this rank's pipeline (stage order = group rank order)."""
    num_stages: int
    """Physical stages of this rank's pipeline."""
    schedule_name: str
    """``gpipe``, ``1f1b`` or ``interleaved``."""
    comm_device: torch.device
    """Where activations cross between stages (host memory for a pipeline over several device kinds)."""
    loss_scale: float
    """Each micro-batch's weight in the global batch: ``micro_batch / global_batch``."""
    loss_fn: Callable[..., torch.Tensor] | None = None
    """The user's ``loss_fn(logits, labels)`` (mean over the micro-batch; ``labels``: its token ids), computed by the
    last stage per micro-batch instead of next-token cross-entropy (see :func:`check_pipeline_loss_fn`)."""
    on_compute: Callable[[float], None] = lambda dt: None
    """Called after each forward and backward of a micro-batch with its time (the straggler facility hooks here)."""
    times: PipelineTimes = field(default_factory=PipelineTimes)
    """Measurements of the last step."""
    _schedule: Any = None
    _n_micro: int = 0
    _num_targets: int | None = None
    _eval_schedules: dict[int, Any] = field(default_factory=dict)

    @classmethod
    def build(
        cls, model: nn.Module, layout: PipelineLayout, rank: int, device: torch.device, schedule: str,
        loss_scale: float, groups: dict[int, Any], weights: Path | None = None,
        loss_fn: Callable[..., torch.Tensor] | None = None,
    ) -> PipelineRunner:
        """The rank's chunks of ``model`` (the unsplit model, left untouched) and its replica's P2P group.

        ``weights``: ``model`` is a skeleton; each chunk reads its own tensors from this folder (see ``cut``)."""
        place = layout.places[rank]
        ranks = layout.stage_ranks(place.replica, place.tp_rank)
        kinds = {layout.places[r].accelerator for r in ranks}
        comm = device if len(kinds) == 1 else torch.device("cpu")
        chunks = [
            cut(model, c.first_layer, c.num_layers, c.is_first, c.is_last, device, comm, weights)
            for c in layout.chunks_of(rank)
        ]
        return cls(chunks, groups[place.replica], layout.num_stages(place.group), schedule, comm, loss_scale,
                   loss_fn)

    @property
    def has_first(self) -> bool:
        """This rank holds the input embedding (feeds the pipeline)."""
        return dist.get_rank(self.group) == 0

    @property
    def has_last(self) -> bool:
        """This rank holds the head (computes the loss): the last stage, also with interleaved chunks."""
        return dist.get_rank(self.group) == self.num_stages - 1

    def parameters(self) -> list[tuple[str, nn.Parameter]]:
        """``(unsplit-model name, parameter)`` of every parameter this rank holds (each once)."""
        seen: set[int] = set()
        out = []
        for ch in self.chunks:
            for name, p in ch.named_parameters_unsplit():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((name, p))
        return out

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self._num_targets is not None:  # masked labels: this micro-batch's part of the global batch's mean
            return masked_cross_entropy(logits, target, self._num_targets)
        if self.loss_fn is not None:  # the user's mean over the micro-batch, weighted like the built-in one
            return self.loss_fn(logits, target) * self.loss_scale
        return shifted_cross_entropy(logits, target) * self.loss_scale

    def _make_schedule(self, n_micro: int, evaluation: bool = False) -> Any:
        """The step's schedule over new stages of this rank's chunks; ``evaluation``: for forward-only steps
        (untimed stages, the loss summed over the labelled tokens: see :meth:`evaluate`)."""
        why = micro_batch_count_error(self.schedule_name, self.num_stages, n_micro)
        if why is not None:
            raise ConfigError(f"train.schedule: {why}. To fix: raise the global batch or lower the micro-batch size.")
        # torch.distributed.pipelining (with torch._dynamo) costs a second of start-up: only pipelines pay it
        from torch.distributed.pipelining import PipelineStage

        from starverse.runtime.parallel.pipeline_stage import SCHEDULES, TimedStage

        group_rank = dist.get_rank(self.group)
        num = self.num_stages * len(self.chunks)
        stages = [
            PipelineStage(ch, group_rank + i * self.num_stages, num, self.comm_device, group=self.group)
            if evaluation else
            TimedStage(ch, group_rank + i * self.num_stages, num, self.comm_device,
                        group=self.group, times=lambda: self.times, on_compute=lambda dt: self.on_compute(dt))
            for i, ch in enumerate(self.chunks)
        ]
        cls = SCHEDULES[self.schedule_name]
        loss = _summed_loss if evaluation else self._loss
        if self.schedule_name == "interleaved":
            return cls(stages, n_microbatches=n_micro, loss_fn=loss, scale_grads=False)
        return cls(stages[0], n_microbatches=n_micro, loss_fn=loss, scale_grads=False)

    def evaluate(self, tokens: torch.Tensor, labels: torch.Tensor, n_micro: int) -> float:
        """Forward only (``schedule.eval``, no gradients, modules in eval mode) of ``tokens`` [n_micro ×
        micro_batch, seq] as ``n_micro`` micro-batches; returns the summed next-token loss over the labelled
        tokens of ``labels`` (-100: none) on the last stage, 0.0 elsewhere.

        The forward-only schedule has its own stages over the same chunks (built once per micro-batch count),
        so the training schedule's state and timings are untouched."""
        schedule = self._eval_schedules.get(n_micro)
        if schedule is None:
            schedule = self._eval_schedules[n_micro] = self._make_schedule(n_micro, evaluation=True)
        last = self.has_last
        losses: list[torch.Tensor] = []
        x = tokens.to(self.comm_device)
        modes = [ch.training for ch in self.chunks]
        for ch in self.chunks:
            ch.train(False)
        try:
            with torch.no_grad():
                schedule.eval(*((x,) if self.has_first else ()), target=labels.to(self.comm_device) if last else None,
                              losses=losses if last else None)
        finally:
            for ch, mode in zip(self.chunks, modes, strict=True):
                ch.train(mode)
        return float(sum(loss.double().cpu() for loss in losses)) if last else 0.0

    def step(
        self, tokens: torch.Tensor, n_micro: int, labels: torch.Tensor | None = None, num_targets: int | None = None
    ) -> float:
        """Forward and backward of the replica's batch ``tokens`` [n_micro × micro_batch, seq] as ``n_micro``
        micro-batches; gradients accumulate in the chunks' ``.grad``. Returns this rank's part of the global
        batch's mean loss (the last stage's weighted losses; 0 elsewhere).

        ``labels`` (chat data: -100 where a token is not a target) go to the last stage, which sums the loss over
        the labelled tokens and divides by ``num_targets``, the global batch's labelled tokens."""
        if self._schedule is None or n_micro != self._n_micro:
            self._schedule, self._n_micro = self._make_schedule(n_micro), n_micro
        self.times = PipelineTimes()
        x = tokens.to(self.comm_device)
        first, last = self.has_first, self.has_last
        self._num_targets = (num_targets or 1) if labels is not None else None
        target = x if labels is None else labels.to(self.comm_device)
        losses: list[torch.Tensor] = []
        t0 = time.perf_counter()
        args = (x,) if first else ()
        self._schedule.step(*args, target=target if last else None, losses=losses if last else None,
                            return_outputs=False)
        self.times.step_s = time.perf_counter() - t0
        return float(sum(loss.detach().double().cpu() for loss in losses)) if last else 0.0
