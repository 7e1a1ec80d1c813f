"""scripts/deepspeed_schedule.py replays DeepSpeed 0.3's TrainSchedule with blocking exchanges; these checks pin
what docs/costmodel.md says of it (AMP, V100 + T4): without sends it is the 1F1B composition the cost model uses
when the slowest stage is the last, an upper bound elsewhere, and a middle stage pays four exchanges per
micro-batch."""

from __future__ import annotations

import runpy
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script() -> SimpleNamespace:
    return SimpleNamespace(**runpy.run_path(str(ROOT / "scripts/deepspeed_schedule.py")))


@pytest.mark.parametrize(("p", "m"), [(2, 1), (3, 5), (4, 8), (5, 2), (8, 32)])
def test_every_stage_runs_each_micro_batch_once_and_uniform_stages_are_1f1b(p, m):
    ds = _script()
    for s in range(p):
        ops = [op for op, _ in ds.stage_program(m, p, s)]
        assert ops.count("F") == ops.count("B") == m
        assert ops.count("recv_act") == ops.count("send_grad") == (m if s > 0 else 0)
        assert ops.count("send_act") == ops.count("recv_grad") == (m if s < p - 1 else 0)
    assert ds.replay([1.0] * p, [2.0] * p, [0.0] * p, [0.0] * p, m) == pytest.approx((m + p - 1) * 3.0)


def test_a_slow_last_stage_sets_the_pace_and_the_composition_bounds_the_others():
    ds = _script()
    m, p = 8, 4
    composed = m * 6.0 + (p - 1) * 3.0  # m x slowest stage + fill/drain through the others
    for slow in range(p):
        fwd, bwd = [1.0] * p, [2.0] * p
        fwd[slow], bwd[slow] = 2.0, 4.0
        t = ds.replay(fwd, bwd, [0.0] * p, [0.0] * p, m)
        assert t == pytest.approx(composed) if slow == p - 1 else t < composed


def test_blocking_exchanges_cost_a_middle_stage_four_per_micro_batch():
    ds = _script()
    m, p, c = 8, 4, 0.5
    t = ds.replay([1.0] * p, [2.0] * p, [c] * p, [c] * p, m)
    # steady state: recv + send of activations and of gradients on both hops, not the 2(m + p - 1) sends
    # the cost model composes
    assert t == pytest.approx(m * (3.0 + 4 * c) + (p - 1) * 3.0)
    assert t > (m + p - 1) * 3.0 + 2 * (m + p - 1) * c
