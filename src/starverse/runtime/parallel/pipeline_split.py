"""Cut a model into pipeline chunks that keep the unsplit model's parameter names.

Two kinds of model are cut:

- a ``transformers`` causal LM of a family in :data:`FAMILIES` (what ``build_model`` builds). A chunk is a copy
  of the whole model whose decoder block list keeps only its blocks; the first chunk runs the base model from
  ``input_ids``, later chunks enter it with ``inputs_embeds`` = the previous chunk's hidden states, so the base
  model's own code makes the causal mask, positions and rotary tables on every chunk. Modules a later chunk must
  not apply again (absolute position embeddings, embedding dropout/norm) are replaced by parameter-free stand-ins,
  the final norm is an identity before the last chunk, and the last chunk applies the LM head.
- a user's model given as a list of blocks (``nn.Sequential`` or a list/``nn.ModuleList``): each block is one
  layer; the first block takes token ids, the last returns logits.

Every chunk parameter carries the *fully-qualified name it has in the unsplit model* (:attr:`Chunk.names`):
gradients are summed, checkpoints keyed and final weights assembled by these names, whatever the layout. A tied
output head (GPT-2) is the embedding's parameter on the last chunk, under the embedding's name, so its gradient
is summed between the first and last stage like any parameter held by two ranks.

Between device kinds a chunk takes its input from and gives its output to the host (``comm_device``): the
pipeline's point-to-point transfers then go over gloo, and autograd moves the gradients back across the bridge.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from starverse.errors import ConfigError
from starverse.runtime.parallel.pipeline_weights import load_chunk_weights


@dataclass(frozen=True)
class Family:
    """Where a ``transformers`` family keeps the parts a pipeline cuts between."""

    base: str
    """Attribute of the causal LM holding the base model."""
    blocks: str
    """Attribute of the base model holding the decoder blocks (an ``nn.ModuleList``)."""
    final_norm: str
    """Attribute of the base model holding the final norm."""
    embed: str
    """Attribute of the base model holding the token embedding (not run after the first chunk)."""
    zero_after_first: tuple[str, ...] = ()
    """Embeddings added to the input inside the base model (absolute positions): zero after the first chunk."""
    identity_after_first: tuple[str, ...] = ()
    """Input-side modules applied once (embedding dropout / norm): identity after the first chunk."""


FAMILIES: dict[str, Family] = {
    "llama": Family("model", "layers", "norm", "embed_tokens"),
    "mistral": Family("model", "layers", "norm", "embed_tokens"),
    "mixtral": Family("model", "layers", "norm", "embed_tokens"),
    "qwen2": Family("model", "layers", "norm", "embed_tokens"),
    "gpt2": Family("transformer", "h", "ln_f", "wte", ("wpe",), ("drop",)),
    "gpt_neox": Family("gpt_neox", "layers", "final_layer_norm", "embed_in", (), ("emb_dropout",)),
    "falcon": Family("transformer", "h", "ln_f", "word_embeddings"),
    "bloom": Family("transformer", "h", "ln_f", "word_embeddings", (), ("word_embeddings_layernorm",)),
    "mpt": Family("transformer", "blocks", "norm_f", "wte", (), ("emb_drop",)),
}
"""The bundled families a pipeline can cut (OPT's learned positions with an offset are not handled yet)."""


class _Zeros(nn.Module):
    """Stands for an absolute-position embedding after the first chunk: adds nothing (no parameters)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros((*ids.shape, self.dim), device=ids.device)


class Chunk(nn.Module):
    """One pipeline chunk (virtual stage): ``forward(x)`` -> hidden states, or logits on the last chunk."""

    def __init__(
        self, body: nn.Module, run: Callable[[nn.Module, torch.Tensor], torch.Tensor], names: dict[str, str],
        device: torch.device, comm_device: torch.device,
    ) -> None:
        super().__init__()
        self.body = body
        self._run = run
        self.names = names
        """Unsplit-model name of each of this chunk's parameters, by its name in ``body`` (wrappers aside)."""
        self.device = device
        self.comm_device = comm_device
        self.loaded_tensors = 0
        """Tensors this chunk read from the model folder (per-stage loading; 0: cut from a whole model)."""
        self.sequence_mesh: Any = None
        """The stage's TP mesh when sequence parallel splits the hidden states between stages (None: whole)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run the chunk on its device; input and output live on the pipeline's communication device.

        Under sequence parallel (:attr:`sequence_mesh`) hidden states cross between stages as each TP rank's
        sequence shard: the input is this rank's shard of the previous stage's output, the output this rank's
        shard (token ids and logits are whole)."""
        x = x.to(self.device)
        if self.sequence_mesh is not None and x.is_floating_point():
            from torch.distributed.tensor import DTensor, Shard

            x = DTensor.from_local(x, self.sequence_mesh, [Shard(1)], run_check=False)
        y = self._run(self.body, x)
        if self.sequence_mesh is not None and hasattr(y, "to_local"):
            y = y.to_local()  # type: ignore[operator]
        return y.to(self.comm_device)

    def named_parameters_unsplit(self) -> list[tuple[str, nn.Parameter]]:
        """``(unsplit-model name, parameter)`` of every parameter of this chunk (tied ones once).

        Looked up by the parameter's name in the chunk, so it still holds after tensor parallelism or FSDP
        replaced the parameters (DTensors) and recompute wrapped the blocks (its prefix is left out).
        """
        return [(self.names[local_name(n)], p) for n, p in self.body.named_parameters()]


def local_name(name: str) -> str:
    """A parameter's name inside a chunk without the prefixes wrappers add (activation checkpointing)."""
    return name.replace(_WRAPPED, "")


_WRAPPED = "_checkpoint_wrapped_module."


class _Blocks(nn.Module):
    """A run of a user's blocks, kept in an ``nn.ModuleList`` (the unit recompute wraps and ZeRO shards)."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def num_blocks(model: nn.Module | list[nn.Module]) -> int:
    """Layers a pipeline splits: decoder blocks of a bundled family, or the blocks of a list of blocks."""
    if _is_block_list(model):
        return len(_as_sequential(model))
    assert isinstance(model, nn.Module)
    fam = family_of(model)
    return len(getattr(getattr(model, fam.base), fam.blocks))


def can_be_pipelined(model: nn.Module | list[nn.Module]) -> bool:
    """Whether a pipeline can cut ``model`` into stages (a bundled family or a list of blocks)."""
    try:
        num_blocks(model)
    except ConfigError:
        return False
    return True


def family_of(model: nn.Module) -> Family:
    """The :class:`Family` of a ``transformers`` causal LM; ConfigError naming the fix otherwise."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    fam = FAMILIES.get(str(model_type))
    if fam is None:
        raise ConfigError(
            f"a pipeline cannot cut {type(model).__name__} (model_type {model_type!r}): it splits the families "
            f"{', '.join(sorted(FAMILIES))} or a model given as a list of blocks. To fix: pass the model as an "
            "nn.Sequential of blocks (first takes token ids, last returns logits), or use one stage per group."
        )
    return fam


def as_module(model: nn.Module | list[nn.Module]) -> nn.Module:
    """The model as one module: a list of blocks becomes an ``nn.Sequential`` (its names are ``0.``, ``1.``, ...)."""
    return _as_sequential(model) if _is_block_list(model) else model  # type: ignore[return-value]


def cut(
    model: nn.Module, first_layer: int, num_layers: int, is_first: bool, is_last: bool, device: torch.device,
    comm_device: torch.device, weights: Path | None = None,
) -> Chunk:
    """The chunk of ``model`` holding layers ``first_layer .. first_layer + num_layers - 1`` (a fresh copy).

    ``weights``: ``model`` is a skeleton (:func:`~starverse.runtime.parallel.pipeline_weights.skeleton`) whose
    meta parameters the chunk reads from this folder's safetensors (only its own tensors)."""
    memo: dict[int, object] = {}
    body = copy.deepcopy(model, memo)
    by_id = {id(memo[id(p)]): n for n, p in model.named_parameters()}
    keep = range(first_layer, first_layer + num_layers)
    if isinstance(body, nn.Sequential) and not hasattr(body, "config"):
        blocks = _Blocks([body[i] for i in keep])
        names = {n: by_id[id(p)] for n, p in blocks.named_parameters()}
        chunk = Chunk(blocks, _run_blocks, names, device, comm_device)
    else:
        fam = family_of(body)
        base = getattr(body, fam.base)
        old = getattr(base, fam.blocks)
        setattr(base, fam.blocks, nn.ModuleList([old[i] for i in keep]))
        if not is_first:
            setattr(base, fam.embed, nn.Identity())
            for name in fam.zero_after_first:
                setattr(base, name, _Zeros(getattr(base, name).embedding_dim))
            for name in fam.identity_after_first:
                setattr(base, name, nn.Identity())
        if not is_last:
            setattr(base, fam.final_norm, nn.Identity())
            body.lm_head = nn.Identity()  # type: ignore[assignment]
        run = _run_first_hf if is_first else _run_later_hf
        names = {n: by_id[id(p)] for n, p in body.named_parameters()}
        chunk = Chunk(body, _with_head(run, fam.base) if is_last else _without_head(run, fam.base), names, device,
                      comm_device)
    if weights is not None:
        chunk.loaded_tensors = load_chunk_weights(chunk.body, chunk.names, weights)
    chunk.to(device)
    return chunk


def _is_block_list(model: object) -> bool:
    return isinstance(model, (list, tuple, nn.ModuleList)) or (
        isinstance(model, nn.Sequential) and not hasattr(model, "config")
    )


def _as_sequential(model: object) -> nn.Sequential:
    if isinstance(model, nn.Sequential):
        return model
    blocks = list(model)  # type: ignore[call-overload]
    if not blocks or not all(isinstance(b, nn.Module) for b in blocks):
        raise ConfigError("a model given as a list of blocks must be a non-empty list of nn.Module.")
    return nn.Sequential(*blocks)


def _run_blocks(body: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = body(x)
    return out


def _run_first_hf(base: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = base(input_ids=x, use_cache=False)[0]
    return out


def _run_later_hf(base: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = base(inputs_embeds=x, use_cache=False)[0]
    return out


def _with_head(
    run: Callable[[nn.Module, torch.Tensor], torch.Tensor], base: str
) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    def f(body: nn.Module, x: torch.Tensor) -> torch.Tensor:
        head: nn.Module = body.get_submodule("lm_head")
        out: torch.Tensor = head(run(getattr(body, base), x))
        return out

    return f


def _without_head(
    run: Callable[[nn.Module, torch.Tensor], torch.Tensor], base: str
) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    def f(body: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return run(getattr(body, base), x)

    return f
