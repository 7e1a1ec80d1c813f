"""The plan's in-stage parallelism applied to each pipeline chunk: tensor parallel, recompute, ZeRO (FSDP2).

As torchtitan composes PP with TP and FSDP, each chunk is parallelised on its own, in the same order as an
unpipelined model (:func:`starverse.runtime.parallel.parallelize.parallelize`): tensor parallel over the
stage's TP ranks, then recompute wrapping of its blocks, then ``fully_shard`` over the group's replicas that
hold the same stage.

- **TP x PP.** Each stage of a replica is a TP group of ``tp`` consecutive ranks of one device kind (the plan's
  stage ``tp``; the same ``tp`` in every stage). Its 1-D ``DeviceMesh`` (dimension ``tp``) is built from a process
  group over those ranks. Pipelines run per TP index (``pipeline_groups``): TP rank ``t`` of stage ``s`` sends
  its activation to TP rank ``t`` of stage ``s + 1``. Without sequence parallel the activations between blocks
  are replicated over the TP group, so every TP rank sends the same (whole) tensor to its peer; with it (as
  torchtitan) each sends its sequence shard and the peer resumes from that shard. The last stage's head gathers
  the logits: each TP rank of the last stage computes the same loss (counted once).
- **ZeRO x PP.** The ranks holding the same stage and TP index form the ``dp`` dimension: over the replicas of
  every group when the groups' pipelines split the layers the same way (:func:`spans_groups`: then they hold the
  same parameters stage by stage, as FSDP2/HSDP wants one mesh over every holder of a shard set; several device
  kinds share it when they are of one device type: gloo for CPU ranks, NCCL for CUDA kinds), else one per group
  (ZeRO-1 shards each stage's optimizer state inside its group, and the whole gradients are summed over every
  rank holding a parameter, in all groups, as without ZeRO). ``fully_shard`` shards each block and the chunk
  (the root: embedding, final norm, head) over it.
  ``torch.distributed.pipelining`` runs an FSDP chunk's backwards without gradient sync and reduce-scatters once
  after the last micro-batch (``perform_reduce_grad``), so ZeRO-1 and ZeRO-2 move one all-gather and one
  reduce-scatter per step and keep uneven shares; ZeRO-3 gathers each block per micro-batch forward, so the
  replicas must run the same micro-batches (equal shares, no rebalancing). With TP the two form a 2-D mesh
  ``(dp, tp)`` per stage.
- **Recompute** wraps each chunk's blocks (a user's block list is one block each).
- **LoRA x TP.** A chunk's linears carrying peft adapters are split with them (``tensor._split_linear``: as
  without pipelines), so only the adapters train and their gradients are summed like any parameter's.

Refused with one line each (:func:`check_pipeline_parallel`): different ``tp`` per stage, sequence parallel with
a ``seq_len`` the TP ranks do not divide, ZeRO-2/3 or offload over several groups whose pipelines split the
layers differently (or whose stages' replicas are of several device types): FSDP2's sharded gradient cannot be
summed with a differently cut one (the planner never proposes it: ``planner.policy.runtime_layout_rule``), ZeRO-3 with
uneven or rebalanced shares.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from starverse.errors import ConfigError
from starverse.plan import Plan
from starverse.runtime.launch import native_backend
from starverse.runtime.parallel.fsdp import ZeroModel, apply_zero
from starverse.runtime.parallel.parallelize import ParallelConfig
from starverse.runtime.parallel.pipeline_layout import PipelineLayout
from starverse.runtime.parallel.pipeline_split import Chunk
from starverse.runtime.parallel.recompute import apply_recompute
from starverse.runtime.parallel.tensor import apply_tensor_parallel, check_tensor_parallel, tp_layout


def pipeline_parallel_config(plan: Plan) -> ParallelConfig:
    """The in-stage settings of a pipelined plan (``tp`` of its stages: one value, see :func:`check_pipeline_parallel`)."""
    t = plan.train
    tp = max(s.tp for g in plan.groups for s in g.stages)
    return ParallelConfig(tp=tp, zero_stage=t.zero_stage, offload=t.offload, recompute=t.recompute,
                          recompute_early_stop=t.recompute_early_stop, sequence_parallel=t.sequence_parallel)


def _fsdp(cfg: ParallelConfig) -> bool:
    """The setting shards parameters with FSDP2 (ZeRO-2/3, or ZeRO-1 with offload)."""
    return cfg.zero_stage > 1 or (cfg.zero_stage == 1 and cfg.offload != "none")


def spans_groups(layout: PipelineLayout, rank_devices: Sequence[str] | None) -> bool:
    """One ZeRO mesh per stage spans the replicas of every group: the groups split the layers the same way and
    each stage's replicas are of one device type (``rank_devices`` None: assumed)."""
    if len(layout.stage_layers) < 2 or not layout.splits_match:
        return False
    if rank_devices is None:
        return True
    types: dict[int, set[str]] = {}
    for place in layout.places:
        types.setdefault(place.stage, set()).add(rank_devices[place.rank].split(":", 1)[0])
    return all(len(t) == 1 for t in types.values())


