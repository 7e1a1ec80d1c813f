"""What JAX keeps for the backward of a transformer block under ``checkpoint_dots_with_no_batch_dims`` (MaxText's
``remat_policy: minimal``), against what the cost model's ``recompute: dots`` stores (``costmodel.memory``).

Usage: ``python scripts/jax_saved_residuals.py [--write]`` with JAX installed (``pip install jax``: not a
dependency of Starverse; CPU is enough). Prints JSON: per block form (MaxText's parallel block, ``decoder_block:
default``; the sequential block of ``llama2``) and MLP (ReLU's two matrices, the gated three), the activation values
per token that ``jax.ad_checkpoint.print_saved_residuals`` lists (the block's weights left out); ``--write`` stores
it in ``data/validation/maxtext-tpu/jax_saved_residuals.json``, against which
``tests/unit/test_costmodel_memory.py`` checks what the cost model's ``recompute: dots`` stores for the same shapes
(and, where JAX is installed, that the file is what JAX says now).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
from pathlib import Path
from typing import Any

B, T, E, HEADS, D, M, VOCAB = 2, 8, 32, 4, 16, 96, 128
"""Sequences, tokens per sequence, width, heads, head width, MLP width, vocabulary of the toy block."""


def jax_values_per_token(parallel: bool, gated: bool) -> float:
    """Activation values per token that JAX saves for the block's backward under the dots policy."""
    import jax
    import jax.numpy as jnp
    from jax.ad_checkpoint import print_saved_residuals

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
        if parallel:
            y = norm(x, p["n1"])
            return x + attention(p, y) + mlp(p, y)
        h1 = x + attention(p, norm(x, p["n1"]))
        return h1 + mlp(p, norm(h1, p["n2"]))

    remat = jax.checkpoint(block, policy=jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(remat, params, jnp.ones((B, T, E), jnp.float32))
    values = 0
    for line in out.getvalue().splitlines():
        shape = re.match(r"\s*\w+\[([\d,]*)\]", line)
        if shape is None or ("from the argument" in line and not line.rstrip().endswith("argument x")):
            continue  # the block's weights
        dims = [int(n) for n in shape.group(1).split(",") if n]
        if dims[:2] == [B, T]:  # an activation (the weights have no batch and token axes)
            values += int(jnp.prod(jnp.array(dims)))
    return values / (B * T)


OUT = Path(__file__).resolve().parents[1] / "data/validation/maxtext-tpu/jax_saved_residuals.json"
"""Where ``--write`` puts the figures (read by ``tests/unit/test_costmodel_memory.py``)."""


def main() -> None:
    """Print (``--write``: also store) the saved values per token of the four block forms."""
    import jax

    rows = {f"{'parallel' if par else 'sequential'}-{'gated' if gated else 'relu'}": jax_values_per_token(par, gated)
            for par in (True, False) for gated in (False, True)}
    text = json.dumps({"jax": jax.__version__, "shape": {"batch": B, "seq": T, "emb": E, "heads": HEADS,
                                                         "head_dim": D, "mlp": M, "vocab": VOCAB},
                       "values_per_token": rows}, indent=1) + "\n"
    print(text, end="")
    if "--write" in sys.argv[1:]:
        OUT.write_text(text)


if __name__ == "__main__":
    main()
