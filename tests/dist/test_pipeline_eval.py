"""Held-out evaluation through pipeline stages equals one process's: the eval loss every N steps and at the end
of a pipelined fit (forward only through each replica's schedule, summed over replicas by labelled tokens) is
the one-process trainer's eval loss on the same held-out sequences, and evaluating does not change training."""

from __future__ import annotations

import json

import pytest
import torch
from test_pipeline import _fit, _llama, _plan
from test_pipeline_parallel import _plan_with, _stages

from starverse.plan import Group, Stage

EVAL = {"eval_fraction": 0.2, "eval_every": 2}  # 8 of the 40 sequences held out; evaluated at steps 2 and 4


def _evals(run_dir) -> list[tuple[int, float, int]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["tokens"]) for r in rows if r.get("event") == "eval"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The one-process trainer (whole model, one rank) on the same data: its losses and held-out evaluations."""
    run = tmp_path_factory.mktemp("one")
    res = _fit(run, _llama(4), _plan([Group(stages=[Stage(accelerator="cpu", layers=4)])]), ["cpu"], trainer=EVAL)
    return res, _evals(run)


@pytest.mark.parametrize("case", ["two-groups", "zero-replicas", "interleaved", "tp-sp"])
def test_eval_through_pipelines_equals_one_process(tmp_path, one_process, case):
    """Two groups whose pipelines split the layers 1:3 and 3:1 over two device kinds (4 held-out sequences
    each), two replicas of one group whose stages are sharded together (ZeRO-2: the replicas' forwards
    gather in step), one interleaved pipeline (two chunks per rank), or TP 2 with sequence parallel inside the
    stages (each TP rank's pipeline runs the held-out sequences; the last stage's TP rank 0 counts them)."""
    ref, ref_evals = one_process
    if case == "two-groups":
        plan = _plan([Group(stages=_stages((1, 3), ("cpu", "cpu-b"))), Group(stages=_stages((3, 1), ("cpu-b", "cpu")))])
        kinds = ["cpu", "cpu-b", "cpu-b", "cpu"]
    elif case == "tp-sp":
        plan = _plan_with([Group(stages=_stages((1, 3), ("cpu", "cpu-b"), tp=2))], sequence_parallel=True)
        kinds = ["cpu", "cpu", "cpu-b", "cpu-b"]
    elif case == "interleaved":
        plan = _plan([Group(stages=_stages((2, 2), ("cpu", "cpu-b")))], "interleaved", 2)
        kinds = ["cpu", "cpu-b"]
    else:
        plan = _plan_with([Group(replicas=2, stages=_stages((1, 3), ("cpu", "cpu")))], zero_stage=2)
        kinds = ["cpu"] * 4
    model = _llama(4)
    res = _fit(tmp_path, model, plan, kinds, trainer={**EVAL, "rebalance_every": 0})
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(ref.losses))  # evaluating left training alone
    evals = _evals(tmp_path)
    assert [(s, n) for s, _, n in evals] == [(s, n) for s, _, n in ref_evals] == [(2, 8 * 15), (4, 8 * 15)]
    torch.testing.assert_close(torch.tensor([v for _, v, _ in evals]), torch.tensor([v for _, v, _ in ref_evals]))
    assert res.eval_loss == pytest.approx(ref.eval_loss, rel=1e-5) and ref.eval_loss < ref_evals[0][1]

