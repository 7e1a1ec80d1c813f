"""In-place recovery (torchft): a SIGKILLed replica does not stop the job, the math stays exact."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from helpers import SEQ, TinyLM, reference_training
from helpers import ramp_tokens as _tokens
from starverse.elastic.inplace import InplaceLauncher
from starverse.runtime.cluster import Cluster, local_plan
from starverse.runtime.data import PackedDataset
from starverse.runtime.ft import INPLACE_LOG
from starverse.runtime.launch import RankSpec
from starverse.runtime.steps import batch_loss
from starverse.runtime.trainer import Trainer
from starverse.testing import KillReplicaMidStep, WaitForReplicas

MB, GB, STEPS = 2, 12, 12
SHORT = 6


def _cluster(kinds: tuple[str, ...]) -> Cluster:
    ranks = tuple(RankSpec(r, k, "cpu", num_threads=1) for r, k in enumerate(kinds))
    return Cluster(plan=local_plan(ranks, "tiny", 1, SEQ, GB, precision="fp32"), ranks=ranks)


def _fit(tmp_path, launcher, callbacks=(), steps=STEPS, kinds=("cpu", "cpu", "cpu")):
    torch.manual_seed(0)
    model = TinyLM()
    initial = copy.deepcopy(model)
    trainer = Trainer(_cluster(kinds), callbacks=list(callbacks), run_dir=tmp_path, lr=2e-2, warmup_steps=2,
                      grad_clip=0.5, timeout_s=120, collective_timeout_s=30, recovery="in-place", launcher=launcher,
                      progress=False, tensorboard=False)
    res = trainer.fit(model, dataset=_tokens(), per_device_batch_size=MB, max_steps=steps, seq_len=SEQ,
                      global_batch=GB)
    tokens = np.concatenate([t.numpy() for t in _tokens()]).astype(np.int32)
    ref_losses, ref_state = reference_training(initial, trainer, PackedDataset(tokens, SEQ), steps, GB, batch_loss)
    return res, model, ref_losses, ref_state


def test_sigkill_mid_step_survivors_finish_exact(tmp_path):
    launcher = InplaceLauncher()
    res, model, ref_losses, ref_state = _fit(tmp_path, launcher, [KillReplicaMidStep(replica=1, step=3)], SHORT)
    assert [loss.error.rank for loss in launcher.losses] == [1]
    last = res.shares_history[-1][1]
    assert res.steps == SHORT and len(last) == 2 and sum(last) == GB // MB  # the lost share redistributed
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(ref_losses))
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, ref_state[name], msg=name)


@pytest.mark.parametrize(("warm", "kinds"), [(True, ("cpu-b", "cpu", "cpu")), (False, ("cpu", "cpu", "cpu"))],
                         ids=["warm-spare-two-kinds", "new-process"])
def test_a_replacement_joins_with_the_live_state_and_the_math_stays_exact(tmp_path, warm, kinds):
    """Replica 0 (the leader) killed; its replacement: the warm spare of its device kind (a job of two kinds keeps
    one spare per kind), or a new process."""
    launcher = InplaceLauncher(replace_after_s=0.0, warm_spares=warm)
    res, model, ref_losses, ref_state = _fit(
        tmp_path, launcher, [KillReplicaMidStep(replica=0, step=2), WaitForReplicas(replicas=3, after_step=2, pause_s=1.0)],
        kinds=kinds)
    assert [loss.error.rank for loss in launcher.losses] == [0]
    assert [(j.rank, j.device_kind, j.warm) for j in launcher.joins] == [(0, kinds[0], warm)]
    # one spare per kind at the start, and the next one of the activated spare's kind once it joined
    assert launcher.spares == (["cpu-b", "cpu", "cpu-b"] if warm else []), launcher.spares
    # membership: 3 replicas, then 2 (the leader, replica 0, lost), then 3 again (its replacement joined); a
    # warm spare activated at the loss, or a new process from a warm fork server, may already be in the quorum
    # that redoes the step in flight (no 2 then)
    sizes = [len(s) for _, s in res.shares_history]
    assert sizes[0] == 3 and sizes[-1] == 3, res.shares_history
    back = sizes.index(3, sizes.index(2)) if 2 in sizes else 0
    assert set(sizes[back:]) == {3}, res.shares_history  # once joined, every quorum holds all three
    assert res.ranks[0].tokens > 0  # the replacement trained (its own result, not the lost process's)
    assert res.steps == STEPS
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(ref_losses))  # its history came along
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, ref_state[name], msg=name)
    events = [json.loads(line) for line in (tmp_path / INPLACE_LOG).read_text().splitlines()]
    assert [e["replica"] for e in events if e["event"] == "healed"] == [0], events  # live state from a peer
    if 2 in sizes:
        assert [e.get("lost") for e in events if e["event"] == "members"][:2] == [[0], []], events
