"""On a CUDA machine: the local provider finds the GPUs, and Trainer.fit trains on them in bf16."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_local_provider_names_the_gpus():
    from starverse.providers.local import local_ranks

    ranks = local_ranks()
    assert len(ranks) == torch.cuda.device_count()
    assert [r.device for r in ranks] == [f"cuda:{i}" for i in range(len(ranks))]
    assert all(not r.device_kind.startswith("cpu") for r in ranks)


def test_fit_on_one_gpu_in_bf16_learns(tmp_path):
    from starverse.providers.local import local_ranks
    from starverse.runtime.cluster import Cluster, local_plan
    from starverse.runtime.modeling import build_model
    from starverse.runtime.trainer import Trainer

    ranks = tuple(local_ranks()[:1])
    cluster = Cluster(plan=local_plan(ranks, "tiny", 2, 64, 8, precision="bf16"), ranks=ranks)
    model = build_model({"model_type": "llama", "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 2,
                         "num_attention_heads": 2, "vocab_size": 257})
    data = [torch.arange(64 * 200) % 50]
    res = Trainer(cluster, run_dir=tmp_path, lr=3e-3, rebalance_every=0).fit(
        model, dataset=data, per_device_batch_size=4, max_steps=20, seq_len=64, tokenizer="bytes"
    )
    assert res.steps == 20
    assert res.losses[-1] < res.losses[0] - 1.0
    assert res.ranks[0].device_kind == ranks[0].device_kind
