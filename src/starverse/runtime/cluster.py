"""``accelerate()`` -> :class:`Cluster`: the devices to run on, the plan for them, and the model to build.

``accelerate`` takes the provider's devices (the local machine when ``pool`` is None) and asks the planner
(:func:`starverse.planner.plan_for_devices`) for the best plan on exactly those devices, restricted to what
this runtime executes (:func:`executable_caps`: data parallelism across device kinds with the batch split by
the planner's speed model, pipelines, TP inside a node, ZeRO 0-3, recompute, offload on accelerators; plain
data parallelism for ``recovery="in-place"``). The planner's plans are filtered by the runtime's own checks
(:func:`check_runnable`) and, among plans estimated within 5 % of the best, the simplest wins (ZeRO-0 over
ZeRO-1, TP 1 over TP 2, no recompute, no offload). Only when the planner fails (unknown device, nothing fits) does it fall back to one
data-parallel group per device kind, with the planner's one-line reason in ``cluster.notes``. An explicit
``plan=`` always wins. When the requested model cannot be trained on these devices (training state does not
fit, or CPU ranks that would take hours per step), ``cluster.model_config`` is an honest scaled-down copy of
the same architecture, the planner plans that copy, and ``cluster.notes`` says so.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from starverse.errors import ConfigError, StarverseError
from starverse.plan import Group, Plan, Stage, TrainSpec, load_plan
from starverse.runtime.launch import RankSpec
from starverse.runtime.mesh import MeshLayout
from starverse.runtime.model_choice import choose_model, model_name, save_config
from starverse.runtime.modeling import WEIGHTS_KEY
from starverse.runtime.parallel.pipeline_layout import PipelineLayout

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Cluster:
    """Devices, the plan they run, and the model to build for them."""

    plan: Plan
    """The plan every rank runs."""
    ranks: tuple[RankSpec, ...]
    """One entry per rank (device kind and torch device)."""
    model_config: dict[str, Any] | None = None
    """Hugging Face config of the model to build (possibly a scaled-down copy; see ``scaled``)."""
    model_id: str | None = None
    """The model the user asked for."""
    scaled: bool = False
    """True when ``model_config`` is a scaled-down copy of the requested model."""
    notes: tuple[str, ...] = ()
    """What ``accelerate`` decided and why (scaled model, plan source)."""
    policy: str = "cost-performance"
    """Objective used to choose the plan."""
    estimate: Any = None
    """The cost model's estimate of the plan (None if unavailable)."""
    weights: tuple[float, ...] = field(default=())
    """Relative speed of each rank for the initial shares (empty: from the plan / catalog)."""
    pretrained_model: Any = None
    """The ``transformers`` model given as ``model_id`` (trained with its weights; ``build_model`` returns it)."""
    catalog: Any = None
    """The accelerator figures the plan was made with, the re-plan's too (None: the bundled catalog with the
    probe's measured figures)."""

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return len(self.ranks)

    @property
    def layout(self) -> MeshLayout:
        """The mixed mesh's grouping of ranks by device kind."""
        return MeshLayout.from_ranks([r.device_kind for r in self.ranks], [r.device for r in self.ranks])

    @contextlib.contextmanager
    def mixed_mesh(self) -> Iterator[Any]:
        """Context in which the model is built for this cluster.

        In the user's process it yields the :class:`MeshLayout` (ranks grouped by device kind; the
        process groups themselves are created inside each rank when ``fit`` launches them, with NCCL /
        XLA / HCCL inside a kind and a gloo bridge between kinds). Inside a running rank (process group
        initialised) it builds and yields the :class:`~starverse.runtime.mesh.MixedMesh`. Models built in
        the context are created on the host in fp32 with a fixed seed, so every rank starts identical.
        """
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            from starverse.runtime.mesh import MixedMesh

            yield MixedMesh.build([r.device_kind for r in self.ranks], [r.device for r in self.ranks])
        else:
            log.info("mixed mesh: %s", self.layout.describe())
            yield self.layout

    def rank_weights(self) -> list[float]:
        """Relative speed of each rank: plan ``batch_share`` per replica, else catalog peak, else equal."""
        if self.weights:
            return list(self.weights)
        out: list[float] = []
        rank_group = _rank_groups(self.plan)
        shares = [g.batch_share for g in self.plan.groups]
        if all(s is not None for s in shares):
            return [shares[g] / self.plan.groups[g].replicas for g in rank_group]  # type: ignore[operator]
        for spec in self.ranks:
            out.append(_peak_or_none(spec.device_kind, self.plan.train.precision, spec.device) or 1.0)
        if any(w == 1.0 for w in out):
            return [1.0] * len(out)
        return out

    def summary_lines(self) -> list[str]:
        """What was decided, for the CLI and logs."""
        kinds = Counter(r.device_kind for r in self.ranks)
        lines = [
            f"devices: {', '.join(f'{n} x {k}' for k, n in kinds.items())} ({len(self.ranks)} ranks)",
            f"mesh: {self.layout.describe()}",
            f"plan: global batch {self.plan.train.global_batch}, seq_len {self.plan.train.seq_len}, "
            f"precision {self.plan.train.precision}, groups "
            + "; ".join(f"{g.replicas} x {g.stages[0].accelerator}" for g in self.plan.groups),
        ]
        lines.extend(self.notes)
        return lines


