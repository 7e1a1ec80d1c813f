"""In-place recovery (torchft) when a replica is a pipeline: 2 replicas x 2 stages on 4 CPU ranks.

SIGKILL one stage rank mid-step: the launcher stops its replica's other stage (no orphan; typed as a replica
loss, not a code error), the other replica redoes the step in flight with the whole global batch and finishes
without a restart; a replacement replica (both of its ranks) joins at a step boundary with the live state of a
peer, stage by stage. Losses and final weights equal one process's on the same global batches (the reference
of ``test_pipeline.py``: plain torch, whole model).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_pipeline import EPS, GB, MB, SEQ, _blocks, _plan, _reference, _state

from helpers import ramp_tokens
from starverse.checkpoint.callback import CheckpointCallback
from starverse.elastic.inplace import InplaceLauncher
from starverse.errors import LossCause
from starverse.plan import Group, Stage
from starverse.runtime.cluster import Cluster, local_plan
from starverse.runtime.data import PackedDataset
from starverse.runtime.ft import INPLACE_LOG
from starverse.runtime.launch import RankSpec
from starverse.runtime.trainer import Trainer, _recovery_for, inplace_refusal
from starverse.testing import KillReplicaMidStep, WaitForReplicas

pytest.importorskip("torchft", reason="recovery: in-place needs torchft (the train extra)")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

STEPS = 6
PLAN = _plan([Group(replicas=2, stages=[Stage(accelerator="cpu", layers=2), Stage(accelerator="cpu", layers=2)])],
             "gpipe")


def _fit(tmp_path, launcher, callbacks, eval_fraction=0.0):
    """The in-place run, checked against one process on the same global batches (and, with ``eval_fraction``,
    the held-out loss the leader replica scored through its pipeline against the reference model's)."""
    model = _blocks()
    initial = _state(torch.nn.Sequential(*model))
    data = PackedDataset(np.concatenate([t.numpy() for t in ramp_tokens()]).astype(np.int32), SEQ)
    held_out = None
    if eval_fraction:
        data, held_out = data.split(math.ceil(len(data) * eval_fraction))
    ref_losses, ref_state = _reference(torch.nn.Sequential(*model), steps=STEPS, data=data)
    ranks = tuple(RankSpec(r, "cpu", "cpu", num_threads=1) for r in range(4))
    trainer = Trainer(Cluster(plan=PLAN, ranks=ranks), run_dir=tmp_path, lr=2e-2, adam_eps=EPS, warmup_steps=2, grad_clip=0.5,
                      weight_decay=0.1, timeout_s=180, collective_timeout_s=30, recovery="in-place",
                      launcher=launcher, callbacks=list(callbacks), progress=False, tensorboard=False,
                      eval_fraction=eval_fraction)
    res = trainer.fit(model, dataset=ramp_tokens(), per_device_batch_size=MB, max_steps=STEPS, seq_len=SEQ,
                      global_batch=GB)
    state = _state(torch.nn.Sequential(*model))
    assert any((state[k] - initial[k]).abs().max() > 1e-3 for k in state)  # it trained
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(ref_losses))
    _assert_close(state, ref_state)
    if held_out is not None:
        ref = torch.nn.Sequential(*_blocks())
        ref.load_state_dict(ref_state)
        x = torch.from_numpy(held_out.batch(np.arange(len(held_out)))).long()
        with torch.no_grad():
            logits = ref(x)
        want = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
        assert res.eval_loss == pytest.approx(float(want), rel=1e-4)
    return res, ref_state


def _assert_close(state, ref_state):
    for name, value in state.items():  # fp32, gradients summed in another order than one batch: as test_pipeline
        torch.testing.assert_close(value, ref_state[name], rtol=1e-5, atol=5e-5, msg=name)


def test_pipelined_plans_run_in_place_and_the_rest_falls_back_to_restart_with_one_line(caplog):
    assert inplace_refusal(PLAN) is None and _recovery_for("in-place", PLAN) == "in-place"
    interleaved = _plan(PLAN.groups, "interleaved", 2)
    assert inplace_refusal(interleaved) == "interleaved virtual stages"
    cut_apart = _plan([Group(stages=[Stage(accelerator="cpu", layers=1), Stage(accelerator="cpu", layers=3)]),
                       Group(stages=[Stage(accelerator="cpu", layers=3), Stage(accelerator="cpu", layers=1)])])
    assert inplace_refusal(cut_apart) == "replicas whose pipelines cut the layers differently"
    recomputed = PLAN.model_copy(update={"train": PLAN.train.model_copy(update={"recompute": "full"})})
    assert inplace_refusal(recomputed) == "recompute full inside a pipelined replica"  # run by restart only
    with caplog.at_level("WARNING", logger="starverse.runtime.recovery"):
        assert _recovery_for("in-place", interleaved) == "restart"
    assert [r.getMessage() for r in caplog.records if "checkpoint-restart" in r.getMessage()] == [
        "recovery: in-place recovers replicas of one rank, one pipeline or one ZeRO group each; this plan "
        "(2 replica(s) of 2 cpu) has "
        "interleaved virtual stages, so it runs with checkpoint-restart"]


