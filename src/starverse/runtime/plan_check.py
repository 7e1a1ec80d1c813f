"""The plan is checked where it runs: ``Trainer.fit`` refuses a plan these ranks and this model cannot execute.

One :class:`~starverse.errors.ConfigError` names the first thing that does not match, where it is in the plan,
and what to do: a device kind the cluster lacks (or a different count), stages whose ``layers`` do not sum to
the model's, a pipeline deeper than the model has layers, a tensor-parallel degree that does not divide the
attention heads, an interleaved stage with fewer layers than chunks, a pipeline over a model that cannot be cut.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from starverse.errors import ConfigError
from starverse.plan import Plan
from starverse.runtime.launch import RankSpec
from starverse.runtime.parallel.pipeline_layout import PipelineLayout
from starverse.runtime.parallel.pipeline_split import num_blocks
from starverse.runtime.steps import config_int


def check_ranks(plan: Plan, ranks: Sequence[RankSpec], source: str = "plan") -> None:
    """The plan's devices are exactly these ranks' device kinds, rank by rank (in the plan's rank order)."""
    _estimates_only(plan, source)
    layout = PipelineLayout.from_plan(plan)
    want = Counter(p.accelerator for p in layout.places)
    have = Counter(r.device_kind for r in ranks)
    have_text = ", ".join(f"{n} x {k}" for k, n in have.items())
    if len(layout.places) != len(ranks):
        raise ConfigError(
            f"{source}: the plan uses {len(layout.places)} devices but the provider has {len(ranks)} ({have_text}). "
            f"To fix: make the groups' devices (replicas x stages x tp) sum to {len(ranks)}, or change the number "
            "of ranks."
        )
    missing = sorted(set(want) - set(have))
    if missing:
        raise ConfigError(
            f"{source}: the plan uses {', '.join(missing)} but the cluster has no such device (it has {have_text}). "
            "To fix: plan for the devices you have (`starverse probe` lists them)."
        )
    if want != have:
        raise ConfigError(
            f"{source}: the plan wants {dict(want)} but the provider has {dict(have)}. To fix: plan for the devices "
            "you have (`starverse probe` lists them)."
        )
    for place, spec in zip(layout.places, ranks, strict=True):
        if place.accelerator != spec.device_kind:
            raise ConfigError(
                f"{source}: rank {spec.rank} is a {spec.device_kind} but the plan puts group {place.group} stage "
                f"{place.stage} ({place.accelerator}) there. To fix: order the cluster's ranks like the plan "
                "(starverse.runtime.cluster.order_ranks_like_plan)."
            )


def _estimates_only(plan: Plan, source: str) -> None:
    """Context parallelism (``groups[i].cp``) and JAX's ``dots`` recompute are estimated by the cost model, not
    run."""
    if plan.train.recompute == "dots":
        raise ConfigError(f"{source}: train.recompute is dots (JAX's checkpoint_dots_with_no_batch_dims), which is "
                          "only estimated (the runtime does not run it). To fix: use recompute: matmuls, the "
                          "runtime's op-level checkpointing of every matmul output.")
    for gi, g in enumerate(plan.groups):
        if g.cp > 1:
            raise ConfigError(f"{source}: groups[{gi}].cp is {g.cp}, but context parallelism is only estimated "
                              "(the runtime does not run it). To fix: set cp: 1.")


def check_model(plan: Plan, model: torch.nn.Module, source: str = "plan") -> None:
    """The plan's stages fit the model: layers sum, depth, TP over heads, interleaved chunks."""
    _estimates_only(plan, source)
    layout = PipelineLayout.from_plan(plan)
    pipelined = layout.is_pipelined
    for gi, g in enumerate(plan.groups):
        for si, s in enumerate(g.stages):
            if s.tp > 1:
                heads = _heads(model)
                if heads is not None and heads % s.tp:
                    raise ConfigError(
                        f"{source}: groups[{gi}].stages[{si}].tp: {s.tp} does not divide the model's {heads} "
                        f"attention heads. To fix: use a tp that divides {heads}."
                    )
    if not pipelined:
        return
    blocks = num_blocks(model)  # ConfigError when the model cannot be cut
    for gi, g in enumerate(plan.groups):
        if g.num_stages > blocks:
            raise ConfigError(
                f"{source}: groups[{gi}]: a pipeline of {g.num_stages} stages but the model has {blocks} layers. "
                f"To fix: use at most {blocks} stages."
            )
        total = sum(s.layers * s.repeat for s in g.stages)
        if total != blocks:
            raise ConfigError(
                f"{source}: groups[{gi}].stages[*].layers sum to {total} but the model has {blocks} layers. "
                f"To fix: make the stages' layers sum to {blocks}."
            )
        v = layout.virtual_stages
        for si, s in enumerate(g.stages):
            if s.layers < v:
                raise ConfigError(
                    f"{source}: groups[{gi}].stages[{si}].layers: {s.layers} cannot be split into "
                    f"train.virtual_stages={v} chunks. To fix: give each stage at least {v} layers or lower "
                    "virtual_stages."
                )


def _heads(model: torch.nn.Module) -> int | None:
    return config_int(model, "num_attention_heads", "n_head", "n_heads")
