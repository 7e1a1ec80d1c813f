"""ZeRO stages and offload with FSDP2 ``fully_shard``, over the data-parallel ranks of one group.

The mapping (docs/runtime.md, "ZeRO with FSDP2"):

===========  ===========================================================================================
plan         FSDP2
===========  ===========================================================================================
zero 0       no FSDP: replicated parameters, gradients summed by hetero DP's bucketed all-reduce
zero 1       no FSDP: parameters and gradients stay whole on every rank (summed over the replicas by hetero
             DP's all-reduce, or :meth:`ParallelModel.sync_gradients` under TP), the optimizer state is
             sharded with :class:`~starverse.runtime.parallel.zero1.ShardedOptimizer`
             (``ZeroRedundancyOptimizer``: each rank steps its partition of the parameters, then broadcasts
             them). ZeRO-1's memory (P + G + O/N) and traffic (one all-reduce + one broadcast of the
             parameters per step), and shares stay free: uneven and rebalanced. With ``offload`` it falls
             back to FSDP2 (only FSDP2 has an offload policy): ``fully_shard(reshard_after_forward=False)``
             with the gradient sync and the resharding held to the last micro-batch, so during the step a
             rank holds whole parameters and gradients, between steps the parameters sharded (the
             parameters are then counted once whole and once as a shard: 1.5 P for two ranks).
zero 2       ``fully_shard(reshard_after_forward=False)``: parameters gathered once per micro-batch and
             kept through its backward; gradients reduce-scattered after every micro-batch (1/N kept). Every
             rank runs as many micro-batches (of uneven sizes when shares differ:
             ``parallelize.lockstep_micro_batches``), so the collectives pair up over the mesh, which may span
             data-parallel groups of several device kinds of one device type.
zero 3       ``fully_shard(reshard_after_forward=True)``: each block's parameters are gathered for its
             forward, freed, gathered again for its backward (FSDP2 prefetches the next block).
===========  ===========================================================================================

Each decoder block is its own FSDP unit (one all-gather / reduce-scatter per block); the root unit holds the
rest (embeddings, final norm, head). Gradients are *summed* over the shard group (divide factor 1), as
hetero DP sums them: the loss of each micro-batch is already scaled by its share of the global batch.

Offload: FSDP2's only offload policy, ``CPUOffloadPolicy``, keeps the sharded parameters, their gradients
and the optimizer state in host memory and runs the optimizer step on the host. ``offload: optimizer+params``
is exactly that. ``offload: optimizer`` (optimizer state alone on the host, parameters on the device, as
DeepSpeed's ZeRO-Offload) has no FSDP2 equivalent: it runs with the same policy, so it saves *more*
device memory than planned (the sharded parameters too) and pays the host-to-device copy of the
parameters every forward, which the cost model charges only to ``optimizer+params``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from starverse.errors import ConfigError
from starverse.runtime.parallel.blocks import decoder_blocks

if TYPE_CHECKING:  # FSDP2 and ZeroRedundancyOptimizer import DTensor (~1 s): imported where a ZeRO stage is applied
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy

log = logging.getLogger(__name__)

OFFLOAD_MODES = ("none", "optimizer", "optimizer+params")


@dataclass
class ZeroModel:
    """A model sharded for a ZeRO stage; drives FSDP2 through a step's micro-batches."""

    model: torch.nn.Module
    """The sharded model (its parameters are DTensors on the data-parallel mesh)."""
    stage: int
    """The ZeRO stage (1-3)."""
    offload: str
    """The plan's offload setting."""
    units: list[FSDPModule] = field(default_factory=list)
    """FSDP units, blocks first, the root last (none: ZeRO-1 shards the optimizer state alone)."""
    dp_mesh: DeviceMesh | None = None
    """The data-parallel mesh it shards over."""

    @property
    def fsdp(self) -> bool:
        """FSDP2 shards the parameters and reduces the gradients (False: ZeRO-1 proper, see :meth:`shard_optimizer`)."""
        return bool(self.units)

    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer to step: ``optimizer`` itself under FSDP2 (its state follows the sharded parameters),
        else the same optimizer with its state sharded over the data-parallel ranks (ZeRO-1 proper)."""
        if self.fsdp or self.dp_mesh is None or self.dp_mesh.size() == 1:
            return optimizer
        from starverse.runtime.parallel.zero1 import ShardedOptimizer

        return ShardedOptimizer(optimizer, self.dp_mesh.get_group())

    @property
    def root(self) -> FSDPModule:
        """The root FSDP unit (the whole model)."""
        return self.units[-1]

    def before_micro_batch(self, index: int, count: int) -> None:
        """Call before the forward of micro-batch ``index`` of ``count`` in a step.

        ZeRO-1 accumulates whole gradients and keeps parameters gathered until the last micro-batch; ZeRO-2
        and ZeRO-3 reduce-scatter after every micro-batch (FSDP2's default).
        """
        if not self.fsdp:
            return
        last = index == count - 1
        if self.stage == 1:
            self.root.set_requires_gradient_sync(last, recurse=True)
            for unit in self.units:
                unit.set_reshard_after_backward(last, recurse=False)
        self.root.set_is_last_backward(last)


def offload_policy(offload: str, device: torch.device) -> OffloadPolicy:
    """FSDP2's policy for the plan's ``offload`` (see the module docstring for ``optimizer``)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
    if offload not in OFFLOAD_MODES:
        raise ConfigError(f"offload must be one of {', '.join(OFFLOAD_MODES)} (got {offload!r}).")
    if offload == "none":
        return OffloadPolicy()
    # Pinned host memory speeds the copies to an accelerator; a CPU rank has nothing to pin for.
    return CPUOffloadPolicy(pin_memory=device.type != "cpu")


def apply_zero(
    model: torch.nn.Module,
    dp_mesh: DeviceMesh,
    stage: int,
    offload: str = "none",
    mp_policy: MixedPrecisionPolicy | None = None,
) -> ZeroModel:
    """Shard ``model`` over ``dp_mesh`` for ZeRO ``stage`` (1-3) in place (see the module docstring).

    Apply after tensor parallelism (then ``dp_mesh`` is the data-parallel dimension of the same 2-D mesh,
    and parameters become 2-D DTensors) and after recompute wrapping. Build the optimizer afterwards, on
    the (sharded) parameters, and step the one :meth:`ZeroModel.shard_optimizer` returns. ZeRO-1 without
    offload leaves the model as it is: the caller sums its gradients over ``dp_mesh`` as for ZeRO-0.
    """
    if stage not in (1, 2, 3):
        raise ConfigError(f"zero_stage must be 1, 2 or 3 for FSDP (got {stage}); ZeRO-0 needs no sharding.")
    if stage == 1 and offload == "none":
        log.info("ZeRO-1: optimizer state sharded over %d ranks", dp_mesh.size())
        return ZeroModel(model=model, stage=stage, offload=offload, dp_mesh=dp_mesh)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = torch.device(dp_mesh.device_type)
    kwargs = {
        "mesh": dp_mesh,
        "reshard_after_forward": stage == 3,
        "offload_policy": offload_policy(offload, device),
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
    }
    units: list[FSDPModule] = []
    _, blocks = decoder_blocks(model)
    for block in blocks:
        units.append(fully_shard(block, **kwargs))  # type: ignore[call-overload]
    units.append(fully_shard(model, **kwargs))  # type: ignore[call-overload]
    for unit in units:
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM
    log.info("ZeRO-%d with FSDP2 over %d ranks (%d units), offload %s", stage, dp_mesh.size(), len(units), offload)
    return ZeroModel(model=model, stage=stage, offload=offload, units=units, dp_mesh=dp_mesh)
