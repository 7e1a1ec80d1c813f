"""In-stage parallelism inside pipeline stages is exact: recompute, tensor parallel (TP x PP), ZeRO (PP x ZeRO) and
chat data with masked labels, K steps of a pipeline equal one process on the same global batches (fp32).

The reference is the plain single-process loop of ``test_pipeline`` (whole model, AdamW, warm-up + cosine,
clipping, next-token cross-entropy), written independently of the trainer's step code.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_pipeline import (
    GB,
    SEQ,
    _assert_same,
    _blocks,
    _fit,
    _llama,
    _plan,
    _reference,
    _state,
)

from helpers import TINY
from starverse.errors import ConfigError
from starverse.plan import Group, Stage
from starverse.runtime.data import pack, tokenize_corpus
from starverse.runtime.lora import apply_lora
from starverse.runtime.modeling import build_model
from starverse.runtime.parallel.pipeline_weights import skeleton, unchanged_weights_folder


def _stages(layers: tuple[int, ...], kinds: tuple[str, ...], tp: int = 1) -> list[Stage]:
    return [Stage(accelerator=k, layers=n, tp=tp) for n, k in zip(layers, kinds, strict=True)]


def _plan_with(groups: list[Group], **train: object):
    plan = _plan(groups)
    return plan.model_copy(update={"train": plan.train.model_copy(update=train)})


def test_recompute_of_a_block_list_inside_stages(tmp_path):
    """A user's model given as a list of blocks: each block of a stage is recomputed."""
    model = _blocks()
    initial = _state(model)
    ref_losses, ref_state = _reference(torch.nn.Sequential(*copy.deepcopy(model)))
    plan = _plan_with([Group(stages=_stages((1, 3), ("cpu", "cpu")))], recompute="full")
    res = _fit(tmp_path, model, plan, ["cpu", "cpu"])
    _assert_same(res, model, initial, ref_losses, ref_state)


@pytest.mark.parametrize(("recompute", "sequence_parallel"), [("full", False), ("selective", True)])
def test_tensor_parallel_inside_pipeline_stages_equals_single_process(tmp_path, recompute, sequence_parallel):
    """TP 2 x PP 2: each stage (1:3 layers, two device kinds) is a TP group of two ranks; TP rank t of stage 0
    sends its activation (whole, or its sequence shard under sequence parallel) to TP rank t of stage 1; each
    stage's blocks are recomputed (full, or selective)."""
    model = _llama(4)
    initial = _state(model)
    ref_losses, ref_state = _reference(model)
    plan = _plan_with([Group(stages=_stages((1, 3), ("cpu", "cpu-b"), tp=2))], recompute=recompute,
                      sequence_parallel=sequence_parallel)
    res = _fit(tmp_path, model, plan, ["cpu", "cpu", "cpu-b", "cpu-b"])
    _assert_same(res, model, initial, ref_losses, ref_state)
    # each rank holds half of its stage's split matrices: the stages' state adds up to the whole model's
    report = res.pipeline
    assert report is not None and [s.layers for s in report.stages] == [1, 1, 3, 3]  # per rank


@pytest.mark.parametrize(("zero", "offload", "shares"), [(1, "none", [2, 6]), (3, "optimizer", None)])
def test_zero_inside_pipeline_stages_equals_single_process(tmp_path, zero, offload, shares):
    """PP 2 x ZeRO over two replicas of one group: ZeRO-1 shards each stage's optimizer state over the two ranks
    that hold it (uneven shares); ZeRO-3 + offload shards the parameters with FSDP2 (lockstep)."""
    model = _llama(4)
    initial = _state(model)
    ref_losses, ref_state = _reference(model)
    plan = _plan_with([Group(replicas=2, stages=_stages((1, 3), ("cpu", "cpu")))], zero_stage=zero,
                      offload=offload)
    res = _fit(tmp_path, model, plan, ["cpu"] * 4, shares=shares, trainer={"rebalance_every": 0})
    _assert_same(res, model, initial, ref_losses, ref_state)


