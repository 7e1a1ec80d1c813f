"""Bad plan files: one line on stderr naming file and field, exit code 2 (through the CLI's main)."""

from __future__ import annotations

from pathlib import Path

import pytest

from starverse.cli import main

GOOD = """model: llama-2-70b
train: {seq_len: 4096, global_batch: 64, recompute: full, zero_stage: 1}
groups:
- replicas: 2
  stages:
  - {accelerator: a100-80gb-sxm, tp: 8, layers: 40, repeat: 2}
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("model: llama-2-70b\ntrain: {seq_len: 4096, global_batch: 64\ngroups: []\n",
         "plan.yaml:3: malformed YAML"),
        (GOOD.replace("global_batch", "globl_batch"),
         "plan.yaml:2: train.globl_batch: unknown field; did you mean 'global_batch'?"),
        (GOOD.replace("a100-80gb-sxm", "a100-80gb-sxn"),
         "plan.yaml:6: groups[0].stages[0].accelerator: unknown accelerator 'a100-80gb-sxn'; did you mean"),
        (GOOD.replace("llama-2-70b", "llama-2-7oB"),
         "plan.yaml:1: model: unknown model 'llama-2-7oB'; did you mean 'llama-2-7b'"),
        (GOOD.replace("layers: 40", "layers: 30"),
         "plan.yaml:6: groups[0].stages: layers sum to 60 but model 'llama-2-70b' has 80"),
        (GOOD.replace("tp: 8", "tp: 3"),
         "plan.yaml:6: groups[0].stages[0].tp: 3 does not divide the model's 64 attention heads and 8 KV heads"),
        (GOOD.replace("global_batch: 64", "global_batch: 63"),
         "plan.yaml:2: train.global_batch: 63 sequences cannot be divided into micro-batches over groups[0] "
         "(replicas=2); use a global_batch that is a multiple of 2"),
        (GOOD.replace("replicas: 2", "replicas: 2\n  micro_batch: 5"),
         "(replicas=2 x micro_batch=5); use a global_batch that is a multiple of 10"),
        (GOOD.replace("replicas: 2", "replicas: 0"), "plan.yaml:4: groups[0].replicas: must be greater than 0 (got 0)"),
        (GOOD.replace("tp: 8", "tp: -8"), "plan.yaml:6: groups[0].stages[0].tp: must be greater than 0 (got -8)"),
        (GOOD.replace("seq_len: 4096", "seq_len: 0"), "plan.yaml:2: train.seq_len: must be greater than 0 (got 0)"),
        (GOOD + "pricing: {price_per_hour: {a100-80gb-sxm: -1}}\n",
         "plan.yaml:7: pricing.price_per_hour.a100-80gb-sxm: must be greater than 0 (got -1)"),
    ],
)
def test_bad_plan_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                     text: str, expected: str) -> None:
    monkeypatch.chdir(tmp_path)
    Path("plan.yaml").write_text(text)
    code = main(["estimate", "plan.yaml"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert expected in err


def test_good_plan_estimates(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("plan.yaml").write_text(GOOD)
    assert main(["estimate", "plan.yaml"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "pipeline_bubble" in out and "a100-80gb-sxm" in out
