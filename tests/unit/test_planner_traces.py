"""Spot interruption rates used by the planner come from the real traces in data/traces."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from starverse.elastic.traces import load_trace
from starverse.planner.policy import spot_factor

ROOT = Path(__file__).resolve().parents[2]


def test_example_rate_is_the_bamboo_p3_rate():
    stats = load_trace(ROOT / "data/traces/bamboo/p3-trace.csv")
    pool = yaml.safe_load((ROOT / "examples/scenario1-mixed-70b/pool-mixed-spot.yaml").read_text())
    rates = {o["interruptions_per_hour"] for o in pool["offers"]}
    assert rates == {round(stats.removals_per_node_hour, 2)} == {0.61}


@pytest.mark.parametrize("trace", ["bamboo/p3-trace.csv", "bamboo/g4dn-trace.csv"])
def test_independent_losses_overcharge_correlated_traces(trace):
    """Counting every removal as its own interruption (the planner's conservative rule) charges more
    overhead than the trace's distinct events would: losses come in bursts."""
    s = load_trace(ROOT / "data/traces" / trace)
    assert s.mean_nodes_per_event > 1.3
    nodes = round(s.mean_nodes)
    independent = nodes * s.removals_per_node_hour
    measured = s.events_per_hour * min(1.0, nodes / s.mean_nodes)
    assert independent > measured
    f_ind = float(spot_factor(independent, 60.0, 300.0))
    f_meas = float(spot_factor(measured, 60.0, 300.0))
    assert f_ind > f_meas > 1.0
