"""Runtime logic without processes: shares and rebalancing, plans vs devices, bad input, scaled models, hooks."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from starverse.errors import ConfigError, ModelError
from starverse.plan import Group, Plan, Stage, TrainSpec
from starverse.providers.local import accelerator_id, cpu_rank_count, local_ranks
from starverse.runtime.callbacks import TrainContext
from starverse.runtime.cluster import Cluster, check_plan_fits_ranks, local_plan
from starverse.runtime.hetero_dp import Rebalancer, balanced_shares, predicted_step_s, proportional_shares
from starverse.runtime.launch import RankSpec
from starverse.runtime.steps import batch_loss, flops_per_token, make_optimizer, make_schedule
from starverse.runtime.trainer import Trainer

CPU2 = (RankSpec(0, "cpu", "cpu", 1), RankSpec(1, "cpu", "cpu", 1))


def test_proportional_shares_round_by_largest_remainder_with_one_each():
    assert proportional_shares(8, [1, 3]) == [2, 6]
    assert proportional_shares(8, [1, 1, 2]) == [2, 2, 4]
    assert proportional_shares(5, [100, 1]) == [4, 1]  # the slow rank still gets its one micro-batch
    assert sum(proportional_shares(17, [0.3, 0.5, 0.2])) == 17
    with pytest.raises(ConfigError, match=r"holds 1 micro-batch\(es\) for 2 ranks; every rank needs at least one"):
        proportional_shares(1, [1, 1])


def test_balanced_shares_minimise_the_slowest_rank():
    assert balanced_shares(16, [1.0, 3.0]) == [12, 4]
    assert predicted_step_s([12, 4], [1.0, 3.0]) == 12.0
    assert balanced_shares(4, [1.0, 1.0, 1.0]) == [2, 1, 1]
    assert balanced_shares(8, [0.5, 1.0, 2.0]) == [5, 2, 1]


def test_rebalancer_waits_for_its_period_and_applies_hysteresis():
    rb = Rebalancer(num_micro=16, every=4, hysteresis=0.1)
    rb.observe([8, 8], [8.0, 8.5])  # ~equal speeds: [8, 8] is already best or nearly
    assert rb.propose(4, [8, 8]) is None
    rb = Rebalancer(num_micro=16, every=4, hysteresis=0.1)
    for _ in range(3):
        rb.observe([8, 8], [8.0, 24.0])  # rank 1 three times slower
    assert rb.propose(3, [8, 8]) is None  # not a rebalance step
    assert rb.propose(4, [8, 8]) == [12, 4]
    assert rb._history == type(rb._history)()  # fresh measurements after a change
    # A 4 % gain is inside the 10 % hysteresis: keep the shares (no oscillation on noise).
    rb.observe([12, 4], [12.0, 12.5])
    assert rb.propose(8, [12, 4]) is None


def test_accelerator_ids_from_device_names():
    assert accelerator_id("NVIDIA H100 80GB HBM3", 85) == "h100-80gb-sxm"
    assert accelerator_id("NVIDIA H100 PCIe", 85) == "h100-80gb-pcie"
    assert accelerator_id("NVIDIA A100-SXM4-40GB", 42) == "a100-40gb-sxm"
    assert accelerator_id("NVIDIA A100-SXM4-80GB", 85) == "a100-80gb-sxm"
    assert accelerator_id("NVIDIA GeForce RTX 4090", 25) == "rtx-4090"
    assert accelerator_id("NVIDIA H200", 150) == "h200-141gb-sxm"
    assert accelerator_id("NVIDIA H100 NVL", 94) == "h100-94gb-nvl"
    assert accelerator_id("NVIDIA A100-PCIE-40GB", 40) == "a100-40gb-pcie"
    assert accelerator_id("NVIDIA A100 80GB PCIe", 80) == "a100-80gb-pcie"
    assert accelerator_id("Weird GPU 9000", 8) == "cuda-weird-gpu-9000"


def test_cpu_rank_count(monkeypatch):
    monkeypatch.delenv("STARVERSE_CPU_RANKS", raising=False)
    assert cpu_rank_count() == 2
    assert cpu_rank_count(3) == 3
    monkeypatch.setenv("STARVERSE_CPU_RANKS", "4")
    assert cpu_rank_count() == 4
    assert [r.device_kind for r in local_ranks(use_gpus=False)] == ["cpu"] * 4
    monkeypatch.setenv("STARVERSE_CPU_RANKS", "x")
    with pytest.raises(ConfigError, match=r"\$STARVERSE_CPU_RANKS must be an integer \(got 'x'\)"):
        cpu_rank_count()
    with pytest.raises(ConfigError, match=r"number of CPU ranks must be >= 1 \(got 0\)"):
        cpu_rank_count(0)


def _plan(groups):
    return Plan(model="m", train=TrainSpec(seq_len=8, global_batch=8), groups=groups)


def test_plan_must_match_the_devices():
    ok = _plan([Group(replicas=2, stages=[Stage(accelerator="cpu", layers=2)])])
    check_plan_fits_ranks(ok, CPU2)
    three = _plan([Group(replicas=3, stages=[Stage(accelerator="cpu", layers=2)])])
    with pytest.raises(ConfigError, match=r"p.yaml: the plan uses 3 devices but the provider has 2 \(2 x cpu\)"):
        check_plan_fits_ranks(three, CPU2, "p.yaml")
    gpu = _plan([Group(replicas=2, stages=[Stage(accelerator="rtx-4090", layers=2)])])
    with pytest.raises(ConfigError, match=r"the plan uses rtx-4090 but the cluster has no such device"):
        check_plan_fits_ranks(gpu, CPU2)
    tp = _plan([Group(replicas=1, stages=[Stage(accelerator="cpu", tp=2, layers=2)])])
    check_plan_fits_ranks(tp, CPU2)  # tensor parallel runs: one group of one kind, one stage
    tp_pp = _plan([Group(replicas=1, stages=[Stage(accelerator="cpu", tp=2, layers=1)] * 2)])
    check_plan_fits_ranks(tp_pp, CPU2 + CPU2, "p.yaml")  # TP inside pipeline stages runs
    pp = _plan([Group(replicas=1, stages=[Stage(accelerator="cpu", layers=1), Stage(accelerator="cpu", layers=1)])])
    check_plan_fits_ranks(pp, CPU2)  # pipelines run


class _NoParams(torch.nn.Module):
    def forward(self, x):
        return x.float().mean()


class _Lin(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 4)
        self.out = torch.nn.Linear(4, 11)

    def forward(self, ids):
        return self.out(self.emb(ids))


def _trainer(tmp_path):
    return Trainer(Cluster(plan=local_plan(CPU2, "m", 1, 8, 8, "fp32"), ranks=CPU2), run_dir=tmp_path)


def test_bad_fit_input_is_one_clear_error_each(tmp_path):
    t = _trainer(tmp_path)
    data = [torch.arange(200) % 11]
    with pytest.raises(ConfigError, match=r"the model \(_NoParams\) has no trainable parameters"):
        t.fit(_NoParams(), dataset=data, per_device_batch_size=2, max_steps=1)
    with pytest.raises(ConfigError, match=r"per_device_batch_size must be > 0 \(got 0\)"):
        t.fit(_Lin(), dataset=data, per_device_batch_size=0, max_steps=1)
    with pytest.raises(ConfigError, match=r"max_steps must be > 0 \(got -1\)"):
        t.fit(_Lin(), dataset=data, per_device_batch_size=2, max_steps=-1)
    with pytest.raises(ConfigError, match=r"dataset '.*missing' does not exist"):
        t.fit(_Lin(), dataset=tmp_path / "missing", per_device_batch_size=2, max_steps=1)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ConfigError, match=r"dataset .*empty.txt is empty"):
        t.fit(_Lin(), dataset=tmp_path / "empty.txt", per_device_batch_size=2, max_steps=1)
    with pytest.raises(ConfigError, match=r"global batch 8 is not a multiple of per_device_batch_size 3"):
        t.fit(_Lin(), dataset=data, per_device_batch_size=3, max_steps=1)
    with pytest.raises(ConfigError, match=r"shares \[1, 2\] must give each of the 2 ranks >= 1 micro-batch and sum to 4"):
        t.fit(_Lin(), dataset=data, per_device_batch_size=2, max_steps=1, shares=[1, 2])
    with pytest.raises(ConfigError, match=r"tokenizer \(pretokenized\) has 300 token ids but the model.s vocabulary has 11"):
        t.fit(_Lin(), dataset=[torch.tensor([299] * 100)], per_device_batch_size=2, max_steps=1)
    with pytest.raises(ConfigError, match=r"lr must be > 0"):
        Trainer(lr=0)


def test_accelerate_rejects_a_plan_for_other_devices(tmp_path, monkeypatch):
    from starverse.runtime.cluster import accelerate

    monkeypatch.delenv("STARVERSE_CPU_RANKS", raising=False)
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(_plan([Group(replicas=4, stages=[Stage(accelerator="cpu", layers=2)])]).to_yaml())
    with pytest.raises(ConfigError, match=r"plan.yaml: the plan uses 4 devices but the provider has 2 \(2 x cpu\)"):
        accelerate(plan=plan_file, use_gpus=False)
    with pytest.raises(ConfigError, match=r"only the local provider is implemented"):
        accelerate(pool="pool.yaml")


def test_scaled_copy_keeps_the_architecture_and_fits():
    from starverse.runtime.modeling import count_params, scale_config

    llama70 = {
        "model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
        "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
    }
    small = scale_config(llama70, 10_000_000)
    assert small["model_type"] == "llama" and small["tie_word_embeddings"] is False
    assert small["num_attention_heads"] // small["num_key_value_heads"] == 8  # GQA ratio kept
    assert small["intermediate_size"] / small["hidden_size"] == pytest.approx(28672 / 8192, rel=0.05)
    assert count_params(small) <= 10_000_000
    assert small["num_hidden_layers"] < 80 and small["vocab_size"] == 8192
    gpt2 = scale_config({"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257,
                         "n_positions": 1024}, 3_000_000)
    assert (gpt2["n_layer"], gpt2["n_embd"], gpt2["n_head"]) == (2, 128, 2)
    with pytest.raises(ModelError, match=r"even the smallest copy of this model .* has more than 1,000 parameters"):
        scale_config(llama70, 1000)


def test_loss_of_plain_modules_hf_models_and_flops():
    torch.manual_seed(0)
    m = _Lin()
    ids = torch.randint(0, 11, (2, 6))
    logits = m(ids)
    want = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 11), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(batch_loss(m, ids), want)
    # 6 x matmul params (Linear 4*11+11) + no attention term; the embedding lookup is not counted.
    assert flops_per_token(m, 6) == 6 * 55


def test_schedule_warms_up_then_decays_to_min_ratio():
    p = torch.nn.Parameter(torch.zeros(2, 2))
    opt = make_optimizer(torch.nn.Linear(2, 2), 1.0, 0.1)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]  # no decay on the bias
    opt = torch.optim.AdamW([p], lr=1.0)
    sched = make_schedule(opt, warmup_steps=4, max_steps=14, min_lr_ratio=0.1)
    lrs = []
    for _ in range(14):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[9] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)


def test_train_context_state_round_trip_restores_rng_and_shares():
    m = _Lin()
    opt = make_optimizer(m, 1e-3, 0.0)
    ctx = TrainContext(rank=0, world_size=2, plan=None, run_dir=None, step=7, model=m, optimizer=opt,
                       lr_scheduler=None, sampler=None, group=None, device_kind="cpu", shares=[3, 5])
    sd = ctx.state_dict()
    expected = torch.rand(3)
    torch.rand(5)
    other = TrainContext(rank=0, world_size=2, plan=None, run_dir=None, step=0, model=_Lin(), optimizer=make_optimizer(_Lin(), 1e-3, 0.0),
                         lr_scheduler=None, sampler=None, group=None, device_kind="cpu", shares=[4, 4])
    other.optimizer = make_optimizer(other.model, 1e-3, 0.0)
    other.load_state_dict(sd)
    assert other.step == 7 and other.shares == [3, 5]
    assert torch.equal(torch.rand(3), expected)
    for k, v in m.state_dict().items():
        assert torch.equal(other.model.state_dict()[k], v)
    other.request_stop("preempted")
    other.request_stop("second reason is ignored")
    assert other.stop_reason == "preempted"


def test_import_starverse_does_not_import_torch_and_loads_the_api_lazily():
    """Also: importing the trainer, the launcher's rank entry, the rank loop and the in-place replica leaves DTensor
    and FSDP2 out (about a second of CPU in a process that never builds an optimizer); the sharding modules
    import them where they shard (see starverse.runtime.parallel.dtensor)."""
    code = (
        "import sys, starverse; starverse.__version__; print('torch' in sys.modules); "
        "from starverse.runtime.trainer import Trainer; print(starverse.Trainer is Trainer); "
        "import starverse.providers.local, starverse.runtime.rank_loop, starverse.runtime.ft; "
        "print([m for m in ('torch.distributed.tensor', 'torch.distributed.fsdp') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True", "[]"]
    import starverse

    with pytest.raises(AttributeError, match="module 'starverse' has no attribute 'Trainr'"):
        starverse.Trainr  # noqa: B018


def test_accelerate_scales_a_model_that_cannot_train_here_and_says_so(tmp_path, monkeypatch):
    import json

    from starverse.runtime.cluster import accelerate
    from starverse.runtime.model_choice import CPU_MAX_PARAMS
    from starverse.runtime.modeling import count_params

    monkeypatch.setenv("STARVERSE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("STARVERSE_CPU_RANKS", raising=False)
    cfg = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
           "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
    cluster = accelerate(model_id=cfg, use_gpus=False, seq_len=64, global_batch=8)
    assert cluster.scaled and cluster.world_size == 2
    assert cluster.model_config["model_type"] == "llama"
    assert count_params(cluster.model_config) <= CPU_MAX_PARAMS
    note = next(n for n in cluster.notes if n.startswith("model:"))
    assert note.startswith("model: the given llama config has 6,738,415,616 parameters and cannot be trained here")
    assert "scaled-down copy of the same architecture" in note
    # The plan names what really runs: the copy's config, written to the cache.
    assert json.loads(Path(cluster.plan.model).read_text()) == json.loads(json.dumps(cluster.model_config, default=str))
    assert [(g.replicas, g.stages[0].accelerator) for g in cluster.plan.groups] == [(2, "cpu")]
    assert cluster.plan.train.global_batch == 8 and cluster.plan.train.precision == "fp32"


def test_test_facility_slows_and_kills_only_the_chosen_rank(monkeypatch):
    import os
    import signal
    import types

    import starverse.testing as facility

    slept, killed = [], []
    monkeypatch.setattr(facility.time, "sleep", slept.append)
    monkeypatch.setattr(os, "kill", lambda pid, sig: killed.append((pid, sig)))
    slow = facility.SlowRank(rank=1, factor=3.0)
    slow.on_micro_batch_end(types.SimpleNamespace(rank=0), 0.5)
    slow.on_micro_batch_end(types.SimpleNamespace(rank=1), 0.5)
    assert slept == [1.0]  # (3 - 1) x 0.5 s: the micro-batch takes 3x its compute time
    kill = facility.KillRank(rank=2, step=5, signal=signal.SIGTERM)
    for rank, step in [(2, 4), (1, 5), (2, 5)]:
        kill.on_step_end(types.SimpleNamespace(rank=rank, step=step))
    assert killed == [(os.getpid(), signal.SIGTERM)]
    with pytest.raises(ValueError, match=r"SlowRank.factor must be >= 1 \(got 0.5\)"):
        facility.SlowRank(0, 0.5)


def test_the_plans_optimizer_is_what_a_rank_trains_with(tmp_path):
    # train.optimizer: sgd -> torch's SGD with Megatron's default momentum, AdamW otherwise; the groups' decay rule
    # is the same; a rank's training_parts takes the plan's choice
    from types import SimpleNamespace

    import numpy as np

    from starverse.runtime.rank_parts import training_parts
    from starverse.runtime.steps import SGD_MOMENTUM

    sgd = make_optimizer(torch.nn.Linear(2, 2), 1.0, 0.1, kind="sgd")
    assert type(sgd) is torch.optim.SGD and SGD_MOMENTUM == 0.9
    assert [(g["weight_decay"], g["momentum"]) for g in sgd.param_groups] == [(0.1, 0.9), (0.0, 0.9)]
    with pytest.raises(ConfigError, match="adamw, sgd"):
        make_optimizer(torch.nn.Linear(2, 2), 1.0, 0.1, kind="lion")
    np.save(tmp_path / "tokens.npy", np.arange(64, dtype=np.int32))
    for kind, cls in (("sgd", torch.optim.SGD), ("adamw", torch.optim.AdamW)):
        train = TrainSpec(seq_len=8, global_batch=2, optimizer=kind)  # type: ignore[arg-type]
        job = SimpleNamespace(plan=SimpleNamespace(train=train), lr=0.1, weight_decay=0.0, adam_eps=1e-8,
                              warmup_steps=1, max_steps=4, min_lr_ratio=0.1, labels_path=None,
                              tokens_path=tmp_path / "tokens.npy", seq_len=8, seed=0)
        model = torch.nn.Linear(4, 4)
        optimizer, *_ = training_parts(model, job)  # type: ignore[arg-type]
        assert type(optimizer) is cls
        model(torch.ones(1, 4)).sum().backward()
        optimizer.step()
        assert ("momentum_buffer" if kind == "sgd" else "exp_avg_sq") in optimizer.state[model.weight]
