"""Trace-driven simulation of spot plans: the simulator against the exact exponential model, the traces
against the elastic package's own reading of them, and the planner's spot factor against the simulation on
every bundled trace."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from starverse.catalog import load_catalog
from starverse.elastic.interval import young_daly_interval_s
from starverse.elastic.traces import load_trace
from starverse.errors import ConfigError
from starverse.planner import job_from_dict, pool_from_dict, search
from starverse.planner.simulate import SimJob, Trace, load_trace_events, simulate
from starverse.planner.spotcheck import TOLERANCE, simulate_plan

ROOT = Path(__file__).resolve().parents[2]
TRACES = sorted(str(p.relative_to(ROOT / "data/traces")) for p in (ROOT / "data/traces").rglob("*")
                if p.suffix in (".csv", ".json"))


@pytest.fixture(scope="module")
def catalog():
    return load_catalog(profile="")


def test_all_bundled_traces_found():
    assert len(TRACES) == 8  # 2 Bamboo CSV + 6 "Can't Be Late" JSON


@pytest.mark.parametrize("name", TRACES)
def test_trace_events_agree_with_the_elastic_reading(name):
    """Loss events read here (with replacement delays) give the same rates as elastic.traces' statistics."""
    ours = load_trace_events(ROOT / "data/traces" / name)
    theirs = load_trace(ROOT / "data/traces" / name)
    assert ours.removals_per_node_hour == pytest.approx(theirs.removals_per_node_hour, rel=1e-9)
    assert len(ours.event_s) == theirs.events and ours.lost.sum() == theirs.removals
    assert ours.mean_nodes == pytest.approx(theirs.mean_nodes, rel=1e-9)
    assert (ours.delay_s >= 0).all() and (ours.delay_s <= ours.duration_s).all()


def test_simulator_matches_the_exact_exponential_model():
    """Independent losses (Poisson, every loss hits the job), replaced at once: the expected wall time of
    checkpoint/restart has a closed form (Daly 2006, eq. 20): T/W = M e^(R/M) (e^((τ+C)/M) - 1) / τ."""
    rng = np.random.default_rng(7)
    m, c, r, n = 3600.0, 60.0, 300.0, 8
    duration = 60 * 86_400.0
    ev = np.cumsum(rng.exponential(m, size=int(duration / m * 1.3)))
    ev = ev[ev < duration]
    trace = Trace("poisson", duration, ev, np.ones(ev.size), np.full(ev.size, float(n)), np.zeros(ev.size),
                  n * duration / 3600.0)
    tau = young_daly_interval_s(c, m)
    job = SimJob(work_s=24 * 3600.0, num_devices=n, checkpoint_s=c, interval_s=tau, restart_s=r, step_s=5.0,
                 price_per_hour=2.0)
    res = simulate(job, [(trace, n)], runs=600, seed=1)
    exact = m * math.exp(r / m) * (math.exp((tau + c) / m) - 1.0) / tau
    assert float(np.mean(res.wall_s)) / job.work_s == pytest.approx(exact, rel=0.02)
    assert res.cost == pytest.approx(res.wall_s / 3600.0 * 2.0)
    # in place, survivors go on: only the step in flight is redone
    inplace = simulate(job, [(trace, n)], policy="in-place", runs=200, seed=1)
    assert inplace.factor_p50 < res.factor_p50 and (inplace.redone_s <= res.redone_s.max()).all()
    assert float(np.median(inplace.redone_s)) < 0.1 * float(np.median(res.redone_s))


def test_correlated_losses_hit_a_small_job_less_often():
    """One event takes 4 of 8 nodes: a job holding 1 node is hit with probability 1/2, one holding 8 always."""
    from starverse.planner.simulate import _hit_probability

    p = _hit_probability(np.array([4.0, 1.0, 8.0]), np.array([8.0, 8.0, 8.0]), 1.0)
    assert p == pytest.approx([0.5, 1 / 8, 1.0])
    assert _hit_probability(np.array([1.0]), np.array([4.0]), 2.0) == pytest.approx([0.5])
    assert _hit_probability(np.array([2.0]), np.array([4.0]), 2.0) == pytest.approx([1 - 1 / 6])


