"""Checkpoints across real gloo ranks: every rank writes part of one DCP checkpoint in the background, and a
checkpoint written by 2 ranks loads on 3 (and back) with every replica holding the same full state."""

from __future__ import annotations

import pytest

from starverse.runtime.launch import RankSpec, launch

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _ranks(n: int) -> list[RankSpec]:
    return [RankSpec(rank=r, device_kind="cpu", device="cpu", num_threads=1) for r in range(n)]


def _setup():
    import torch

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
    return m, torch.optim.AdamW(m.parameters(), lr=0.05)


def _dp_step(m, o, env, step):
    import torch
    import torch.distributed as dist

    # Every rank sees its own slice of the same global batch; gradients are averaged (plain DP).
    g = torch.Generator().manual_seed(step)
    x = torch.randn(6, 8, generator=g)
    part = x.chunk(env.world_size)[env.rank]
    o.zero_grad()
    (m(part).pow(2).sum() / x.shape[0]).backward()
    for p in m.parameters():
        dist.all_reduce(p.grad)
    o.step()


def _train_and_save(env, root):
    import torch.distributed as dist

    from starverse.checkpoint import Checkpointer, CheckpointStore

    group = dist.new_group(backend="gloo")
    m, o = _setup()
    ck = Checkpointer(CheckpointStore(root), rank=env.rank, world_size=env.world_size, group=group)
    for step in range(1, 4):
        _dp_step(m, o, env, step)
        if step == 2:
            snapshot = {k: v.numpy().copy() for k, v in m.state_dict().items()}
            ck.save(step, m, o, extras={"sampler": {"pos": 12}})  # asynchronous; step 3 runs meanwhile
    info = ck.wait()
    ck.close()
    return snapshot, (info.step, info.world_size, info.device_kinds) if info else None


def _load(env, root):
    import torch.distributed as dist

    from starverse.checkpoint import Checkpointer, CheckpointStore

    group = dist.new_group(backend="gloo")
    store = CheckpointStore(root)
    m, o = _setup()
    for p in m.parameters():  # make sure the load, not the seed, is what we compare
        p.data.zero_()
    loaded = Checkpointer(store, rank=env.rank, world_size=env.world_size, group=group).load(store.latest(), m, o)
    # numpy, not tensors: torch shares tensor storage through file descriptors that die with the rank
    return {k: v.numpy().copy() for k, v in m.state_dict().items()}, loaded.extras["sampler"], loaded.resharded


def test_two_ranks_write_one_checkpoint_that_loads_on_three(tmp_path):
    import numpy as np

    out = launch(_train_and_save, _ranks(2), timeout_s=120, args=(str(tmp_path),))
    (snap0, info0), (snap1, info1) = out
    assert info0 == (2, 2, ("cpu", "cpu")) and info1 is None
    for k in snap0:
        assert np.array_equal(snap0[k], snap1[k])
    # DCP spreads the replicated tensors over both writers.
    assert sorted(p.name for p in (tmp_path / "step-2").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert {p.name for p in (tmp_path / "step-2").glob("rng-*.pt")} == {"rng-0.pt", "rng-1.pt"}

    loaded = launch(_load, _ranks(3), timeout_s=120, args=(str(tmp_path),))
    for state, sampler, resharded in loaded:
        assert sampler == {"pos": 12} and resharded
        for k in snap0:
            assert np.array_equal(state[k], snap0[k]), k
