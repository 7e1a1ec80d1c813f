"""Pipelines over several groups: ZeRO-2 (FSDP2) over groups that split the layers alike, and a custom loss_fn.

The reference is the plain single-process loop of ``test_pipeline`` (whole model, AdamW, warm-up + cosine,
clipping), written independently of the trainer's step code.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_pipeline import CLIP, EPS, GB, LR, WARMUP, WD, _assert_same, _fit, _llama, _plan, _reference, _state

from helpers import SEQ, reference_training
from helpers import ramp_tokens as _tokens
from starverse.errors import ConfigError
from starverse.plan import Group, Stage
from starverse.runtime.data import PackedDataset

STEPS = 2  # the second step uses Adam's state; fewer processes' seconds than test_pipeline's 4


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
    ref_losses, ref_state = _reference(model, steps=STEPS)
    plan = _plan_with([Group(stages=_stages((1, 3), ("cpu", "cpu"))),
                       Group(stages=_stages((1, 3), ("cpu-b", "cpu-b")))], zero_stage=2)
    res = _fit(tmp_path, model, plan, ["cpu", "cpu", "cpu-b", "cpu-b"], STEPS, shares=[2, 6])
    _assert_same(res, model, initial, ref_losses, ref_state)
    # each stage's parameters are sharded over the two groups' replicas: the state adds up to the whole model's
    whole = sum(p.numel() * 4 for p in model.parameters())
    stages = res.pipeline.stages if res.pipeline is not None else []
    assert sum(s.state_bytes for s in stages) == pytest.approx(4 * whole, rel=0.02), (stages, whole)


def smoothed_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A user's loss: next-token cross-entropy plus a z-loss (PaLM's), both means over the micro-batch's tokens."""
    logits = logits[:, :-1].float()
    return (F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))
            + 0.01 * logits.logsumexp(-1).pow(2).mean())


def test_custom_loss_fn_through_a_pipeline_equals_single_process(tmp_path):
    """PP 2 (1:3 layers, two device kinds): the last stage computes the user's loss_fn(logits, labels) per
    micro-batch, weighted by the micro-batch's share of the global batch; the reference trains the whole model on
    the whole batch with the same loss (plain cross-entropy would give other losses: the check can fail)."""
    model = _llama(4)
    initial = _state(model)
    data = PackedDataset(np.concatenate([t.numpy() for t in _tokens()]).astype(np.int32), SEQ)
    settings = SimpleNamespace(seed=0, lr=LR, adam_eps=EPS, weight_decay=WD, warmup_steps=WARMUP, min_lr_ratio=0.1,
                               grad_clip=CLIP)
    ref_losses, ref_state = reference_training(model, settings, data, STEPS, GB,
                                               lambda m, x: smoothed_loss(m(input_ids=x).logits, x))
    plain, _ = _reference(model, steps=1)
    assert abs(plain[0] - ref_losses[0]) > 0.1  # the custom loss is not the built-in one
    plan = _plan_with([Group(stages=_stages((1, 3), ("cpu", "cpu-b")))])
    res = _fit(tmp_path, model, plan, ["cpu", "cpu-b"], STEPS, loss_fn=smoothed_loss)
    _assert_same(res, model, initial, ref_losses, ref_state)


def test_a_loss_fn_needing_more_than_logits_and_labels_is_refused(tmp_path):
    plan = _plan_with([Group(stages=_stages((1, 3), ("cpu", "cpu-b")))])
    for fn in (lambda logits, labels, mask: logits.sum(), lambda model, input_ids: model(input_ids).loss):
        with pytest.raises(ConfigError, match=r"with pipeline stages the last stage calls loss_fn\(logits, labels\)"):
            _fit(tmp_path, _llama(4), plan, ["cpu", "cpu-b"], loss_fn=fn)
