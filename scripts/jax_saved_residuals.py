"""What JAX keeps and runs again for the backward of a transformer block under ``checkpoint_dots_with_no_batch_dims``
(MaxText's ``remat_policy: minimal``), against what the cost model's ``recompute: dots`` charges.

Usage: ``python scripts/jax_saved_residuals.py [--write]`` with JAX installed (``pip install jax``: not a
dependency of Starverse; CPU is enough: the script asks XLA for 4 host devices). Prints JSON, per block form
(MaxText's parallel block, ``decoder_block: default``; the sequential block of ``llama2``) and MLP (ReLU's two
matrices, the gated three):

- ``values_per_token``: the activation values per token that ``jax.ad_checkpoint.print_saved_residuals`` lists
  (the block's weights left out);
- ``recomputed_projections``: in a model of such layers under ``jax.lax.scan`` (MaxText's ``scan_layers``), the
  FLOPs XLA's compiled step adds under ``full`` (``nothing_saveable``) and ``dots`` over no recompute, as a fraction
  of the forward projections' FLOPs: what the backward does not read (the output projections of a parallel block,
  the MLP's down projection) is not run again;
- ``tp_collectives_added``: the same scanned model with the weights split over 4 devices as Megatron's TP splits
  them and the residual stream split along the embedding (MaxText's ``activation_embed -> tensor``): the
  collectives the policies add over no recompute, in activations (XLA's CPU lowering; a TPU's may differ).

``--write`` stores it in ``data/validation/maxtext-tpu/jax_saved_residuals.json``, against which
``tests/unit/test_costmodel_memory.py`` checks what the cost model stores and runs again for the same shapes (and,
where JAX is installed, that the file is what JAX says now).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

B, T, E, HEADS, D, M, VOCAB = 2, 8, 32, 4, 16, 96, 128
"""Sequences, tokens per sequence, width, heads, head width, MLP width, vocabulary of the toy block."""
WIDE = (2, 16, 512, 8, 64, 2048)
"""(B, T, E, HEADS, D, M) of the block whose FLOPs are counted: wide enough that the projections' FLOPs are all but
all of XLA's count (its elementwise FLOPs under 1 %)."""
LAYERS = 3
"""Layers of the scanned model (MaxText's ``scan_layers``: one loop body forward, one backward)."""
TP = 4
"""Host devices the sharded block is split over."""
OUT = Path(__file__).resolve().parents[1] / "data/validation/maxtext-tpu/jax_saved_residuals.json"
"""Where ``--write`` puts the figures (read by ``tests/unit/test_costmodel_memory.py``)."""
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


def _block(parallel: bool, gated: bool, stream: Callable[[Any], Any],
           dims: tuple[int, ...] = (B, T, E, HEADS, D, M)) -> tuple[dict[str, Any], Callable[..., Any]]:
    """The toy block's weights and its function; ``stream`` places the residual stream (a sharding constraint)."""
    import jax
    import jax.numpy as jnp

    _, T, E, HEADS, D, M = dims
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 16))

    def w(*shape: int) -> Any:
        return jax.random.normal(next(keys), shape, jnp.float32) * 0.1

    params = {"wq": w(E, HEADS, D), "wk": w(E, HEADS, D), "wv": w(E, HEADS, D), "wo": w(HEADS, D, E),
              "wi": w(E, M), "wg": w(E, M), "wd": w(M, E), "n1": jnp.ones(E), "n2": jnp.ones(E)}

    def norm(x: Any, scale: Any) -> Any:
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale

    def attention(p: dict[str, Any], y: Any) -> Any:
        q = jnp.einsum("bte,ehd->bthd", y, p["wq"])
        k = jnp.einsum("bte,ehd->bthd", y, p["wk"])
        v = jnp.einsum("bte,ehd->bthd", y, p["wv"])
        scores = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(float(D))
        scores = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores, -1e9)
        ctx = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, axis=-1), v)
        return jnp.einsum("bthd,hde->bte", ctx, p["wo"])

    def mlp(p: dict[str, Any], y: Any) -> Any:
        up = jnp.einsum("bte,em->btm", y, p["wi"])
        act = jax.nn.silu(jnp.einsum("bte,em->btm", y, p["wg"])) * up if gated else jax.nn.relu(up)
        return jnp.einsum("btm,me->bte", act, p["wd"])

    def block(p: dict[str, Any], x: Any) -> Any:
        x = stream(x)
        if parallel:
            y = norm(x, p["n1"])
            return stream(x + attention(p, y) + mlp(p, y))
        h1 = stream(x + attention(p, norm(x, p["n1"])))
        return stream(h1 + mlp(p, norm(h1, p["n2"])))

    return params, block


def _policy() -> Any:
    import jax

    return jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims


def jax_values_per_token(parallel: bool, gated: bool) -> float:
    """Activation values per token that JAX saves for the block's backward under the dots policy."""
    import jax
    import jax.numpy as jnp
    from jax.ad_checkpoint import print_saved_residuals

    params, block = _block(parallel, gated, lambda x: x)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(jax.checkpoint(block, policy=_policy()), params, jnp.ones((B, T, E), jnp.float32))
    values = 0
    for line in out.getvalue().splitlines():
        shape = re.match(r"\s*\w+\[([\d,]*)\]", line)
        if shape is None or ("from the argument" in line and not line.rstrip().endswith("argument x")):
            continue  # the block's weights
        dims = [int(n) for n in shape.group(1).split(",") if n]
        if dims[:2] == [B, T]:  # an activation (the weights have no batch and token axes)
            values += int(jnp.prod(jnp.array(dims)))
    return values / (B * T)


