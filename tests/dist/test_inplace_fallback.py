"""A plan in-place recovery does not run (here: an interleaved pipeline) falls back to checkpoint-restart: it must
then train as one job over all its ranks (one ``torch.distributed`` world), not as replicas of the in-place
launcher that never meet. Losses and weights equal one process's on the same global batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_pipeline import EPS, MB, SEQ, _blocks, _plan, _reference, _state

from helpers import ramp_tokens
from starverse.elastic.inplace import InplaceLauncher
from starverse.plan import Group, Stage
from starverse.runtime.cluster import Cluster
from starverse.runtime.data import PackedDataset
from starverse.runtime.launch import RankSpec
from starverse.runtime.trainer import Trainer, inplace_refusal

pytest.importorskip("torchft", reason="recovery: in-place needs torchft (the train extra)")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

STEPS, GB = 3, 8


def test_a_refused_plan_under_the_inplace_launcher_trains_as_one_job(tmp_path):
    plan = _plan([Group(replicas=1, stages=[Stage(accelerator="cpu", layers=2), Stage(accelerator="cpu", layers=2)])],
                 "interleaved", 2)
    assert inplace_refusal(plan) is not None
    model = _blocks()
    data = PackedDataset(np.concatenate([t.numpy() for t in ramp_tokens()]).astype(np.int32), SEQ)
    ref_losses, ref_state = _reference(torch.nn.Sequential(*model), steps=STEPS, data=data)
    ranks = tuple(RankSpec(r, "cpu", "cpu", num_threads=1) for r in range(2))
    trainer = Trainer(Cluster(plan=plan, ranks=ranks), run_dir=tmp_path, lr=2e-2, adam_eps=EPS, warmup_steps=2, grad_clip=0.5,
                      weight_decay=0.1, timeout_s=180, collective_timeout_s=30, recovery="in-place",
                      launcher=InplaceLauncher(), progress=False, tensorboard=False)
    res = trainer.fit(model, dataset=ramp_tokens(), per_device_batch_size=MB, max_steps=STEPS, seq_len=SEQ,
                      global_batch=GB)
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(ref_losses))
    state = _state(torch.nn.Sequential(*model))
    for k in ref_state:
        torch.testing.assert_close(state[k], ref_state[k], rtol=1e-4, atol=1e-5)
