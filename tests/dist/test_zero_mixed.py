"""ZeRO-2 and ZeRO-3 (FSDP2) over data-parallel groups of two device kinds with uneven shares are exact.

Two CPU ranks of different kinds (``cpu`` and ``cpu-b``: one group each, so one FSDP2 mesh over both, gloo),
shares 1:3 of the global batch. ZeRO-2/3 gather and reduce-scatter per micro-batch, so both ranks run
``min(shares)`` micro-batches of uneven sizes (one sequence against three), each loss scaled by its own size:
losses and final weights equal one process training on the same global batches (fp32). ZeRO-2 rebalances in the
middle (the rank with 3/4 of the batch is slowed), so the sizes change between steps.
"""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import TINY, SleepyRank, reference_training
from helpers import ramp_tokens as _tokens
from starverse.runtime.cluster import Cluster, local_plan
from starverse.runtime.data import PackedDataset, pack, tokenize_corpus
from starverse.runtime.launch import RankSpec
from starverse.runtime.modeling import build_model
from starverse.runtime.trainer import Trainer

MB, GB, STEPS, SEQ = 1, 4, 3, 16
LLAMA = {**TINY, "num_hidden_layers": 2}


def _cluster(**train: object) -> Cluster:
    ranks = (RankSpec(0, "cpu", "cpu", num_threads=1), RankSpec(1, "cpu-b", "cpu", num_threads=1))
    plan = local_plan(ranks, "tiny", 2, SEQ, GB, precision="fp32")
    assert len(plan.groups) == 2  # one group per kind
    return Cluster(plan=plan.model_copy(update={"train": plan.train.model_copy(update=train)}), ranks=ranks)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("train", "rebalance_every"), [({"zero_stage": 2}, 1), ({"zero_stage": 3}, 0)],
                         ids=["zero2-rebalanced", "zero3"])
def test_zero_over_two_kinds_with_uneven_shares_equals_single_process(tmp_path, train, rebalance_every):
    model = build_model(LLAMA, seed=0)
    initial = copy.deepcopy(model)
    slow = [SleepyRank(1, 0.2)] if rebalance_every else []
    trainer = Trainer(_cluster(**train), run_dir=tmp_path, lr=2e-2, warmup_steps=1, callbacks=slow, grad_clip=0.5,
                      rebalance_every=rebalance_every, hysteresis=0.05, timeout_s=280)
    res = trainer.fit(model, dataset=_tokens(), per_device_batch_size=MB, max_steps=STEPS, seq_len=SEQ,
                      global_batch=GB, shares=[1, 3], tokenizer="bytes")
    data = PackedDataset(pack(tokenize_corpus(_tokens(), tokenizer="bytes"), SEQ, min_sequences=GB).tokens, SEQ)
    ref_losses, ref_state = reference_training(initial, trainer, data, STEPS, GB,
                                               lambda m, x: m(input_ids=x, labels=x).loss)
    assert res.shares_history[0] == (0, (1, 3))
    if rebalance_every:
        assert min(s[1] for _, s in res.shares_history) < 3, res.shares_history  # rebalanced mid-run
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert ref_losses[-1] < ref_losses[0] - 0.05  # it learned
    # atol 1e-4: Adam's normalisation of ~0 gradient elements (see test_parallel_exact.py)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, ref_state[name], rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def test_executable_caps_search_zero_over_kinds_of_one_device_type():
    """accelerate() and the re-plan search ZeRO over several kinds of one device type, not over device types."""
    from starverse.runtime.cluster import executable_caps

    kinds = [RankSpec(0, "cpu", "cpu", 1), RankSpec(1, "cpu-b", "cpu", 1)]
    assert executable_caps(kinds).zero_stage is None
    gpus = [RankSpec(0, "a100-80gb-sxm", "cuda:0", 1), RankSpec(1, "rtx-4090", "cuda:1", 1)]
    assert (executable_caps(gpus).zero_stage, executable_caps(gpus).offload) == (None, None)
    mixed = [RankSpec(0, "rtx-4090", "cuda:0", 1), RankSpec(1, "tpu-v5e", "xla:0", 1)]
    assert (executable_caps(mixed).zero_stage, executable_caps(mixed).offload) == (0, "none")