def _collectives(hlo: str) -> dict[str, int]:
    """Values moved per collective kind in a compiled module's text (each op's result shapes, tuples summed)."""
    moved: dict[str, int] = {}
    for line in hlo.splitlines():
        op = re.match(r"\s*%\S+ = (.*?) (" + "|".join(COLLECTIVES) + r")(-start)?\(", line)
        if op is None:
            continue
        for shape in re.finditer(r"\w+\[([\d,]*)\]", op.group(1)):
            size = 1
            for n in shape.group(1).split(","):
                size *= int(n) if n else 1
            moved[op.group(2)] = moved.get(op.group(2), 0) + size
    return moved


def _scanned_grad(block: Callable[..., Any], policy: Any, params: dict[str, Any], x: Any) -> Any:
    """The compiled gradient of a model of :data:`LAYERS` copies of ``block`` under ``jax.lax.scan`` (MaxText's
    ``scan_layers``, with ``prevent_cse`` off under the scan as MaxText sets it), each layer checkpointed with
    ``policy`` (None: no recompute)."""
    import jax
    import jax.numpy as jnp

    layer = block if policy is None else jax.checkpoint(block, policy=policy, prevent_cse=False)

    def model(p: dict[str, Any], x: Any) -> Any:
        y, _ = jax.lax.scan(lambda h, pl: (layer(pl, h), None), x, p)
        return jnp.sum(y ** 2)

    return jax.jit(jax.grad(model)).lower(params, x).compile()


def _policies() -> dict[str, Any]:
    import jax

    return {"full": jax.checkpoint_policies.nothing_saveable, "dots": _policy()}


def jax_recomputed_projections(parallel: bool, gated: bool) -> dict[str, float]:
    """Per recompute policy, the FLOPs XLA's compiled step adds over no recompute, as a fraction of the forward
    projections' FLOPs (XLA counts a loop body once: one layer's forward and backward)."""
    import jax
    import jax.numpy as jnp

    b, t, e, heads, d, m = WIDE
    params, block = _block(parallel, gated, lambda x: x, WIDE)
    stacked = jax.tree_util.tree_map(lambda a: jnp.stack([a] * LAYERS), params)
    x = jnp.ones((b, t, e), jnp.float32)

    def flops(policy: Any) -> float:
        cost = _scanned_grad(block, policy, stacked, x).cost_analysis()
        return float((cost[0] if isinstance(cost, list) else cost)["flops"])

    q = heads * d
    projections = 2 * b * t * (3 * e * q + q * e + (2 if gated else 1) * e * m + m * e)
    base = flops(None)
    return {name: round((flops(policy) - base) / projections, 2) for name, policy in _policies().items()}


def jax_tp_collectives_added(parallel: bool, gated: bool) -> dict[str, dict[str, float]]:
    """Per recompute policy, the collectives XLA's compiled step of the scanned block split over :data:`TP` devices
    (weights as Megatron's TP splits them, the residual stream along the embedding: MaxText's ``activation_embed
    -> tensor``) adds over no recompute, per kind, in activations (B x T x E values; the recomputed norms'
    statistics are 1 / E of one each)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(jax.devices()[:TP], ("tensor",))
    split = {"wq": P(None, None, "tensor"), "wk": P(None, None, "tensor"), "wv": P(None, None, "tensor"),
             "wo": P(None, "tensor"), "wi": P(None, None, "tensor"), "wg": P(None, None, "tensor"),
             "wd": P(None, "tensor"), "n1": P(), "n2": P()}
    embed = NamedSharding(mesh, P(None, None, "tensor"))
    params, block = _block(parallel, gated, lambda x: jax.lax.with_sharding_constraint(x, embed))
    stacked = {k: jax.device_put(jnp.stack([v] * LAYERS), NamedSharding(mesh, split[k])) for k, v in params.items()}
    x = jax.device_put(jnp.ones((B, T, E), jnp.float32), embed)

    def moved(policy: Any) -> dict[str, int]:
        return _collectives(_scanned_grad(block, policy, stacked, x).as_text())

    base = moved(None)
    return {name: {k: (after.get(k, 0) - base.get(k, 0)) / (B * T * E) for k in COLLECTIVES
                   if after.get(k, 0) != base.get(k, 0)}
            for name, after in ((name, moved(policy)) for name, policy in _policies().items())}


def main() -> None:
    """Print (``--write``: also store) the figures of the four block forms."""
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={TP}"
    import jax

    forms = [(par, gated) for par in (True, False) for gated in (False, True)]

    def name(par: bool, gated: bool) -> str:
        return f"{'parallel' if par else 'sequential'}-{'gated' if gated else 'relu'}"

    text = json.dumps({"jax": jax.__version__, "shape": {"batch": B, "seq": T, "emb": E, "heads": HEADS,
                                                         "head_dim": D, "mlp": M, "vocab": VOCAB, "tp": TP,
                                                         "layers": LAYERS, "wide": list(WIDE)},
                       "values_per_token": {name(*f): jax_values_per_token(*f) for f in forms},
                       "recomputed_projections": {name(*f): jax_recomputed_projections(*f) for f in forms},
                       "tp_collectives_added": {name(*f): jax_tp_collectives_added(*f) for f in forms}},
                      indent=1) + "\n"
    print(text, end="")
    if "--write" in sys.argv[1:]:
        OUT.write_text(text)


if __name__ == "__main__":
    main()
