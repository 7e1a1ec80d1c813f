"""Tensor parallelism inside a pipeline stage: the Megatron column/row split with DTensor ``parallelize_module``.

Each decoder block's attention is split by heads (Q, K, V projections column-wise, so every rank holds
``heads / tp`` query heads and ``kv_heads / tp`` KV heads; the output projection row-wise, one all-reduce)
and its MLP by the intermediate width (gate/up column-wise, down row-wise, one all-reduce): two all-reduces
per block forward, two backward (Shoeybi et al. 2019). The input embedding is split by vocabulary rows and the
output head by vocabulary columns, so the largest matrices are split too; the head gathers its logits, so the
loss is the model's own (no loss-parallel cross-entropy: every rank holds the full logits of its micro-batch).

Which linears are column- and which row-wise is read from the family's own ``base_model_tp_plan`` (the
table ``transformers`` keeps for Llama, Mistral, Qwen2, Gemma, GPT-NeoX, …), so the split follows each
family's module names. Families without a plain column/row table (GPT-2's fused ``Conv1D``, Falcon's
multi-query fused QKV, MoE experts, Qwen3's per-head norms) are refused with :class:`TensorParallelError`
rather than run wrong.

A linear carrying peft LoRA adapters is split with them (see :func:`_split_linear`), so ``train.mode: lora``
runs under TP; parameters frozen before the split stay frozen. QLoRA's packed 4-bit weights cannot be split
(refused by ``parallelize.check_tensor_parallel_plan``).

``sequence_parallel=True`` (Korthikanti et al. 2022) also splits the activations between the blocks' matmul
regions along the sequence: norms and residual adds run on ``seq / tp`` tokens per rank, the all-reduces
become a reduce-scatter + all-gather pair (the same bytes).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from starverse.errors import ConfigError
from starverse.runtime.parallel.dtensor import is_dtensor

if TYPE_CHECKING:  # DTensor costs ~1 s per process: imported where a model is split (tp_layout, checks need none)
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

log = logging.getLogger(__name__)


class TensorParallelError(ConfigError):
    """A plan's ``tp`` cannot be applied to this model (family not supported, or sizes not divisible)."""


@dataclass(frozen=True)
class TensorParallelLayout:
    """How a model's blocks are split (read from its family's ``base_model_tp_plan``)."""

    base_prefix: str
    """Attribute path of the base model inside the causal LM (``model``, ``gpt_neox``)."""
    column: tuple[str, ...]
    """Plan keys (relative to the base model, ``*`` for the block index) split column-wise."""
    row: tuple[str, ...]
    """Plan keys split row-wise."""
    regions: tuple[str, ...]
    """Parent modules of the split linears (attention, MLP): their input is gathered under sequence parallel."""


_SUPPORTED_STYLES = {"colwise", "rowwise", "embedding_rowwise"}


def tp_layout(model: torch.nn.Module) -> TensorParallelLayout:
    """The column/row layout of ``model`` (a ``transformers`` causal LM); raises if its family has none."""
    config = getattr(model, "config", None)
    family = getattr(config, "model_type", type(model).__name__)
    plan: Mapping[str, str] | None = getattr(config, "base_model_tp_plan", None)
    prefix = getattr(model, "base_model_prefix", None)
    if not plan or not prefix or not hasattr(model, prefix):
        raise TensorParallelError(
            f"tensor parallelism is not available for {family!r}: the model declares no column/row split "
            "(transformers' base_model_tp_plan). To fix: set tp: 1 for this model, or use a family with one "
            "(llama, mistral, qwen2, gemma, gpt_neox)."
        )
    unsupported = sorted({style for style in plan.values() if style not in _SUPPORTED_STYLES})
    if unsupported:
        raise TensorParallelError(
            f"tensor parallelism for {family!r} needs split styles {unsupported} that Starverse does not run "
            "(fused or per-head modules). To fix: set tp: 1 for this model."
        )
    column = tuple(k for k, v in plan.items() if v == "colwise")
    row = tuple(k for k, v in plan.items() if v == "rowwise")
    regions = tuple(dict.fromkeys(k.rsplit(".", 1)[0] for k in column))
    return TensorParallelLayout(base_prefix=prefix, column=column, row=row, regions=regions)


