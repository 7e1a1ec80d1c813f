"""Training refuses to continue on a non-finite loss (issue 15): a typed error at the step it happens, on every
rank alike (no hang), and no checkpoint of that step or of NaN weights.

A learning rate of 1e30 is finite (the job file accepts it) but sends the weights to ~1e30 after the first
step, so the second step's loss overflows.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import TINY
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from starverse.cli import main


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_nonfinite_loss_stops_training_without_checkpointing_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "tiny.json").write_text(json.dumps(TINY))
    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 80)
    (tmp_path / "train.yaml").write_text(
        "model: tiny.json\ndataset: a.txt\nrun_dir: run\ndevices: {cpu_ranks: 2}\n"
        "train: {steps: 6, seq_len: 16, global_batch: 4, micro_batch: 2, lr: 1.0e+30}\n"
        "checkpoint: {interval_steps: 1, keep_last: 10, async_save: false}\nmetrics: {enabled: false}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("STARVERSE_PROFILE", "")
    code = main(["train", "train.yaml"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.splitlines()[-1].startswith("error: step 2: the loss is not finite"), err
    assert "Traceback" not in err

    code = main(["checkpoints", "list", "run", "--json", "--verify"])
    listed = json.loads(capsys.readouterr().out)["checkpoints"]
    assert code == 0
    assert [c["step"] for c in listed] == [1]  # nothing of the step that diverged
    assert listed[0]["status"] == "ok" and math.isfinite(listed[0]["loss"])
    dcp_to_torch_save(tmp_path / "run/checkpoints/step-1", tmp_path / "step1.pt")
    state = torch.load(tmp_path / "step1.pt", weights_only=False)
    tensors = [t for t in _tensors(state) if t.is_floating_point()]
    assert tensors and all(torch.isfinite(t).all() for t in tensors)


def _tensors(x: object) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    if isinstance(x, list | tuple):
        return [t for v in x for t in _tensors(v)]
    return []