def test_a_lost_stage_rank_loses_its_replica_the_other_takes_over_exact_and_its_checkpoint_resumes(tmp_path):
    """Replica 0 (the leader) loses its last stage mid-step: the launcher stops its first stage, replica 1 takes
    the whole global batch and the callbacks, and writes the final checkpoint from its two stages (a 2-rank DCP
    checkpoint); one plain rank resumes it with the weights of single-process training."""
    launcher, run_dir, ckpt = InplaceLauncher(), tmp_path / "pp", tmp_path / "ckpt"
    res, ref_state = _fit(run_dir, launcher, [KillReplicaMidStep(replica=1, step=3),  # rank 1: replica 0, stage 1
                                              CheckpointCallback(ckpt, interval_steps=100, async_save=False)],
                          eval_fraction=0.2)  # the new leader scores the held-out split through its pipeline
    assert [(x.error.rank, x.error.cause) for x in launcher.losses] == [(1, LossCause.SIGNAL), (0, LossCause.REPLICA)]
    assert res.steps == STEPS
    sizes = [len(s) for _, s in res.shares_history]
    assert sizes[0] == 2 and sizes[-1] == 1, res.shares_history
    assert res.shares_history[-1][1] == (GB // MB,)  # the survivor took the whole global batch
    events = [json.loads(line) for line in (run_dir / INPLACE_LOG).read_text().splitlines()]
    assert [e["lost"] for e in events if e["event"] == "members"] == [[0]], events
    survivors = [s for s in res.pipeline.stages if s.replica == 1]  # the pipeline report: the survivor's stages
    assert [s.rank for s in survivors] == [2, 3]
    assert all(s.time_per_micro_batch_s > 0 and s.state_bytes > 0 for s in survivors), survivors

    model = _blocks()
    ranks = (RankSpec(0, "cpu", "cpu", num_threads=1),)
    trainer = Trainer(Cluster(plan=local_plan(ranks, "tiny", 1, SEQ, GB, precision="fp32"), ranks=ranks),
                      run_dir=tmp_path / "dp", callbacks=[CheckpointCallback(tmp_path / "dp" / "ckpt", final_save=False)],
                      timeout_s=120, progress=False, tensorboard=False, eval_fraction=0.2)  # the same split
    res = trainer.fit(model, dataset=ramp_tokens(), per_device_batch_size=MB, max_steps=STEPS, seq_len=SEQ,
                      global_batch=GB, resume_from=ckpt)
    assert res.steps == STEPS  # resumed at the last step: nothing left to train
    _assert_close(_state(torch.nn.Sequential(*model)), ref_state)


def test_a_replacement_replica_joins_stage_by_stage_with_the_live_state(tmp_path):
    """Replica 1 loses its last stage (rank 3); its replacement (ranks 2 and 3, new processes) heals from replica 0
    stage by stage and trains the rest of the run; the math stays exact (checked in ``_fit``)."""
    launcher = InplaceLauncher(replace_after_s=0.0)
    res, _ = _fit(tmp_path, launcher, [KillReplicaMidStep(replica=3, step=2),
                                       WaitForReplicas(replicas=2, after_step=2, pause_s=0.5)])
    assert [x.error.rank for x in launcher.losses] == [3, 2]
    assert [(j.rank, j.warm) for j in launcher.joins] == [(2, False), (3, False)]
    sizes = [len(s) for _, s in res.shares_history]
    assert sizes[0] == 2 and sizes[-1] == 2, res.shares_history  # (a fast replacement may be in the redo quorum)
    assert res.ranks[2].tokens > 0 and res.ranks[3].tokens > 0  # the replacement's ranks trained
    events = [json.loads(line) for line in (tmp_path / INPLACE_LOG).read_text().splitlines()]
    assert [e["replica"] for e in events if e["event"] == "healed"] == [1], events  # once, from its first stage