def _peak_or_none(kind: str, precision: str, device: str) -> float | None:
    from starverse.runtime.fit_result import peak_tflops

    return peak_tflops(kind, precision, device)


def _rank_groups(plan: Plan) -> list[int]:
    """Group index of each rank: groups in plan order, ``num_devices`` ranks each."""
    out: list[int] = []
    for i, g in enumerate(plan.groups):
        out.extend([i] * g.num_devices)
    return out


def check_plan_fits_ranks(plan: Plan, ranks: tuple[RankSpec, ...] | list[RankSpec], source: str = "plan") -> None:
    """Raise ConfigError unless these ranks can run ``plan``: its device kinds and counts, in any order (the
    ranks are then ordered like the plan by :func:`order_ranks_like_plan`), and tensor parallelism of a shape
    the runtime runs."""
    from starverse.runtime.parallel.parallelize import check_tensor_parallel_plan
    from starverse.runtime.parallel.pipeline_layout import PipelineLayout
    from starverse.runtime.parallel.pipeline_parallel import check_pipeline_plan
    from starverse.runtime.plan_check import check_ranks

    if PipelineLayout.from_plan(plan).is_pipelined:
        check_pipeline_plan(plan, source)
    else:
        check_tensor_parallel_plan(plan, [r.device_kind for r in ranks], source)
    check_ranks(plan, order_ranks_like_plan(plan, list(ranks)) if _kinds_match(plan, ranks) else ranks, source)


def _kinds_match(plan: Plan, ranks: tuple[RankSpec, ...] | list[RankSpec]) -> bool:
    want = Counter(p.accelerator for p in PipelineLayout.from_plan(plan).places)
    return want == Counter(r.device_kind for r in ranks)


def order_ranks_like_plan(plan: Plan, ranks: list[RankSpec]) -> tuple[RankSpec, ...]:
    """Renumber ranks so consecutive ranks follow the plan's places (group, replica, stage, TP rank)."""
    want = [p.accelerator for p in PipelineLayout.from_plan(plan).places]
    pool = list(ranks)
    out: list[RankSpec] = []
    for i, kind in enumerate(want):
        j = next(k for k, r in enumerate(pool) if r.device_kind == kind)
        r = pool.pop(j)
        out.append(RankSpec(i, r.device_kind, r.device, r.num_threads, r.env))
    return tuple(out)


