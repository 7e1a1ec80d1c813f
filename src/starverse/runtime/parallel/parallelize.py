"""Compose the in-stage parallelisms on one rank, in torchtitan's order: tensor parallel, recompute, ZeRO.

``parallelize(model, config, mesh)`` is the one call the trainer makes. ``mesh`` is the 2-D device mesh
``(dp, tp)`` of one group's ranks (rank ``r`` is data-parallel replica ``r // tp``, tensor-parallel rank
``r % tp``: a TP group is ``tp`` consecutive ranks, which the launcher places on one node). TP splits the
blocks over ``mesh["tp"]``; FSDP2 then shards the (TP-split) parameters over ``mesh["dp"]``, so with both
every parameter is a 2-D DTensor ``(Shard(0) over dp, Shard(k) over tp)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from starverse.errors import ConfigError
from starverse.plan import Plan
from starverse.runtime.parallel.dtensor import is_dtensor
from starverse.runtime.parallel.fsdp import ZeroModel, apply_zero
from starverse.runtime.parallel.recompute import apply_recompute
from starverse.runtime.parallel.tensor import apply_tensor_parallel, check_tensor_parallel, tp_layout

if TYPE_CHECKING:  # FSDP2 imports DTensor (~1 s): a plain data-parallel rank needs neither
    from torch.distributed.fsdp import MixedPrecisionPolicy


@dataclass(frozen=True)
class ParallelConfig:
    """The in-stage parallelism of one group, as the plan says."""

    tp: int = 1
    """Tensor-parallel degree (ranks per TP group)."""
    zero_stage: int = 0
    """ZeRO stage over the group's data-parallel replicas (0: replicated, hetero DP sums gradients)."""
    offload: str = "none"
    """``none``, ``optimizer`` or ``optimizer+params`` (FSDP2's CPU offload; needs ``zero_stage >= 1``)."""
    recompute: str = "none"
    """``none``, ``selective``, ``matmuls`` or ``full`` activation recomputation."""
    recompute_early_stop: bool = True
    """``full`` stops recomputing once the backward's saved tensors are back (``TrainSpec.recompute_early_stop``)."""
    sequence_parallel: bool = False
    """Split norms and residuals along the sequence inside TP groups."""

    @classmethod
    def from_plan(cls, plan: Plan, group: int = 0) -> ParallelConfig:
        """The settings of ``plan``'s group ``group`` (its first stage's ``tp``: one stage per group here)."""
        t = plan.train
        return cls(tp=plan.groups[group].stages[0].tp, zero_stage=t.zero_stage, offload=t.offload,
                   recompute=t.recompute, recompute_early_stop=t.recompute_early_stop,
                   sequence_parallel=t.sequence_parallel)

    @property
    def is_plain(self) -> bool:
        """Nothing to apply: plain replicated data parallelism."""
        return self.tp == 1 and self.zero_stage == 0 and self.recompute == "none" and self.offload == "none"

    def __post_init__(self) -> None:
        if self.offload != "none" and self.zero_stage == 0:
            raise ConfigError(
                f"offload: {self.offload} needs zero_stage >= 1 (FSDP2 offloads sharded state). To fix: set "
                "zero_stage: 1 (or higher) or offload: none."
            )
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("sequence_parallel needs tp > 1. To fix: set sequence_parallel: false or tp >= 2.")


