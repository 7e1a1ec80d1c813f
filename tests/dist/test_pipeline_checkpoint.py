"""Checkpoints across layouts: a DCP checkpoint written by a 2-stage pipeline (1:3 layers over two device kinds)
loads bit-exactly, weights and AdamW state, under a 3-stage pipeline with another split and under plain data
parallelism over 2 ranks. Keys are the unsplit model's parameter names, whatever the layout."""

from __future__ import annotations

import torch

from helpers import SEQ
from helpers import ramp_tokens as _tokens
from starverse.checkpoint.callback import CheckpointCallback
from starverse.plan import Group, Plan, Stage, TrainSpec
from starverse.runtime.callbacks import Callback
from starverse.runtime.cluster import Cluster
from starverse.runtime.launch import RankSpec
from starverse.runtime.modeling import build_model
from starverse.runtime.trainer import Trainer

GB, STEPS = 8, 3


class DumpState(Callback):
    """Test facility: each rank writes its parameters and AdamW state by unsplit name (at fit start or end)."""

    def __init__(self, when: str):
        self.when = when

    def _dump(self, ctx) -> None:
        names = {id(p): n for n, p in ctx.model.named_parameters()}
        out = {}
        for p in ctx.model.parameters():
            state = ctx.optimizer.state.get(p, {})
            out[names[id(p)]] = {"param": p.detach().clone(),
                                 **{k: v.detach().clone() for k, v in state.items() if torch.is_tensor(v)}}
        torch.save(out, ctx.run_dir / f"dump-{self.when}-{ctx.rank}.pt")

    def on_fit_start(self, ctx) -> None:
        if self.when == "start":
            self._dump(ctx)

    def on_fit_end(self, ctx) -> None:
        if self.when == "end":
            self._dump(ctx)


def _merged(run_dir, when: str, world: int) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {}
    for r in range(world):
        for name, entry in torch.load(run_dir / f"dump-{when}-{r}.pt").items():
            if name in out:  # held by two ranks (data-parallel replicas): identical
                for k, v in entry.items():
                    assert torch.equal(out[name][k], v), (name, k)
            out[name] = entry
    return out


def _model() -> torch.nn.Module:
    return build_model({
        "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu",
    }, seed=0)


def _run(run_dir, groups: list[Group], kinds: list[str], callbacks: list[Callback], resume=None):
    plan = Plan(model="tiny", train=TrainSpec(seq_len=SEQ, global_batch=GB, precision="fp32"), groups=groups)
    ranks = tuple(RankSpec(r, k, "cpu", num_threads=1) for r, k in enumerate(kinds))
    trainer = Trainer(Cluster(plan=plan, ranks=ranks), callbacks=callbacks, run_dir=run_dir, lr=2e-2, warmup_steps=1,
                      timeout_s=240)
    return trainer.fit(_model(), dataset=_tokens(), per_device_batch_size=1, max_steps=STEPS, seq_len=SEQ,
                       global_batch=GB, resume_from=resume)


def test_pipeline_checkpoint_loads_bit_exactly_under_other_layouts(tmp_path):
    saved = tmp_path / "pp2"
    pp2 = [Group(stages=[Stage(accelerator="cpu", layers=1), Stage(accelerator="cpu-b", layers=3)])]
    res = _run(saved, pp2, ["cpu", "cpu-b"],
               [CheckpointCallback(saved / "ckpt", interval_steps=100, async_save=False), DumpState("end")])
    assert res.steps == STEPS
    want = _merged(saved, "end", 2)
    assert set(want) == {n for n, _ in _model().named_parameters()}
    assert all(set(e) == {"param", "exp_avg", "exp_avg_sq", "step"} for e in want.values())

    layouts = {
        "pp3": ([Group(stages=[Stage(accelerator="cpu", layers=1), Stage(accelerator="cpu", layers=1),
                               Stage(accelerator="cpu", layers=2)])], ["cpu"] * 3),
        "dp2": ([Group(replicas=2, stages=[Stage(accelerator="cpu", layers=4)])], ["cpu"] * 2),
    }
    for name, (groups, kinds) in layouts.items():
        run_dir = tmp_path / name
        res = _run(run_dir, groups, kinds,
                   [CheckpointCallback(run_dir / "ckpt", final_save=False), DumpState("start")], resume=saved / "ckpt")
        assert res.steps == STEPS  # resumed at the last step: nothing left to train
        got = _merged(run_dir, "start", len(kinds))
        assert set(got) == set(want), name
        for param, entry in want.items():
            for k, v in entry.items():
                assert torch.equal(got[param][k], v), (name, param, k)


class DumpFullState(DumpState):
    """As :class:`DumpState`, with tensor-parallel shards gathered whole (a collective over each TP group)."""

    def _dump(self, ctx) -> None:
        from torch.distributed.tensor import DTensor

        def whole(t):
            return t.full_tensor() if isinstance(t, DTensor) else t

        out = {}
        for name, p in ctx.model.named_parameters():
            state = ctx.optimizer.state.get(p, {})
            out[name] = {"param": whole(p.detach()).clone(),
                         **{k: whole(v.detach()).clone() for k, v in state.items() if torch.is_tensor(v)}}
        torch.save(out, ctx.run_dir / f"dump-{self.when}-{ctx.rank}.pt")


def test_tensor_parallel_pipeline_checkpoint_loads_under_data_parallelism(tmp_path):
    """PP 2 x TP 2 (1:3 layers, 4 ranks) writes DTensor shards; DP 2 loads them whole, bit-exactly."""
    saved = tmp_path / "pp2tp2"
    pp2tp2 = [Group(stages=[Stage(accelerator="cpu", layers=1, tp=2), Stage(accelerator="cpu", layers=3, tp=2)])]
    _run(saved, pp2tp2, ["cpu"] * 4,
         [CheckpointCallback(saved / "ckpt", interval_steps=100, async_save=False), DumpFullState("end")])
    want = _merged(saved, "end", 4)
    assert set(want) == {n for n, _ in _model().named_parameters()}
    run_dir = tmp_path / "dp2"
    dp2 = [Group(replicas=2, stages=[Stage(accelerator="cpu", layers=4)])]
    res = _run(run_dir, dp2, ["cpu"] * 2, [CheckpointCallback(run_dir / "ckpt", final_save=False), DumpState("start")],
               resume=saved / "ckpt")
    assert res.steps == STEPS
    got = _merged(run_dir, "start", 2)
    for param, entry in want.items():
        for k, v in entry.items():
            assert torch.equal(got[param][k], v), (param, k)