def check_tensor_parallel(config: Any, tp: int) -> None:
    """Raise :class:`TensorParallelError` unless ``tp`` divides the attention heads, KV heads and MLP width."""
    if tp == 1:
        return
    sizes = {
        "attention heads": _first(config, "num_attention_heads", "n_head"),
        "KV heads": _first(config, "num_key_value_heads", "num_attention_heads", "n_head"),
        "MLP width": _first(config, "intermediate_size", "n_inner"),
    }
    for what, value in sizes.items():
        if value is not None and value % tp:
            family = getattr(config, "model_type", "model")
            raise TensorParallelError(
                f"tp {tp} does not divide the {family}'s {value} {what}. To fix: choose a tp that divides "
                f"{value} (e.g. {_largest_divisor(value, tp)})."
            )


def _first(config: Any, *keys: str) -> int | None:
    for key in keys:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, at_most + 1) if n % d == 0)


def apply_tensor_parallel(
    model: torch.nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False
) -> torch.nn.Module:
    """Split ``model`` over the 1-D mesh ``tp_mesh`` in place (Megatron column/row); returns it.

    The model's forward keeps its signature and its output: logits are gathered, the loss is the model's.
    Parameters become DTensors sharded on ``tp_mesh`` (replicated ones, such as norms, stay plain tensors
    unless ``sequence_parallel``). Raises :class:`TensorParallelError` for a family without a split table
    or sizes ``tp`` does not divide.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tp = tp_mesh.size()
    config = getattr(model, "config", None)
    layout = tp_layout(model)
    # parallelize_module re-creates parameters (SequenceParallel's as requires_grad=True): frozen stays frozen
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    check_tensor_parallel(config, tp)
    base = getattr(model, layout.base_prefix)
    vocab = _first(config, "vocab_size")
    split_vocab = vocab is not None and vocab % tp == 0
    seq_layout = Shard(1) if sequence_parallel else Replicate()

    plan: dict[str, ParallelStyle] = {}
    for key in layout.column:
        plan.update(_split_linear(base, key, "colwise", sequence_parallel))
    for key in layout.row:
        plan.update(_split_linear(base, key, "rowwise", sequence_parallel))
    if sequence_parallel:
        for name in _norm_names(base, layout):
            plan[name] = SequenceParallel()
    emb = _module_from(model, "get_input_embeddings")
    head = _module_from(model, "get_output_embeddings")
    tied = emb is not None and head is not None and head.weight is getattr(emb, "weight", None)
    if emb is not None and split_vocab:
        emb_name = _name_in(base, emb)
        if emb_name is not None:
            # Vocab-row split: each rank looks up its rows, the partial embeddings are summed (or scattered).
            plan[emb_name] = RowwiseParallel(
                input_layouts=Replicate(), output_layouts=seq_layout, use_local_output=not sequence_parallel
            )
    elif emb is not None and sequence_parallel:
        emb.register_forward_hook(partial(_scatter_sequence, tp_mesh))
    parallelize_module(base, tp_mesh, plan)
    if sequence_parallel:
        _lora_hooks(base, layout, tp_mesh)
        for region in layout.regions:
            for _, mod in _matching(base, region):
                mod.register_forward_pre_hook(_gather_sequence, with_kwargs=True)

    if head is not None and isinstance(head, torch.nn.Linear):
        head_name = _name_in(model, head)
        if head_name is not None and split_vocab:
            parallelize_module(model, tp_mesh, {head_name: ColwiseParallel(input_layouts=seq_layout,
                                                                           output_layouts=Replicate())})
            if tied:
                # Both are Shard(0) of the same [vocab, hidden] matrix: restore the tie on the one DTensor.
                head.weight = emb.weight  # type: ignore[union-attr,assignment]
        elif sequence_parallel:
            head.register_forward_pre_hook(_gather_sequence, with_kwargs=True)
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    log.info("tensor parallel over %d ranks%s", tp, " with sequence parallel" if sequence_parallel else "")
    return model


def _split_linear(base: torch.nn.Module, key: str, style: str, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The plan entries that split the linears ``key`` matches ``style``-wise (see the module docstring).

    A linear carrying LoRA adapters (peft's ``LoraLayer``: ``base_layer``, ``lora_A.<name>``,
    ``lora_B.<name>``) is split with its adapters so the adapted output is split as the plain one is:
    column-wise, ``lora_B`` (rank → out) is split column-wise too and ``lora_A`` stays whole (its input is the
    whole activation; DTensor all-reduces the gradient flowing back into it, as for the base); row-wise,
    ``lora_A`` (in → rank) is split row-wise (its input is the sharded activation; its rank-wide output is
    all-reduced, a few numbers per token) and ``lora_B`` stays whole and plain, so its gradient is the same
    on every TP rank. Under sequence parallel ``lora_B``'s output is then cut to this rank's part of the
    sequence, as the base's is reduce-scattered (see :func:`_lora_hooks`).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    seq_layout = Shard(1) if sequence_parallel else Replicate()

    def split() -> ParallelStyle:
        if style == "colwise":
            return ColwiseParallel()
        return RowwiseParallel(output_layouts=seq_layout, use_local_output=not sequence_parallel)

    adapters = {name for _, mod in _matching(base, key) for name in _adapters(mod, "lora_A")}
    if not adapters:
        return {key: split()}
    out: dict[str, ParallelStyle] = {f"{key}.base_layer": split()}
    for name in sorted(adapters):
        if style == "colwise":
            out[f"{key}.lora_B.{name}"] = ColwiseParallel()
        else:
            out[f"{key}.lora_A.{name}"] = RowwiseParallel(output_layouts=Replicate())
    return out


def _lora_hooks(base: torch.nn.Module, layout: TensorParallelLayout, tp_mesh: DeviceMesh) -> None:
    """Under sequence parallel: each row-wise split linear's ``lora_B`` (whole, on the whole sequence) keeps
    this rank's sequence shard of its output, a DTensor to add to the base's reduce-scattered one."""
    for key in layout.row:
        for _, mod in _matching(base, key):
            for lora_b in _adapters(mod, "lora_B").values():
                lora_b.register_forward_hook(partial(_scatter_sequence, tp_mesh))


def _adapters(module: torch.nn.Module, which: str) -> dict[str, torch.nn.Module]:
    """``module.<which>`` (``lora_A`` or ``lora_B``: adapter name → linear) when ``module`` is a peft LoRA layer
    wrapping a linear (``base_layer`` plus ``lora_A``/``lora_B`` module dicts), else empty."""
    found = getattr(module, which, None)
    if not isinstance(getattr(module, "base_layer", None), torch.nn.Module) or not isinstance(found, torch.nn.ModuleDict):
        return {}
    return dict(found.items())


def _scatter_sequence(mesh: DeviceMesh, module: torch.nn.Module, args: Any, output: torch.Tensor) -> Any:
    """Forward hook of a replicated embedding under sequence parallel: keep this rank's sequence shard."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    return DTensor.from_local(output, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(1)])


