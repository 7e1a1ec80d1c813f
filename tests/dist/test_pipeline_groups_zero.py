"""Pipelines over several groups: ZeRO-2 (FSDP2) over groups that split the layers alike, and a custom loss_fn.

The reference is the plain single-process loop of ``test_pipeline`` (whole model, AdamW, warm-up + cosine,
clipping), written independently of the trainer's step code.
"""

from __future__ import annotations

import pytest
import torch
from test_pipeline import _assert_same, _fit, _llama, _plan, _reference, _state

from starverse.errors import ConfigError
from starverse.plan import Group, Stage


def _stages(layers: tuple[int, ...], kinds: tuple[str, ...]) -> list[Stage]:
    return [Stage(accelerator=k, layers=n) for n, k in zip(layers, kinds, strict=True)]


def _plan_with(groups: list[Group], **train: object):
    plan = _plan(groups)
    return plan.model_copy(update={"train": plan.train.model_copy(update=train)})


def test_zero2_over_two_groups_split_alike_equals_single_process(tmp_path):
    """Two groups of two device kinds, each a 1:3 pipeline: one FSDP2 mesh per stage spans both groups' replicas
    (gloo), shares 1:3 of the global batch (ZeRO-2 reduce-scatters once per step in a pipeline)."""
    model = _llama(4)
    initial = _state(model)
    ref_losses, ref_state = _reference(model)
    plan = _plan_with([Group(stages=_stages((1, 3), ("cpu", "cpu"))),
                       Group(stages=_stages((1, 3), ("cpu-b", "cpu-b")))], zero_stage=2)
    res = _fit(tmp_path, model, plan, ["cpu", "cpu", "cpu-b", "cpu-b"], shares=[2, 6])
    _assert_same(res, model, initial, ref_losses, ref_state)
    # each stage's parameters are sharded over the two groups' replicas: the state adds up to the whole model's
    whole = sum(p.numel() * 4 for p in model.parameters())
    stages = res.pipeline.stages if res.pipeline is not None else []
    assert sum(s.state_bytes for s in stages) == pytest.approx(4 * whole, rel=0.02), (stages, whole)


def test_zero2_over_groups_split_differently_is_refused(tmp_path):
    plan = _plan_with([Group(stages=_stages((1, 3), ("cpu", "cpu"))),
                       Group(stages=_stages((2, 2), ("cpu-b", "cpu-b")))], zero_stage=2)
    with pytest.raises(ConfigError, match=r"groups whose pipelines split the layers differently is not run"):
        _fit(tmp_path, _llama(4), plan, ["cpu", "cpu", "cpu-b", "cpu-b"])
