"""On a CUDA machine with bitsandbytes: QLoRA quantizes the base to 4 bits, trains only the adapters, and a short
fit lowers the loss. NOT RUN in the session that wrote it (no GPU was lent): it is the check to run on one."""

from __future__ import annotations

import pytest

from helpers import CORPUS, save_tiny_pretrained

pytestmark = pytest.mark.gpu


def test_qlora_trains_adapters_over_a_4bit_base(tmp_path):
    bnb = pytest.importorskip("bitsandbytes")
    import starverse
    from starverse.providers.local import local_ranks

    save_tiny_pretrained(tmp_path / "base")
    (tmp_path / "corpus.txt").write_text(CORPUS)
    ranks = local_ranks()[:1]
    cluster = starverse.accelerate(model_id=str(tmp_path / "base"), seq_len=32, global_batch=4, mode="qlora",
                                   lora_rank=8)
    assert [r.device for r in cluster.ranks] == [ranks[0].device]
    model = starverse.build_model(cluster)
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    assert all(p.requires_grad == (".lora_" in n) for n, p in model.named_parameters())
    fit = starverse.Trainer(cluster, run_dir=tmp_path / "run", lr=2e-2, progress=False).fit(
        model, dataset=tmp_path / "corpus.txt", per_device_batch_size=1, max_steps=12)
    assert fit.losses[-1] < fit.losses[0]