def check_pipeline_parallel(
    plan: Plan, rebalance_every: int, shares: Sequence[int], model: torch.nn.Module | None = None,
    source: str = "the cluster's plan", seq_len: int | None = None, rank_devices: Sequence[str] | None = None,
) -> None:
    """Raise :class:`ConfigError` unless this runtime runs the in-stage parallelism of ``plan``'s pipelines with
    these shares (``model``, when given, is checked for tensor parallelism; ``seq_len``: the one trained, None:
    the plan's; ``rank_devices``: the ranks' torch devices in the plan's order, None: not checked)."""
    cfg = check_pipeline_plan(plan, source, seq_len)
    layout = PipelineLayout.from_plan(plan)
    if len(plan.groups) > 1 and _fsdp(cfg) and not spans_groups(layout, rank_devices):
        raise ConfigError(
            f"{source}: train.zero_stage: {cfg.zero_stage} (offload: {cfg.offload}) over {len(plan.groups)} "
            "groups shards each stage over the replicas of every group, but a stage's replicas are of several "
            "device types (one FSDP2 mesh has one). To fix: zero_stage: 1 without offload, or one device type "
            "per stage."
        )
    if model is not None and cfg.tp > 1:
        tp_layout(model)
        check_tensor_parallel(getattr(model, "config", None), cfg.tp)
    if cfg.zero_stage == 3 and (rebalance_every != 0 or len(set(shares)) > 1):
        raise ConfigError(
            f"{source}: train.zero_stage: 3 gathers each block per micro-batch, so the replicas must run the same "
            f"micro-batches (shares {list(shares)}, rebalance_every {rebalance_every}). To fix: equal shares and "
            "Trainer(rebalance_every=0), or zero_stage: 1."
        )


def check_pipeline_plan(plan: Plan, source: str = "plan", seq_len: int | None = None) -> ParallelConfig:
    """The in-stage settings of a pipelined ``plan``; :class:`ConfigError` for a shape this runtime does not run."""
    tps = sorted({s.tp for g in plan.groups for s in g.stages})
    t = plan.train
    if len(tps) > 1:
        raise ConfigError(
            f"{source}: stages have tp {tps}: tensor parallelism inside pipeline stages needs the same tp in every "
            f"stage (a parameter's shards are summed with the same shards of other replicas). To fix: set every "
            f"stage's tp to one value (e.g. {tps[0]})."
        )
    cfg = pipeline_parallel_config(plan)
    if cfg.tp > 1:
        seq = seq_len or t.seq_len
        if cfg.sequence_parallel and seq % cfg.tp:
            raise ConfigError(
                f"{source}: train.sequence_parallel with pipeline stages splits the {seq}-token sequences "
                f"between the stages' {cfg.tp} TP ranks. To fix: a seq_len that is a multiple of {cfg.tp}."
            )
    if len(plan.groups) > 1 and _fsdp(cfg) and not PipelineLayout.from_plan(plan).splits_match:
        raise ConfigError(
            f"{source}: train.zero_stage: {cfg.zero_stage} (offload: {cfg.offload}) with pipeline stages over "
            f"{len(plan.groups)} groups whose pipelines split the layers differently is not run: FSDP2 "
            "reduce-scatters each group's gradients into shards cut by that group's split, which cannot be summed "
            "with another group's differently cut shards. To fix: give every group the same stages' layers, "
            "zero_stage: 1 without offload (optimizer state sharded inside each group), or one group (replicas: N)."
        )
    return cfg