def group_mesh(device_type: str, world: int, tp: int) -> DeviceMesh:
    """The ``(dp, tp)`` mesh over ``world`` ranks of the default process group (``tp`` must divide it)."""
    if world % tp:
        raise ConfigError(f"tp {tp} does not divide the group's {world} ranks. To fix: choose a tp that divides it.")
    return init_device_mesh(device_type, (world // tp, tp), mesh_dim_names=("dp", "tp"))


@dataclass
class ParallelModel:
    """A model made ready for its rank, with the hook the step loop calls per micro-batch."""

    model: torch.nn.Module
    """The parallelised model (same forward, same loss)."""
    config: ParallelConfig
    """What was applied."""
    zero: ZeroModel | None
    """The FSDP2 state (None for ZeRO-0)."""
    mesh: DeviceMesh | None = None
    """The ``(dp, tp)`` mesh it runs on."""

    def sync_gradients(self) -> None:
        """Sum the gradients over the data-parallel replicas when FSDP does not (tensor parallel, ZeRO-0).

        Each rank's local part (its TP shard, or a replicated norm) is summed with the same part of the other
        replicas in one flat all-reduce over ``mesh["dp"]``; under FSDP2 (ZeRO-2/3, ZeRO-1 with offload) it
        reduced them in the backward.
        """
        if (self.zero is not None and self.zero.fsdp) or self.mesh is None or self.mesh["dp"].size() == 1:
            return
        grads = [p.grad.to_local() if is_dtensor(p.grad) else p.grad
                 for p in self.model.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        torch.distributed.all_reduce(flat, group=self.mesh["dp"].get_group())
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def before_micro_batch(self, index: int, count: int) -> None:
        """Call before the forward of micro-batch ``index`` of ``count`` of a step."""
        if self.zero is not None:
            self.zero.before_micro_batch(index, count)

    @property
    def lockstep(self) -> bool:
        """FSDP2 gathers or reduces per micro-batch (ZeRO-2/3): every rank must run as many micro-batches
        (:func:`lockstep_micro_batches`)."""
        return self.zero is not None and self.zero.fsdp and self.zero.stage >= 2

    @property
    def syncs_own_gradients(self) -> bool:
        """It reduces its gradients itself (FSDP2 in the backward, :meth:`sync_gradients` for tensor parallel):
        the trainer's all-reduce over every rank must not run (it would sum different TP shards). ZeRO-1
        without TP leaves them to the trainer's all-reduce, which keeps uneven shares."""
        return (self.zero is not None and self.zero.fsdp) or self.config.tp > 1

    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer to step (build ``optimizer`` on :attr:`model`'s parameters first): under ZeRO-1 its
        state sharded over the data-parallel ranks, else ``optimizer`` itself."""
        return optimizer if self.zero is None else self.zero.shard_optimizer(optimizer)

    # Where the rank loop holds a gradient sync (hetero DP's ``GradientSync``), a parallel model stands in.
    blocked_s: float = 0.0
    """Time blocked in a separate gradient reduction (FSDP2's is inside the backward, counted as compute)."""

    def arm(self) -> None:
        """Nothing to arm: FSDP2 reduce-scatters during the backward (see :meth:`before_micro_batch`)."""

    def finish(self) -> None:
        """After the last backward: sum the gradients over the replicas where FSDP2 did not (see
        :meth:`sync_gradients`)."""
        self.sync_gradients()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients to ``max_norm`` (0: only measure); returns the global norm (see :func:`clip_grad_norm`)."""
        return clip_grad_norm(self.model.parameters(), max_norm)


def check_tensor_parallel_plan(plan: Plan, rank_kinds: list[str], source: str = "plan") -> None:
    """Raise :class:`ConfigError` unless ``plan``'s tensor parallelism is of a shape the runtime runs: one
    group of one device kind, no pipeline stages, full training or LoRA, not QLoRA (see
    :func:`check_parallel_plan`)."""
    for gi, g in enumerate(plan.groups):
        for si, s in enumerate(g.stages):
            if s.tp == 1:
                continue
            where = f"{source}: groups[{gi}].stages[{si}].tp: {s.tp}"
            if len(plan.groups) > 1 or g.num_stages > 1 or len(set(rank_kinds)) > 1:
                raise ConfigError(
                    f"{where}: without pipeline stages, tensor parallelism runs in a plan of one group of one device "
                    "kind (TP groups across groups of different kinds are not run). To fix: set tp: 1, use one group "
                    "with one stage, or pipeline stages with the same tp in every stage."
                )
            if plan.train.mode == "qlora":
                raise ConfigError(
                    f"{where}: tensor parallelism with train.mode: qlora is not run: bitsandbytes' 4-bit weights are "
                    "packed blocks DTensor cannot split by rows or columns. To fix: tp: 1 for QLoRA, or mode: lora "
                    "(its adapters are split with their linears)."
                )


def check_parallel_plan(
    plan: Plan, rank_kinds: list[str], rebalance_every: int, shares: list[int] | None = None,
    model: torch.nn.Module | None = None, rank_devices: list[str] | None = None,
) -> None:
    """Raise :class:`ConfigError` if the runtime cannot run ``plan``'s in-stage parallelism on these ranks.

    Tensor parallelism runs in plans of one group of one device kind without pipeline stages (the TP groups
    and the replicas form one ``(dp, tp)`` mesh), for a model whose family has a split table and whose heads,
    KV heads and MLP width ``tp`` divides (``model``, when given, is checked). ZeRO shards over one mesh of every
    rank: the groups of a plan without pipeline stages all hold the whole model, so several device kinds share
    it when their torch device type is one (``rank_devices``: CPU ranks over gloo, CUDA kinds over NCCL).
    ZeRO-2 and ZeRO-3 gather and reduce-scatter per micro-batch, a collective every rank must join: the ranks
    run equally many micro-batches of uneven sizes (:func:`lockstep_micro_batches`), so uneven and rebalanced
    shares run; ``rebalance_every`` and ``shares`` are accepted for the checks' common signature.
    """
    cfg = ParallelConfig.from_plan(plan)
    check_tensor_parallel_plan(plan, rank_kinds)
    if model is not None and cfg.tp > 1:
        tp_layout(model)
        check_tensor_parallel(getattr(model, "config", None), cfg.tp)
    types = sorted({d.split(":", 1)[0] for d in rank_devices or []})
    if cfg.zero_stage > 0 and len(types) > 1:
        raise ConfigError(
            f"plan: train.zero_stage: {cfg.zero_stage} shards over one mesh of one device type, but the ranks are "
            f"{', '.join(types)} devices ({sorted(set(rank_kinds))}). To fix: set zero_stage: 0 for this cluster, "
            "or use devices of one type."
        )
    if plan.train.mode == "qlora" and (cfg.zero_stage >= 2 or cfg.offload != "none"):
        raise ConfigError(
            f"plan: train.zero_stage: {cfg.zero_stage} (offload: {cfg.offload}) with train.mode: qlora is not run: "
            "FSDP2 would shard bitsandbytes' packed 4-bit weights, which Starverse does not support. To fix: "
            "zero_stage: 0 or 1 without offload for QLoRA (the 4-bit base is small; ZeRO-1 shards the adapters' "
            "optimizer state), or mode: lora."
        )


def lockstep_micro_batches(rows: np.ndarray, shares: Sequence[int]) -> list[np.ndarray]:
    """A replica's sequences ``rows`` (its share of the global batch) as ``min(shares)`` micro-batches of as even
    sizes as possible: every replica then runs equally many forwards and backwards, so FSDP2's per-micro-batch
    all-gathers and reduce-scatters (ZeRO-2/3) pair up over the mesh whatever the shares (a replica with a larger
    share runs larger micro-batches; each one's loss is scaled by its own size, so the step stays exact)."""
    return [part for part in np.array_split(rows, max(1, min(shares))) if len(part)]


def parallelize_for_plan(model: torch.nn.Module, plan: Plan, device: torch.device, world: int) -> ParallelModel | None:
    """:func:`parallelize` ``model`` as ``plan`` says over all ``world`` ranks; None when the plan is plain DP."""
    config = ParallelConfig.from_plan(plan)
    if config.is_plain:
        return None
    return parallelize(model, config, group_mesh(device.type, world, config.tp))


def parallelize(
    model: torch.nn.Module, config: ParallelConfig, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None = None
) -> ParallelModel:
    """Apply ``config`` to ``model`` in place over ``mesh`` (``(dp, tp)``, see :func:`group_mesh`).

    ``mp_policy``: FSDP2's mixed precision (e.g. bf16 parameters for compute, fp32 reduction) when ZeRO is on;
    None keeps the parameters' dtype (the trainer's autocast does the low-precision compute).
    """
    if config.tp > 1:
        apply_tensor_parallel(model, mesh["tp"], config.sequence_parallel)
    apply_recompute(model, config.recompute, early_stop=config.recompute_early_stop)
    zero = None
    if config.zero_stage > 0:
        zero = apply_zero(model, mesh["dp"], config.zero_stage, config.offload, mp_policy)
    return ParallelModel(model=model, config=config, zero=zero, mesh=mesh)


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm of ``params`` to ``max_norm`` (0: only measure it); returns the norm.

    ``torch.nn.utils.clip_grad_norm_`` refuses a mix of DTensor and plain gradients, which tensor parallel
    without sequence parallel leaves (split linears are DTensors, norms plain and replicated). Here a DTensor
    gradient's norm is reduced over its mesh (each shard counted once) and a plain one is local: replicated
    over the TP group, it is the same on every rank and is counted once.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    squares = []
    for g in grads:
        n = torch.linalg.vector_norm(g)
        squares.append((n.full_tensor() if is_dtensor(n) else n).float() ** 2)
    total = torch.stack(squares).sum().sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.device) if not is_dtensor(g) else coef.to(g.device).item())
    return total


def full_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with every DTensor gathered whole (a collective: every rank of its mesh must call it)."""
    return {k: v.full_tensor() if is_dtensor(v) else v for k, v in state.items()}