def executable_caps(ranks: Sequence[RankSpec], recovery: str = "restart", pipelines: bool = True,
                    blocks: bool = True) -> Any:
    """What this runtime executes on ``ranks`` (a :class:`~starverse.planner.devices.RuntimeCaps`): everything
    (``EXECUTABLE``) but offload on CPU ranks (their memory is the host's: nothing to offload to) and ZeRO when
    the ranks are of several torch device types (one FSDP2 mesh has one; several kinds of one type share it:
    gloo for CPU ranks, NCCL for CUDA kinds); ZeRO-2/3 or offload over groups whose pipelines split the layers
    differently is kept out by the planner's rule (``planner.policy.runtime_layout_rule``) and
    :func:`check_runnable`. ``recovery="in-place"``: replicas of one rank, or of one pipeline when the ranks are
    of one kind, TP 1, ZeRO-0, no offload, or (``sharded_replicas``, CPU ranks) equal replica
    groups with ZeRO 1-3 inside each (``runtime.ft_shard``; ZeRO-2/3 on FSDP2, up to ``max_zero_stage``): what
    torchft's in-place recovery runs; recompute is searched; a given plan it cannot run — interleaved, groups cut
    differently, offload, recompute in a pipeline — falls back to restart with one line:
    ``recovery.inplace_refusal``).
    ``pipelines=False``: one stage per group (a model that cannot be cut); ``blocks=False``: a model without an
    ``nn.ModuleList`` of blocks, so no FSDP2 unit (ZeRO ≤ 1) and nothing to recompute."""
    import dataclasses

    from starverse.planner.devices import EXECUTABLE

    caps = EXECUTABLE
    if recovery == "in-place":
        # pipelines only over one device kind: the planner cuts groups of several kinds differently and interleaves
        # pipelines across kinds, which in-place recovery refuses (a joiner heals stage by stage from a peer)
        one_kind = len({r.device_kind for r in ranks}) == 1
        # sharded replicas on CPU ranks only: a replica's own world is gloo (runtime.ft_multi), which has no
        # reduce-scatter for FSDP2 on CUDA tensors; in place they ran on CPU ranks only
        caps = dataclasses.replace(caps, max_tp=1, zero_stage=0, offload="none",
                                   sharded_replicas=all(r.device == "cpu" for r in ranks),
                                   max_pipeline_stages=caps.max_pipeline_stages if one_kind else 1)
    if any(r.device == "cpu" for r in ranks):
        caps = dataclasses.replace(caps, offload="none")
    if len({r.device.split(":", 1)[0] for r in ranks}) > 1:
        caps = dataclasses.replace(caps, zero_stage=0, offload="none", sharded_replicas=False)
    if not pipelines:
        caps = dataclasses.replace(caps, max_pipeline_stages=1)
    if not blocks:
        caps = dataclasses.replace(caps, max_zero_stage=min(caps.max_zero_stage, 1), recompute="none")
    return caps


def has_blocks(model: Any) -> bool:
    """True when ``model`` has an ``nn.ModuleList`` of blocks (the unit of FSDP2 sharding and of recompute)."""
    from starverse.runtime.parallel.blocks import decoder_blocks

    try:
        decoder_blocks(model)
    except ConfigError:
        return False
    return True


def check_runnable(plan: Plan, ranks: Sequence[RankSpec], model_config: dict[str, Any] | None = None,
                   source: str = "the planner's plan", rebalance_every: int = 0, recovery: str = "restart") -> None:
    """Raise a StarverseError unless this runtime runs ``plan`` on ``ranks``: :func:`check_plan_fits_ranks`, the
    in-stage parallelism checks ``Trainer.fit`` applies (ZeRO over one device type, over groups split alike, LoRA x TP
    inside pipelines, ...; with equal shares, as accelerate's plans start, and the Trainer's ``rebalance_every``),
    the training mode on these devices (QLoRA needs CUDA), and TP against the model (a family with a split table,
    heads and MLP width divisible). ``recovery="in-place"``: also in-place recovery's own check
    (``recovery.inplace_refusal``: a plan it refuses would run with checkpoint-restart)."""
    from starverse.runtime.lora import check_mode
    from starverse.runtime.parallel.parallelize import check_parallel_plan
    from starverse.runtime.parallel.pipeline_parallel import check_pipeline_parallel

    check_plan_fits_ranks(plan, list(ranks), source)
    if recovery == "in-place":
        from starverse.runtime.recovery import inplace_refusal

        why = inplace_refusal(plan)
        if why is not None:
            raise ConfigError(f"{source}: in-place recovery does not run this plan ({why}). To fix: replicas "
                              "of one rank, one pipeline or one ZeRO group (docs/insurance.md).")
    ordered = order_ranks_like_plan(plan, list(ranks))
    if PipelineLayout.from_plan(plan).is_pipelined:
        check_pipeline_parallel(plan, rebalance_every, [1], None, source,
                                rank_devices=[r.device for r in ordered])
    else:
        check_parallel_plan(plan, [r.device_kind for r in ordered], rebalance_every,
                            rank_devices=[r.device for r in ordered])
    check_mode(plan.train.mode, [r.device for r in ordered], source)
    tp = max(s.tp for g in plan.groups for s in g.stages)
    if tp > 1 and model_config is not None:
        from starverse.runtime.modeling import _to_pretrained
        from starverse.runtime.parallel.tensor import TensorParallelError, check_tensor_parallel

        config = _to_pretrained({k: v for k, v in model_config.items() if k != WEIGHTS_KEY})
        if not getattr(config, "base_model_tp_plan", None):
            raise TensorParallelError(f"{source}: tp {tp}: the {config.model_type} family declares no column/row "
                                      "split (transformers' base_model_tp_plan). To fix: tp: 1.")
        check_tensor_parallel(config, tp)