@pytest.mark.parametrize("name", TRACES)
def test_planner_spot_factor_agrees_with_simulation_on_every_trace(name, catalog):
    """The planner's reported spot factor is within 10 % of an independent simulation of its chosen plan
    (more jobs, another seed); its Young/Daly figure is kept only where it was within 10 % already."""
    pool = pool_from_dict({"offers": [{"accelerator": "rtx-4090", "count": 16, "pricing": "spot",
                                       "price_per_hour": 0.69, "spot_price_per_hour": 0.34, "host_memory_gb": 512,
                                       "trace": str(ROOT / "data/traces" / name)}]}, catalog)
    job = job_from_dict({"model": "llama-1b", "train": {"seq_len": 2048, "global_batch": 64, "tokens": 2e9},
                         "objective": "throughput"})
    best = search(job, pool, catalog, top=1).best
    assert best.spot_factor_simulated is not None
    sim = simulate_plan(best.plan, load_trace_events(ROOT / "data/traces" / name), catalog=catalog, runs=2000,
                        seed=5)
    assert sim.formula == pytest.approx(best.spot_factor_formula, rel=1e-9)  # the same plan, rate and costs
    assert best.spot_factor == pytest.approx(sim.result.factor_p50, rel=TOLERANCE)
    if abs(best.spot_factor_formula / best.spot_factor_simulated - 1) <= TOLERANCE:
        assert best.spot_factor == best.spot_factor_formula
    else:
        assert best.spot_factor == best.spot_factor_simulated
        assert any("the trace-driven simulation" in n and "(used)" in n for n in best.notes)



def test_bad_trace_is_one_line(tmp_path):
    bad = tmp_path / "t.csv"
    bad.write_text("0,add,node1\nsoon,remove,node1\n")
    with pytest.raises(ConfigError, match=r"t\.csv: malformed trace"):
        load_trace_events(bad)
    with pytest.raises(ConfigError, match=r"nope\.json: trace file not found"):
        load_trace_events(tmp_path / "nope.json")
    with pytest.raises(ConfigError, match=r"offers\[0\]\.trace: .*nope\.json: trace file not found"):
        pool_from_dict({"offers": [{"accelerator": "t4", "count": 1, "pricing": "spot", "spot_price_per_hour": 0.1,
                                    "trace": str(tmp_path / "nope.json")}]})


def test_simulated_figure_replaces_the_formula_beyond_ten_percent():
    """checked_factor keeps Young/Daly within 10 % of the simulated median and takes the median beyond."""
    from starverse.planner.spotcheck import checked_factor, sim_job

    trace = load_trace_events(ROOT / "data/traces/bamboo/p3-trace.csv")
    job = sim_job(work_s=8 * 3600.0, num_devices=8, interruptions_per_hour=8 * trace.removals_per_node_hour,
                  checkpoint_s=20.0, restart_s=300.0, step_s=2.0, price_per_hour=3.0)
    sim = checked_factor(1.0, job, [(trace, 8)], runs=400)[0].simulated
    assert sim is not None and sim > 1.0
    near, _ = checked_factor(sim * 1.09, job, [(trace, 8)], runs=400)
    far, result = checked_factor(sim * 1.2, job, [(trace, 8)], runs=400)
    assert (near.factor, near.source) == (sim * 1.09, "young-daly")
    assert (far.factor, far.source) == (sim, "simulated") and result is not None
    assert checked_factor(2.0, job, None)[0].factor == 2.0  # no trace: the formula


def test_a_plan_that_never_finishes_on_the_trace_gets_an_infinite_factor_not_an_error():
    """checked_factor (the planner's check of each spot candidate) reads the simulator's InfeasiblePlanError as
    an infinite factor, so the search drops that candidate instead of stopping (rank_plan: non-finite -> None)."""
    from starverse.errors import InfeasiblePlanError
    from starverse.planner.spotcheck import checked_factor, sim_job

    trace = load_trace_events(ROOT / "data/traces/bamboo/p3-trace.csv")
    job = sim_job(work_s=8 * 3600.0, num_devices=8, interruptions_per_hour=8 * trace.removals_per_node_hour,
                  checkpoint_s=20.0, restart_s=3.0e8, step_s=2.0, price_per_hour=3.0)
    with pytest.raises(InfeasiblePlanError):
        simulate(job, [(trace, 8)], runs=50, seed=0)
    checked, result = checked_factor(1.5, job, [(trace, 8)], runs=50)
    assert checked.factor == math.inf and checked.simulated == math.inf and result is None
    assert checked.formula == 1.5