@dataclass(frozen=True)
class StageMeshes:
    """This rank's device meshes for its stage (None where the plan does not use the dimension)."""

    tp: DeviceMesh | None
    """The stage's TP ranks (dimension ``tp``)."""
    dp: DeviceMesh | None
    """The group's replicas of this stage and TP index (dimension ``dp``; of the same 2-D mesh as ``tp``)."""


def stage_meshes(
    layout: PipelineLayout, rank_devices: Sequence[str], config: ParallelConfig, device_type: str
) -> StageMeshes:
    """Build every stage's TP and ZeRO process groups (collective: every rank, same order) and return this rank's
    meshes."""
    me = dist.get_rank()
    place = layout.places[me]
    tp_ranks: list[int] | None = None
    tp_pg = dp_pg = None
    if config.tp > 1:
        for replica, ranks in enumerate(layout.replica_ranks):
            for stage in range(layout.num_stages(layout.replica_group[replica])):
                members = [r for r in ranks if layout.places[r].stage == stage]
                pg = dist.new_group(members, backend=native_backend(rank_devices[members[0]]))
                if me in members:
                    tp_pg, tp_ranks = pg, members
    grid: list[list[int]] = []
    if config.zero_stage > 0:
        span = spans_groups(layout, rank_devices)
        sets = [list(range(layout.num_replicas))] if span else [
            [i for i, rg in enumerate(layout.replica_group) if rg == g] for g in range(len(layout.stage_layers))]
        for replicas in sets:
            for stage in range(layout.num_stages(layout.replica_group[replicas[0]])):
                rows = [[r for r in layout.replica_ranks[i] if layout.places[r].stage == stage] for i in replicas]
                for t in range(config.tp):
                    members = [row[t] for row in rows]
                    pg = dist.new_group(members, backend=native_backend(rank_devices[members[0]]))
                    if me in members:
                        dp_pg, grid = pg, rows
    if tp_pg is not None and dp_pg is not None:
        mesh = DeviceMesh.from_group([dp_pg, tp_pg], device_type, mesh=torch.tensor(grid),
                                     mesh_dim_names=("dp", "tp"))
        return StageMeshes(mesh["tp"], mesh["dp"])
    tp = DeviceMesh.from_group(tp_pg, device_type, mesh=torch.tensor(tp_ranks), mesh_dim_names=("tp",)) \
        if tp_pg is not None else None
    dp = DeviceMesh.from_group(dp_pg, device_type, mesh=torch.tensor([row[place.tp_rank] for row in grid]),
                               mesh_dim_names=("dp",)) if dp_pg is not None else None
    return StageMeshes(tp, dp)


def parallelize_chunks(chunks: Sequence[Chunk], config: ParallelConfig, meshes: StageMeshes) -> list[ZeroModel]:
    """Apply tensor parallel, recompute and ZeRO to each chunk in place (torchtitan's order); the FSDP states.

    Build the optimizer afterwards: TP and FSDP replace the chunks' parameters with DTensors (the chunk finds
    each one's unsplit name again by its name in the chunk).
    """
    zeros = []
    for chunk in chunks:
        if meshes.tp is not None:
            apply_tensor_parallel(chunk.body, meshes.tp, sequence_parallel=config.sequence_parallel)
            if config.sequence_parallel:
                chunk.sequence_mesh = meshes.tp
        apply_recompute(chunk.body, config.recompute, early_stop=config.recompute_early_stop)
        if meshes.dp is not None:
            zeros.append(apply_zero(chunk, meshes.dp, config.zero_stage, config.offload))
    return zeros