def local_plan(
    ranks: list[RankSpec] | tuple[RankSpec, ...], model: str, num_layers: int, seq_len: int, global_batch: int,
    precision: str = "bf16",
) -> Plan:
    """The plan for local devices without the planner: one data-parallel group per device kind."""
    kinds = Counter(r.device_kind for r in ranks)
    groups = [Group(replicas=n, stages=[Stage(accelerator=k, layers=num_layers)]) for k, n in kinds.items()]
    return Plan(
        model=model, train=TrainSpec(seq_len=seq_len, global_batch=global_batch, precision=precision),  # type: ignore[arg-type]
        groups=groups,
    )


def accelerate(
    model_id: str | None = None,
    policy: str = "cost-performance",
    max_budget: float | None = None,
    *,
    plan: Plan | str | Path | None = None,
    pool: Any = None,
    num_cpu_ranks: int | None = None,
    use_gpus: bool | None = None,
    seq_len: int = 256,
    global_batch: int | None = None,
    max_params: int | None = None,
    mode: str = "full",
    lora_rank: int = 16,
    ranks: Sequence[RankSpec] | None = None,
    recovery: str = "restart",
    catalog: Any = None,
    rebalance_every: int | None = None,
) -> Cluster:
    """Choose devices, plan and model for a training job (see the module docstring).

    ``model_id``: registry id, HF id, config.json path, a Hugging Face model folder (its safetensors weights are
    loaded by ``build_model(cluster)``; a pretrained model is never scaled down) or a ``transformers`` model
    (None: a small Llama). ``mode``/``lora_rank``: the plan's training mode (``full``, ``lora``, ``qlora``). ``policy``/``max_budget``
    (per hour, in the plan's currency) go to the planner when it is available. ``plan``: an explicit
    Plan or plan file, checked against the devices. ``pool``: None = the local provider (the only one
    implemented). ``max_params``: cap on the model size built here (default: what fits; on CPU ranks
    also at most 20M parameters). ``ranks``: the devices to run on (a Ray cluster's); None: this machine's.
    ``recovery``: the ``Trainer``'s; ``"in-place"`` plans data parallelism over replicas of one rank or one
    pipeline (what in-place recovery runs).
    ``catalog``: the accelerator figures the planner uses (None: the bundled catalog with the probe's figures).
    ``rebalance_every``: the ``Trainer``'s, when known: a plan that needs 0 (ZeRO-2/3 run the ranks in lockstep)
    is then left out unless it is 0 (None: kept, with a note).
    """
    from starverse.runtime.devices import local_ranks

    if pool is not None:
        raise ConfigError(
            "only the local provider is implemented (pool=None); multi-node pools are planned with "
            "`starverse plan` but not yet launched. To fix: omit pool=."
        )
    ranks = list(ranks) if ranks is not None else local_ranks(num_cpu_ranks, use_gpus)
    notes: list[str] = []
    if plan is not None:
        source = str(plan) if not isinstance(plan, Plan) else "plan"
        the_plan = plan if isinstance(plan, Plan) else load_plan(plan)
        check_plan_fits_ranks(the_plan, ranks, source)
        ordered = order_ranks_like_plan(the_plan, ranks)
        model_ref: Any = model_id or the_plan.model
        notes.append(f"plan: given explicitly ({source})")
    else:
        the_plan = None
        ordered = tuple(ranks)
        model_ref = model_id or "llama"
    hf_cfg, spec_layers, notes_m, scaled = choose_model(model_ref, ordered, max_params, mode)
    notes.extend(notes_m)
    estimate = None
    if the_plan is None:
        gb = global_batch or 8 * len(ordered)
        # The plan names what is really trained: a scaled copy is written out as a config.json.
        named = isinstance(model_id, (str, Path)) and not scaled
        plan_cfg = {k: v for k, v in hf_cfg.items() if k != WEIGHTS_KEY}
        plan_model = str(model_id) if named else str(save_config(plan_cfg))
        precision = "fp32" if all(r.device == "cpu" for r in ordered) else "bf16"
        train = {"seq_len": seq_len, "global_batch": gb, "precision": precision, "mode": mode, "lora_rank": lora_rank}
        planned = _planner_plan(plan_cfg, plan_model, ordered, policy, max_budget, train, notes,
                                caps=executable_caps(ordered, recovery), catalog=catalog,
                                rebalance_every=rebalance_every or 0, recovery=recovery)
        if planned is not None:
            the_plan, estimate = planned
            ordered = order_ranks_like_plan(the_plan, list(ordered))
        else:
            the_plan = local_plan(ordered, plan_model, spec_layers, seq_len, gb, precision=precision)
            the_plan = the_plan.model_copy(update={"train": the_plan.train.model_copy(
                update={"mode": mode, "lora_rank": lora_rank})})
            notes.append("plan: local devices, one data-parallel group per device kind")
    if estimate is None:
        estimate = estimate_or_none(the_plan)
    cluster = Cluster(
        plan=the_plan, ranks=ordered, model_config=hf_cfg, model_id=model_name(model_ref), scaled=scaled,
        notes=tuple(notes), policy=policy, estimate=estimate,
        pretrained_model=model_ref if isinstance(model_ref, torch.nn.Module) else None, catalog=catalog,
    )
    for line in cluster.summary_lines():
        log.info("%s", line)
    return cluster


