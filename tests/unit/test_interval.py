"""Checkpoint interval (Young/Daly) and interruption rates from the real spot traces in data/traces/."""

from __future__ import annotations

import math

import pytest

from starverse.elastic.interval import choose_interval, job_mtbf_s, young_daly_interval_s
from starverse.elastic.traces import load_trace
from starverse.errors import ConfigError


def test_young_first_order_and_daly_correction():
    # C << M: Daly's form converges to Young's sqrt(2CM).
    assert young_daly_interval_s(1.0, 1e6) == pytest.approx(math.sqrt(2e6), rel=1e-3)
    # Daly 2006 eq. 37 at C=60 s, M=3600 s: sqrt(2CM)·(1 + sqrt(r)/3 + r/9) − C with r = C/2M.
    r = 60 / 7200
    assert young_daly_interval_s(60, 3600) == pytest.approx(math.sqrt(2 * 60 * 3600) * (1 + math.sqrt(r) / 3 + r / 9) - 60)
    # A save costing more than 2·MTBF: checkpoint once per MTBF.
    assert young_daly_interval_s(8000, 3600) == 3600
    assert young_daly_interval_s(5, math.inf) == math.inf


def test_job_mtbf_from_per_device_rates():
    assert job_mtbf_s([0.1] * 16 + [0.2] * 3) == pytest.approx(3600 / 2.2)
    assert job_mtbf_s([0.0, 0.0]) == math.inf
    with pytest.raises(ConfigError, match="interruption rates must be >= 0"):
        job_mtbf_s([0.1, -1])


def test_choose_interval_states_its_reason_and_bounds():
    c = choose_interval(step_time_s=2.0, save_cost_s=0.5, write_s=6.0, mtbf_s=750.0)
    # sqrt(2·0.5·750) ≈ 27.7 s (Daly: 27.5) -> 14 steps of 2 s
    assert c.steps == 14 and c.interval_s == 28.0
    assert "Young/Daly" in c.reason and "C=0.5 s" in c.reason and "MTBF=12.5 min" in c.reason
    # Saves faster than the write time are impossible with one save in flight: raised to W.
    slow_disk = choose_interval(step_time_s=1.0, save_cost_s=0.01, write_s=30.0, mtbf_s=600.0)
    assert slow_disk.steps == 30 and "raised to the write time" in slow_disk.reason
    # No interruption rate (on-demand): bounded by the cap.
    od = choose_interval(step_time_s=10.0, save_cost_s=1.0, write_s=5.0, mtbf_s=math.inf, max_interval_s=1800)
    assert od.steps == 180 and "capped at 30 min" in od.reason and "unknown" in od.reason
    user = choose_interval(step_time_s=3.0, save_cost_s=1.0, write_s=2.0, mtbf_s=100.0, override_steps=7)
    assert user.steps == 7 and "set by the job file" in user.reason
    with pytest.raises(ConfigError, match=r"checkpoint interval must be >= 1 step \(got 0\)"):
        choose_interval(step_time_s=3.0, save_cost_s=1.0, write_s=2.0, mtbf_s=100.0, override_steps=0)


def test_the_chosen_interval_minimises_the_expected_waste():
    c = choose_interval(step_time_s=1.0, save_cost_s=2.0, write_s=1.0, mtbf_s=3600.0)
    best = c.expected_waste_fraction(1.0)
    for other in (c.steps // 2, c.steps * 2):
        alt = choose_interval(step_time_s=1.0, save_cost_s=2.0, write_s=1.0, mtbf_s=3600.0, override_steps=other)
        alt = type(c)(steps=alt.steps, interval_s=alt.interval_s, reason="", save_cost_s=2.0, write_s=1.0, mtbf_s=3600.0)
        assert alt.expected_waste_fraction(1.0) > best


def test_bamboo_p3_trace_rates(repo_root):
    s = load_trace(repo_root / "data/traces/bamboo/p3-trace.csv")
    # data/traces/README.md: 11.37 h, peak 32 nodes, mean about 24, 167 removals at 79 distinct times, up to 6.
    assert s.duration_h == pytest.approx(11.37, abs=0.01)
    assert (s.peak_nodes, s.removals, s.events, s.max_nodes_per_event) == (32, 167, 79, 6)
    assert s.mean_nodes == pytest.approx(24, abs=0.5)
    assert s.removals_per_node_hour == pytest.approx(167 / s.node_hours)
    # A cluster-level interruption about every 8.6 minutes.
    assert 60 / s.events_per_hour == pytest.approx(8.6, abs=0.1)
    # Correlated losses: a 24-node job is hit ~2.1x less often than independent failures would predict,
    # but each hit takes ~2.1 nodes.
    independent = job_mtbf_s([s.removals_per_node_hour] * 24)
    assert s.job_mtbf_s(24) / independent == pytest.approx(s.mean_nodes_per_event, rel=0.02)
    assert s.mean_nodes_per_event == pytest.approx(167 / 79)


def test_count_trace_and_malformed_traces(repo_root, tmp_path):
    s = load_trace(repo_root / "data/traces/spot-traces/preemption/4-node/aws-08-03-2023/us-east-2a_v100_1.json")
    assert s.peak_nodes == 4 and s.events > 0 and s.removals >= s.events
    assert s.duration_h == pytest.approx((5131 - 1) * 300 / 3600)
    tiny = tmp_path / "t.json"
    tiny.write_text('{"metadata": {"gap_seconds": 60}, "data": [4, 4, 2, 2, 3, 1]}')
    t = load_trace(tiny)
    assert (t.removals, t.events, t.max_nodes_per_event) == (4, 2, 2)
    assert t.node_hours == pytest.approx((4 + 4 + 2 + 2 + 3) * 60 / 3600)
    bad = tmp_path / "bad.csv"
    bad.write_text("0,add,node1\n10,vanish,node1\n")
    with pytest.raises(ConfigError, match=r"bad.csv:2: expected 'milliseconds,add\|remove,node', got '10,vanish,node1'"):
        load_trace(bad)
    (tmp_path / "b.json").write_text('{"data": [1]}')
    with pytest.raises(ConfigError, match="malformed trace"):
        load_trace(tmp_path / "b.json")
    with pytest.raises(ConfigError, match="trace file not found"):
        load_trace(tmp_path / "missing.csv")