def test_zero1_over_two_groups_with_different_splits_equals_single_process(tmp_path):
    """ZeRO-1 over several groups: group 0 (two replicas, 2:2 layers) shards each stage's optimizer state over its
    two replicas; group 1 (one replica, 1:3 over another kind) holds it whole; every parameter's whole gradient is
    summed over its holders in both groups (uneven shares and a rebalance allowed, as ZeRO-1 is per step)."""
    model = _llama(4)
    initial = _state(model)
    ref_losses, ref_state = _reference(model)
    plan = _plan_with([Group(replicas=2, stages=_stages((2, 2), ("cpu", "cpu"))),
                       Group(stages=_stages((1, 3), ("cpu-b", "cpu-b")))], zero_stage=1)
    res = _fit(tmp_path, model, plan, ["cpu"] * 4 + ["cpu-b"] * 2, shares=[2, 2, 4])
    _assert_same(res, model, initial, ref_losses, ref_state)
    # Adam's two moments of each parameter are held once in group 0 (sharded), by its holder in group 1
    whole = sum(p.numel() * 4 for p in model.parameters())
    stages = res.pipeline.stages if res.pipeline is not None else []
    by_group = [sum(s.state_bytes for s in stages if s.group == g) for g in (0, 1)]
    assert by_group == [2 * 2 * whole + 2 * whole, 4 * whole], (by_group, whole)


def _chat_file(tmp_path) -> Path:
    rows = [{"prompt": f"say {i} twice", "response": f"{i} {i} and {i * 7 % 13}"} for i in range(24)]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_masked_labels_through_a_pipeline_equal_single_process(tmp_path):
    """Chat data (loss on the responses only) through PP 2 over two kinds, 8 micro-batches with different label
    counts: the last stage sums each micro-batch's loss over its labelled tokens, divided by the global batch's."""
    model = build_model({**TINY, "num_hidden_layers": 2, "max_position_embeddings": 64}, seed=0)
    initial = _state(model)
    chat = _chat_file(tmp_path)
    data = pack(tokenize_corpus(chat, tokenizer="bytes"), SEQ, min_sequences=GB)
    assert data.labels is not None and (data.labels == -100).any()
    ref_losses, ref_state = _reference(model, data=data)
    plan = _plan_with([Group(stages=_stages((1, 1), ("cpu", "cpu-b")))])
    res = _fit(tmp_path / "run", model, plan, ["cpu", "cpu-b"], dataset=chat, tokenizer="bytes")
    _assert_same(res, model, initial, ref_losses, ref_state)


def test_lora_through_a_pipeline_equals_single_process(tmp_path):
    """LoRA adapters on the stages' linears (PP 2, 1:3): only the adapters train, exactly as in one process."""
    model = _llama(4)
    apply_lora(model, 4)
    initial = _state(model)
    ref_losses, ref_state = _reference(model)
    plan = _plan_with([Group(stages=_stages((1, 3), ("cpu", "cpu-b")))], mode="lora", lora_rank=4)
    res = _fit(tmp_path, model, plan, ["cpu", "cpu-b"])
    _assert_adapters_same(res, model, initial, ref_losses, ref_state)


