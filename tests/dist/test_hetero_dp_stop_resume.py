"""Stopping, resuming and losing a rank in Trainer.fit (real processes)."""

from __future__ import annotations

import copy

import pytest
import torch
from test_hetero_dp import GB, MB, SEQ, TinyLM, _cluster, _tokens

from starverse.errors import DistributedError
from starverse.runtime.callbacks import Callback
from starverse.runtime.trainer import Trainer
from starverse.testing import KillRank


class StopAndSave(Callback):
    """Rank 1 asks to stop after step ``at``; rank 0 saves the context state at the stop."""

    def __init__(self, at: int, path):
        self.at, self.path, self.events = at, path, []

    def on_step_end(self, ctx):
        if ctx.rank == 1 and ctx.step == self.at:
            ctx.request_stop("test stop")

    def on_fit_end(self, ctx):
        if ctx.rank == 0:
            torch.save(ctx.state_dict(), self.path)


def _fit(tmp_path, tag, callbacks=(), steps=6, resume_from=None, model=None):
    trainer = Trainer(_cluster(["cpu", "cpu"]), callbacks=list(callbacks), run_dir=tmp_path / tag, lr=2e-2,
                      warmup_steps=2, grad_clip=0.5, rebalance_every=0, timeout_s=240)
    return trainer.fit(model, dataset=_tokens(), per_device_batch_size=MB, max_steps=steps, seq_len=SEQ,
                       global_batch=GB, shares=[3, 5], resume_from=resume_from)


def test_stop_request_on_one_rank_stops_all_and_resume_continues_exactly(tmp_path):
    torch.manual_seed(1)
    m0 = TinyLM()
    full_model = copy.deepcopy(m0)
    full = _fit(tmp_path, "full", model=full_model)

    state = tmp_path / "state.pt"
    part_model = copy.deepcopy(m0)
    part = _fit(tmp_path, "part", [StopAndSave(3, state)], model=part_model)
    assert part.steps == 3 and part.stop_reason == "stop requested by another rank"  # rank 0's view
    assert part.losses == full.losses[:3]

    resumed_model = copy.deepcopy(m0)  # weights come from the state file, not from here
    rest = _fit(tmp_path, "rest", resume_from=state, model=resumed_model)
    assert rest.steps == 6 and rest.tokens_total == full.tokens_total
    torch.testing.assert_close(torch.tensor(rest.losses), torch.tensor(full.losses[3:]))
    for k, v in full_model.state_dict().items():
        torch.testing.assert_close(resumed_model.state_dict()[k], v, msg=k)


def test_a_killed_rank_fails_the_fit_with_its_name(tmp_path):
    with pytest.raises(DistributedError, match=r"rank 1 \(cpu, cpu\) killed by signal SIGKILL"):
        _fit(tmp_path, "kill", [KillRank(1, 2)], model=TinyLM())
