"""Pipeline parallelism is exact: K steps of a pipeline (1F1B, GPipe, interleaved) over two device kinds with an
uneven 1:3 layer split, and of two data-parallel groups whose pipelines split the layers differently (with a
rebalance in the middle), give the same losses and weights as one process on the same global batches (fp32).

The reference below is plain PyTorch written for this test: the whole model, AdamW, the warm-up + cosine
factor, clipping, next-token cross-entropy; it shares only the data order (the sampler) with the trainer.
"""

from __future__ import annotations

import copy
import math
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import SEQ, VOCAB
from helpers import ramp_tokens as _tokens
from starverse.plan import Group, Plan, Stage, TrainSpec
from starverse.runtime.callbacks import Callback
from starverse.runtime.cluster import Cluster
from starverse.runtime.data import DeterministicSampler, PackedDataset
from starverse.runtime.launch import RankSpec
from starverse.runtime.modeling import build_model
from starverse.runtime.trainer import Trainer

GB, MB, STEPS, LR, WARMUP, CLIP, WD = 8, 1, 4, 2e-2, 2, 0.5, 0.1
# AdamW's epsilon, reference and runtime alike: with the default 1e-8 an element whose gradient is a near-cancelling
# sum moves by ~lr x (its rounding / 1e-8), so the order of the micro-batch sums (which differs across CPU vector
# widths: AVX2 vs AVX-512) decides its weight; 1e-6 keeps the same math and leaves the comparison to the gradients
EPS = 1e-6


def _llama(layers: int) -> torch.nn.Module:
    cfg = {
        "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": layers,
        "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu",
    }
    return build_model(cfg, seed=0)


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(32)
        self.fc = torch.nn.Linear(32, 32)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.fc(self.norm(h)))


def _blocks() -> list[torch.nn.Module]:
    """A user's model as a list of blocks: embedding, two residual blocks, head (4 layers)."""
    torch.manual_seed(0)
    return [torch.nn.Embedding(VOCAB, 32), _Block(), _Block(), torch.nn.Sequential(torch.nn.LayerNorm(32),
                                                                                    torch.nn.Linear(32, VOCAB))]


def _logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out.logits if hasattr(out, "logits") else out


