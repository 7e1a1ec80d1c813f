"""The cost model prices ``recompute: matmuls`` as the runtime keeps it, under tensor parallelism too: on each of 2
CPU ranks (TP 2, with and without sequence parallelism) the activations alive after the forward under ``matmuls``
exceed those under ``full`` by what the estimate's memory says (torch's MemTracker; the row-parallel outputs are
whole on each rank, the rest split over TP). TP 1: ``tests/unit/test_parallel_config.py``."""

from __future__ import annotations

import pytest
import torch

from helpers import estimated_memory_bytes, forward_activation_bytes
from starverse.runtime.launch import RankSpec, launch

CFG = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 64,
       "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu"}
BATCH, SEQ = 2, 32
VARIANTS = [{"tp": 2, "recompute": rc, "sequence_parallel": sp} for sp in (False, True) for rc in ("matmuls", "full")]


def _activations(env, variants):
    """On each rank: activation bytes alive after the forward, per variant."""
    from starverse.runtime.modeling import build_model
    from starverse.runtime.parallel.parallelize import ParallelConfig, group_mesh, parallelize

    out = []
    for variant in variants:
        config = ParallelConfig(**variant)
        pm = parallelize(build_model(CFG, seed=0), config, group_mesh("cpu", env.world_size, config.tp))
        activations, loss = forward_activation_bytes(
            pm.model, torch.arange(BATCH * SEQ).reshape(BATCH, SEQ) % CFG["vocab_size"])
        loss.backward()
        out.append(activations)
    return out


def _estimated_bytes(variant: dict) -> float:
    return estimated_memory_bytes(CFG, SEQ, BATCH, variant["recompute"], variant["tp"], variant["sequence_parallel"])


@pytest.mark.timeout(300)
def test_matmuls_recompute_memory_under_tensor_parallel_is_what_the_ranks_keep():
    results = launch(_activations, [RankSpec(r, "cpu", "cpu", num_threads=1) for r in range(2)], timeout_s=240,
                     args=(VARIANTS,))
    h, q, kv, ffn, tp, layers = 32, 32, 16, 64, 2, 2
    expected = layers * BATCH * SEQ * 4 * ((q + 2 * kv + 2 * ffn) // tp + 2 * h)
    for sp in (0, 2):  # VARIANTS' pairs: without and with sequence parallelism
        predicted = _estimated_bytes(VARIANTS[sp]) - _estimated_bytes(VARIANTS[sp + 1])
        for per_rank in results:
            assert per_rank[sp] - per_rank[sp + 1] == expected, VARIANTS[sp]
        assert predicted == pytest.approx(expected, rel=1e-6), VARIANTS[sp]
