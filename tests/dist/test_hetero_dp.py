"""Heterogeneous data parallelism is exact: K steps with uneven shares (and a rebalance in the middle)
give the same losses and weights as one process on the same global batches (fp32)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from helpers import SEQ, SleepyRank, TinyLM, reference_training
from helpers import ramp_tokens as _tokens
from starverse.runtime.cluster import Cluster, local_plan
from starverse.runtime.data import PackedDataset
from starverse.runtime.launch import RankSpec
from starverse.runtime.steps import batch_loss
from starverse.runtime.trainer import Trainer

MB, GB, STEPS = 2, 16, 6


def _reference(model: torch.nn.Module, trainer: Trainer) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain single-process training on the same global batches, with the trainer's own building blocks."""
    tokens = np.concatenate([t.numpy() for t in _tokens()]).astype(np.int32)
    return reference_training(model, trainer, PackedDataset(tokens, SEQ), STEPS, GB, batch_loss)


def _cluster(kinds: list[str]) -> Cluster:
    ranks = tuple(RankSpec(r, k, "cpu", num_threads=1) for r, k in enumerate(kinds))
    return Cluster(plan=local_plan(ranks, "tiny", 1, SEQ, GB, precision="fp32"), ranks=ranks)


@pytest.mark.parametrize(
    ("kinds", "shares", "slow_rank"),
    [
        (["cpu", "cpu"], [2, 6], 1),  # 1:3, the rank with 3/4 of the batch made slow -> rebalance
        (["cpu", "cpu", "cpu-b"], [2, 2, 4], 2),  # 1:1:2 over two device kinds (gloo bridge), rebalance
    ],
)
def test_uneven_shares_with_rebalance_equal_single_process(tmp_path, kinds, shares, slow_rank):
    torch.manual_seed(0)
    model = TinyLM()
    initial = copy.deepcopy(model)
    trainer = Trainer(
        _cluster(kinds), callbacks=[SleepyRank(slow_rank, 0.12)], run_dir=tmp_path, lr=2e-2, warmup_steps=2,
        grad_clip=0.5, rebalance_every=2, hysteresis=0.05, timeout_s=240,
    )
    res = trainer.fit(model, dataset=_tokens(), per_device_batch_size=MB, max_steps=STEPS, seq_len=SEQ,
                      global_batch=GB, shares=shares)
    ref_losses, ref_state = _reference(initial, trainer)

    # Shares changed during the run (the slowed rank lost micro-batches), and always covered the batch.
    assert res.shares_history[0] == (0, tuple(shares))
    assert len(res.shares_history) >= 2, res.shares_history
    # The slowed rank lost micro-batches at some rebalance (later ones may move with the machine's load).
    assert min(s[slow_rank] for _, s in res.shares_history) < shares[slow_rank], res.shares_history
    assert all(sum(s) == GB // MB for _, s in res.shares_history)

    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(ref_losses))  # fp32 tolerances
    assert ref_losses[-1] < ref_losses[0] - 0.1  # it learned: the comparison is not of two untouched models
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, ref_state[name], msg=name)
    assert res.steps == STEPS and res.tokens_total == STEPS * GB * SEQ


def test_wrong_weighting_would_be_caught(tmp_path):
    """The reference is sensitive: averaging per-rank means (ignoring shares) gives a different step."""
    torch.manual_seed(0)
    model = TinyLM()
    tokens = np.concatenate([t.numpy() for t in _tokens()]).astype(np.int32)
    x = torch.from_numpy(PackedDataset(tokens, SEQ).batch(np.arange(GB)))
    right = batch_loss(model, x)
    wrong = 0.5 * (batch_loss(model, x[:4]) + batch_loss(model, x[4:]))  # shares 1:3, unweighted
    assert abs(right.item() - wrong.item()) > 1e-4
