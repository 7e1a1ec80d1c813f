"""The mixed mesh: groups by device kind, and the gloo bridge between kinds sums exactly like one all-reduce."""

from __future__ import annotations

import pytest

from starverse.runtime.launch import RankSpec, launch
from starverse.runtime.mesh import MeshLayout


def _reduce(env, n):
    import torch

    from starverse.runtime.mesh import MixedMesh

    mesh = MixedMesh.build([r.device_kind for r in env.ranks])
    # Distinct per-rank values, so a missing or doubled contribution changes the sum.
    t = torch.arange(n, dtype=torch.float32) * (10 ** env.rank) + env.rank
    mesh.all_reduce(t)
    u = torch.full((3,), float(env.rank + 1))
    mesh.all_reduce_async(u).wait()
    return t.tolist(), u.tolist(), mesh.my_kind.kind, mesh.my_kind.leader, mesh.bridge_group is not None


@pytest.mark.parametrize("kinds", [["cpu-a", "cpu-a", "cpu-b"], ["cpu-a", "cpu-b", "cpu-a", "cpu-b"]])
def test_bridge_all_reduce_equals_flat_sum(kinds):
    n = 5
    out = launch(_reduce, [RankSpec(r, k, "cpu", num_threads=1) for r, k in enumerate(kinds)], timeout_s=120, args=(n,))
    world = len(kinds)
    want = [sum(i * 10**r + r for r in range(world)) for i in range(n)]
    want_u = [float(sum(range(1, world + 1)))] * 3
    for r, (t, u, kind, leader, is_bridge) in enumerate(out):
        assert t == want
        assert u == want_u
        assert kind == kinds[r]
        assert leader == kinds.index(kinds[r])
        assert is_bridge == (r == leader)


def test_layout_groups_by_kind_and_picks_native_backends():
    layout = MeshLayout.from_ranks(["h100", "rtx-4090", "h100", "cpu"], ["cuda:0", "cuda:1", "cuda:2", "cpu"])
    assert [(g.kind, g.ranks, g.backend, g.leader) for g in layout.kinds] == [
        ("h100", (0, 2), "nccl", 0), ("rtx-4090", (1,), "nccl", 1), ("cpu", (3,), "gloo", 3),
    ]
    assert layout.is_mixed
    assert layout.describe() == (
        "h100: ranks 0,2 (nccl) | rtx-4090: rank 1 (nccl) | cpu: rank 3 (gloo) | bridge: gloo between leaders"
    )
    single = MeshLayout.from_ranks(["cpu", "cpu"])
    assert not single.is_mixed and single.describe() == "cpu: ranks 0,1 (gloo)"