def _planner_plan(
    model_cfg: dict[str, Any], plan_model: str, ranks: tuple[RankSpec, ...], policy: str, max_budget: float | None,
    train: dict[str, Any], notes: list[str], *, caps: Any = None, catalog: Any = None, rebalance_every: int = 0,
    recovery: str = "restart",
) -> tuple[Plan, Any] | None:
    """The planner's best plan on exactly these devices within what this runtime executes, and its estimate;
    None (with the planner's one-line reason in ``notes``) when the planner fails.

    ``model_cfg`` is the config really trained (a scaled copy when scaled); ``plan_model`` names it in the
    plan (a saved config.json for a copy), so ``starverse estimate`` on the plan gives the same numbers.
    ``caps``: what the runtime executes here (None: :func:`executable_caps` of ``ranks``); the planner's
    plans are filtered by :func:`check_runnable`.
    """
    try:
        result = plan_on_ranks(model_cfg, plan_model, ranks, policy, train, caps if caps is not None
                               else executable_caps(ranks), max_budget=max_budget, catalog=catalog,
                               rebalance_every=rebalance_every, recovery=recovery)
        best = result.best
    except StarverseError as e:  # unknown device, nothing fits, ...: the per-kind plan, and why
        reason = " ".join(str(e).split())
        log.info("planner not used: %s", reason)
        notes.append(f"planner: not used ({e.__class__.__name__}: {reason})")
        return None
    est = best.estimate
    objective = str(result.objective) + ("" if str(result.objective) == str(policy) else f", for '{policy}'")
    notes.append(
        f"plan: planned by the planner (objective {objective}): {best.layout()}; estimate: step "
        f"{est.step_time_s:.4g} s, {best.tokens_per_s:,.0f} tokens/s, bottleneck {est.bottleneck}"
    )
    notes.extend(f"planner: {n}" for n in result.notes)
    if best.plan.train.zero_stage == 3 and PipelineLayout.from_plan(best.plan).is_pipelined:
        notes.append("plan: ZeRO-3 in pipeline stages runs the replicas in lockstep: train with "
                     "Trainer(rebalance_every=0)")
    return best.plan, est


def plan_on_ranks(model_cfg: dict[str, Any] | str, plan_model: str, ranks: Sequence[RankSpec], policy: str,
                  train: dict[str, Any], caps: Any, *, max_budget: float | None = None, catalog: Any = None,
                  rebalance_every: int = 0, recovery: str = "restart") -> Any:
    """The planner's ranked plans (``PlanResult``) on exactly these ranks within ``caps``, the runnable ones
    only (:func:`check_runnable`), the simplest within 5 % of the best first; CPU ranks priced with their
    thread count. Raises the planner's StarverseError."""
    from starverse.planner import plan_for_devices

    num_cpu = sum(1 for r in ranks if r.device_kind == "cpu")
    cpu_threads = [r.num_threads or max(1, (os.cpu_count() or 1) // num_cpu) for r in ranks if r.device_kind == "cpu"]
    cfg = model_cfg if isinstance(model_cfg, dict) else None
    return plan_for_devices(
        model_cfg, dict(Counter(r.device_kind for r in ranks)), policy=policy, max_budget_per_hour=max_budget,
        model_name=plan_model, train=train, runtime_caps=caps, top=5, catalog=catalog,
        runnable=lambda plan: check_runnable(plan, ranks, cfg, rebalance_every=rebalance_every, recovery=recovery),
        cpu_threads=min(cpu_threads) if cpu_threads else None,
    )


def estimate_or_none(plan: Plan) -> Any:
    """The cost model's estimate of ``plan`` (informative: None, logged, when it cannot be estimated)."""
    try:
        from starverse.costmodel import estimate
    except ImportError:
        return None
    try:
        return estimate(plan)
    except Exception as e:  # the estimate is informative only
        log.info("no estimate for this plan: %s", e)
        return None