def _reference(
    model: torch.nn.Module, steps: int = STEPS, data: PackedDataset | None = None
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the whole global batch per step, plain torch. ``data`` with labels (chat): the loss is over
    the labelled next tokens only."""
    model = copy.deepcopy(model)
    model.train()
    if data is None:
        data = PackedDataset(np.concatenate([t.numpy() for t in _tokens()]).astype(np.int32), SEQ)
    sampler = DeterministicSampler(len(data), seed=0)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), eps=EPS, foreach=False)

    def factor(step: int) -> float:
        if step < WARMUP:
            return (step + 1) / WARMUP
        progress = min(1.0, (step - WARMUP) / max(1, steps - WARMUP))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    losses = []
    for _ in range(steps):
        idx = sampler.next_indices(GB)
        x = torch.from_numpy(data.batch(idx)).long()
        labels = data.batch_labels(idx)
        y = x if labels is None else torch.from_numpy(labels)
        logits = _logits(model, x)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), y[:, 1:].reshape(-1), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), CLIP)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _fit(tmp_path, model, plan: Plan, kinds: list[str], steps: int = STEPS, **kw):
    ranks = tuple(RankSpec(r, k, "cpu", num_threads=1) for r, k in enumerate(kinds))
    trainer = Trainer(Cluster(plan=plan, ranks=ranks), run_dir=tmp_path, lr=LR, adam_eps=EPS, warmup_steps=WARMUP, grad_clip=CLIP,
                      weight_decay=WD, timeout_s=240, **kw.pop("trainer", {}))
    return trainer.fit(model, dataset=kw.pop("dataset", _tokens()), per_device_batch_size=MB, max_steps=steps,
                       seq_len=kw.pop("seq_len", SEQ),
                       global_batch=GB, **kw)


def _plan(groups: list[Group], schedule: str = "1f1b", virtual_stages: int = 1) -> Plan:
    train = TrainSpec(seq_len=SEQ, global_batch=GB, precision="fp32", schedule=schedule,  # type: ignore[arg-type]
                      virtual_stages=virtual_stages)
    return Plan(model="tiny", train=train, groups=groups)


def _state(model) -> dict[str, torch.Tensor]:
    m = model if isinstance(model, torch.nn.Module) else torch.nn.Sequential(*model)
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _assert_same(res, model, initial, ref_losses, ref_state) -> None:
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(ref_losses))
    state = _state(model)
    # it trained: every weight matrix moved, so two untouched models are not what is compared
    for name, value in state.items():
        if value.dim() >= 2:
            assert (value - initial[name]).abs().max() > 1e-3, name
        # fp32: the pipeline sums micro-batch gradients in another order than one batch does (EPS above)
        torch.testing.assert_close(value, ref_state[name], rtol=1e-5, atol=5e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize(
    ("schedule", "layers", "virtual"),
    [("1f1b", (1, 3), 1), ("gpipe", (1, 3), 1), ("interleaved", (2, 6), 2)],
)
def test_two_stage_pipeline_over_two_kinds_equals_single_process(tmp_path, schedule, layers, virtual):
    model = _llama(sum(layers))
    initial = _state(model)
    ref_losses, ref_state = _reference(model)
    plan = _plan([Group(stages=[Stage(accelerator="cpu", layers=layers[0]),
                                Stage(accelerator="cpu-b", layers=layers[1])])], schedule, virtual)
    res = _fit(tmp_path, model, plan, ["cpu", "cpu-b"])
    assert res.steps == STEPS and res.tokens_total == STEPS * GB * SEQ
    _assert_same(res, model, initial, ref_losses, ref_state)
    assert [r.device_kind for r in res.ranks] == ["cpu", "cpu-b"]
    report = res.pipeline
    assert report is not None and [(s.stage, s.layers) for s in report.stages] == [(0, layers[0]), (1, layers[1])]
    assert all(s.time_per_micro_batch_s > 0 and s.state_bytes > 0 for s in report.stages)
    assert 0.0 <= report.bubble < 1.0
    # each stage holds its layers' state only: the 3-layer stage more than the 1-layer one (embedding aside)
    whole = sum(p.numel() * 4 for p in model.parameters())
    assert sum(s.state_bytes for s in report.stages) == 4 * whole  # params + grads + two Adam moments


class SleepyRank(Callback):
    """Rank ``rank`` takes ``seconds`` longer per micro-batch forward/backward: well above scheduling noise."""

    def __init__(self, rank: int, seconds: float):
        self.rank, self.seconds = rank, seconds

    def on_micro_batch_end(self, ctx, compute_s):
        if ctx.rank == self.rank:
            time.sleep(self.seconds)


def test_two_groups_with_different_splits_and_a_rebalance_equal_single_process(tmp_path):
    """Group 0 splits the blocks 1:3 over cpu ranks, group 1 splits them 3:1 over cpu-b ranks: every block's
    gradient is summed over the two ranks that hold it; group 1's stage is slowed, so shares move to group 0."""
    model = _blocks()
    initial = _state(model)
    ref_losses, ref_state = _reference(torch.nn.Sequential(*copy.deepcopy(model)), steps=6)
    plan = _plan([
        Group(stages=[Stage(accelerator="cpu", layers=1), Stage(accelerator="cpu", layers=3)]),
        Group(stages=[Stage(accelerator="cpu-b", layers=3), Stage(accelerator="cpu-b", layers=1)]),
    ])
    res = _fit(tmp_path, model, plan, ["cpu", "cpu", "cpu-b", "cpu-b"], steps=6, shares=[3, 5],
               trainer={"callbacks": [SleepyRank(3, 0.05)], "rebalance_every": 2, "hysteresis": 0.05})
    assert res.shares_history[0] == (0, (3, 5))
    assert len(res.shares_history) >= 2, res.shares_history
    assert min(s[1] for _, s in res.shares_history) < 5, res.shares_history
    assert all(sum(s) == GB // MB and min(s) >= 2 for _, s in res.shares_history)  # 1F1B: >= stages each
    _assert_same(res, model, initial, ref_losses, ref_state)
    assert ref_losses[-1] < ref_losses[0] - 0.1  # and the loss fell


def test_pipeline_split_wrong_would_be_caught():
    """The reference is sensitive: dropping one layer's gradient sum (a parameter updated from one replica's
    half of the batch) changes the step."""
    model = _llama(2)
    x = torch.from_numpy(PackedDataset(np.concatenate([t.numpy() for t in _tokens()]).astype(np.int32), SEQ)
                         .batch(np.arange(GB))).long()
    logits = _logits(model, x)
    full = torch.autograd.grad(F.cross_entropy(logits[:, :-1].reshape(-1, 64), x[:, 1:].reshape(-1)),
                               model.model.layers[0].mlp.up_proj.weight)[0]
    half_logits = _logits(model, x[:4])
    half = torch.autograd.grad(F.cross_entropy(half_logits[:, :-1].reshape(-1, 64), x[:4, 1:].reshape(-1)) * 0.5,
                               model.model.layers[0].mlp.up_proj.weight)[0]
    assert (full - half).abs().max() > 1e-4