def _gather_sequence(
    module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Forward pre-hook of a split region under sequence parallel: its sequence-sharded input, all-gathered.

    A hook rather than ``PrepareModuleInput``: families call their attention with the hidden states as a
    keyword (Llama) or positionally (GPT-NeoX), and the region takes whichever it gets.
    """
    from torch.distributed.tensor import Replicate

    if args and is_dtensor(args[0]):
        args = (args[0].redistribute(placements=[Replicate()]).to_local(), *args[1:])
    hidden = kwargs.get("hidden_states")
    if is_dtensor(hidden):
        kwargs = {**kwargs, "hidden_states": hidden.redistribute(placements=[Replicate()]).to_local()}
    return args, kwargs


def _matching(root: torch.nn.Module, pattern: str) -> list[tuple[str, torch.nn.Module]]:
    parts = pattern.split(".")
    return [
        (name, mod) for name, mod in root.named_modules()
        if len(name.split(".")) == len(parts)
        and all(p == "*" or p == q for p, q in zip(parts, name.split("."), strict=True))
    ]


def _module_from(model: torch.nn.Module, getter: str) -> torch.nn.Module | None:
    """``model.get_input_embeddings()`` / ``get_output_embeddings()`` of a transformers model, else None."""
    fn = getattr(model, getter, None)
    mod = fn() if callable(fn) else None
    # a weightless stand-in (a pipeline chunk's Identity in place of the embedding or head) counts as none
    return mod if isinstance(mod, torch.nn.Module) and hasattr(mod, "weight") else None


def _name_in(root: torch.nn.Module, target: torch.nn.Module) -> str | None:
    for name, mod in root.named_modules():
        if mod is target:
            return name
    return None


def _norm_names(base: torch.nn.Module, layout: TensorParallelLayout) -> list[str]:
    """Norm modules outside the split regions (they run on the sequence shard under sequence parallel)."""
    region_roots = tuple(r.split(".*.", 1) for r in layout.regions)
    names = []
    for name, mod in base.named_modules():
        if "norm" not in type(mod).__name__.lower():
            continue
        parts = name.split(".")
        inside = any(
            len(parts) > 2 and parts[0] == root and parts[2] == sub.split(".")[0] for root, sub in region_roots
        )
        if not inside:
            names.append(name)
    return names