def _assert_adapters_same(res, model, initial, ref_losses, ref_state) -> None:
    """Same losses and weights as the reference, and only adapters moved (lora_B of the row-wise o_proj too)."""
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(ref_losses))
    state = _state(model)
    moved = {k for k, v in state.items() if not torch.equal(v, initial[k])}
    assert moved and all(".lora_B" in k or ".lora_A" in k for k in moved), sorted(moved)[:5]
    assert any("o_proj.lora_B" in k for k in moved)
    for name, value in state.items():
        torch.testing.assert_close(value, ref_state[name], rtol=1e-5, atol=5e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_pipeline_refuses_in_stage_settings_it_cannot_run(tmp_path):
    model = _llama(4)
    two = ["cpu", "cpu", "cpu", "cpu"]
    mixed = Group(stages=[Stage(accelerator="cpu", layers=1, tp=2), Stage(accelerator="cpu", layers=3, tp=1)])
    with pytest.raises(ConfigError, match=r"stages have tp \[1, 2\]: tensor parallelism inside pipeline stages "
                                          r"needs the same tp in every stage"):
        _fit(tmp_path / "a", model, _plan_with([mixed]), ["cpu"] * 3)
    sp = _plan_with([Group(stages=_stages((1, 3), ("cpu", "cpu"), tp=2))], sequence_parallel=True)
    with pytest.raises(ConfigError, match=r"sequence_parallel with pipeline stages splits the 15-token sequences "
                                          r"between the stages' 2 TP ranks"):
        _fit(tmp_path / "b", model, sp, two, seq_len=15)
    groups = [Group(stages=_stages((1, 3), ("cpu", "cpu"))), Group(stages=_stages((3, 1), ("cpu", "cpu")))]
    with pytest.raises(ConfigError, match=r"zero_stage: 2 \(offload: none\) with pipeline stages over 2 groups whose "
                                          r"pipelines split the layers differently is not run: FSDP2 reduce-scatters"):
        _fit(tmp_path / "c", model, _plan_with(groups, zero_stage=2), two)
    z3 = _plan_with([Group(replicas=2, stages=_stages((1, 3), ("cpu", "cpu")))], zero_stage=3)
    with pytest.raises(ConfigError, match=r"zero_stage: 3 gathers each block per micro-batch"):
        _fit(tmp_path / "d", model, z3, two, shares=[2, 6], trainer={"rebalance_every": 0})


def test_masked_reference_is_sensitive():
    """Scoring every token instead of the labelled ones changes the loss (the labelled test can fail)."""
    model = _llama(2)
    x = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(0))
    logits = model(x).logits
    labels = x.clone()
    labels[:, : SEQ // 2] = -100
    all_tokens = F.cross_entropy(logits[:, :-1].reshape(-1, 64), x[:, 1:].reshape(-1))
    masked = F.cross_entropy(logits[:, :-1].reshape(-1, 64), labels[:, 1:].reshape(-1), ignore_index=-100)
    assert abs(float(all_tokens - masked)) > 1e-4


def test_each_stage_loads_only_its_tensors_from_the_folder(tmp_path):
    """A model built from a save_pretrained folder: each pipeline rank reads its own stage's tensors from the
    safetensors (stage 0: embedding + 1 layer, stage 1: 3 layers + final norm + head), and training is exact."""
    folder = tmp_path / "tiny"
    _llama(4).save_pretrained(folder)
    model = build_model(folder)
    initial = _state(model)
    assert unchanged_weights_folder(model) == folder
    ref_losses, ref_state = _reference(model)
    plan = _plan_with([Group(stages=_stages((1, 3), ("cpu", "cpu-b")))])
    res = _fit(tmp_path / "run", model, plan, ["cpu", "cpu-b"])
    _assert_same(res, model, initial, ref_losses, ref_state)
    assert res.pipeline is not None
    per_layer = 9  # q, k, v, o, gate, up, down, two norms
    assert [s.loaded_tensors for s in res.pipeline.stages] == [1 + per_layer, 3 * per_layer + 2]


def test_a_model_changed_after_loading_is_not_read_again_from_its_folder(tmp_path):
    folder = tmp_path / "tiny"
    _llama(2).save_pretrained(folder)
    model = build_model(folder)
    assert unchanged_weights_folder(model) == folder
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] += 1.0
    assert unchanged_weights_folder(model) is None  # ranks then load the whole (changed) model
    assert unchanged_weights_folder(_llama(2)) is None  # built from a config: no folder
    shell = skeleton(build_model(folder), folder)
    assert all(p.is_meta for p in shell.parameters())



def test_lora_with_tensor_parallel_inside_pipeline_stages_equals_single_process(tmp_path):
    """LoRA x TP 2 x PP 2 with sequence parallel: the stages' adapted linears are split with their adapters
    (column-wise: lora_B split; row-wise: lora_A split, lora_B whole and cut to the rank's part of the sequence),
    only the adapters train, exactly as in one process."""
    model = _llama(4)
    apply_lora(model, 4)
    initial = _state(model)
    ref_losses, ref_state = _reference(model)
    plan = _plan_with([Group(stages=_stages((1, 3), ("cpu", "cpu-b"), tp=2))], mode="lora", lora_rank=4,
                      sequence_parallel=True)
    res = _fit(tmp_path, model, plan, ["cpu", "cpu", "cpu-b", "cpu-b"])
    _assert_adapters_same(res, model, initial, ref_losses, ref_state)
