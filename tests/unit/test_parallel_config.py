"""In-stage parallelism without processes: bad input gets one clear error, recompute really saves memory."""

from __future__ import annotations

import pytest
import torch

from helpers import TINY, TinyLM, estimated_memory_bytes, forward_activation_bytes
from starverse.errors import ConfigError
from starverse.runtime.lora import apply_lora
from starverse.runtime.modeling import build_model
from starverse.runtime.parallel.blocks import decoder_blocks
from starverse.runtime.parallel.parallelize import ParallelConfig
from starverse.runtime.parallel.recompute import apply_recompute
from starverse.runtime.parallel.tensor import TensorParallelError, check_tensor_parallel, tp_layout

LLAMA = {**TINY, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


def test_tp_must_divide_heads_kv_heads_and_mlp():
    model = build_model(LLAMA)
    check_tensor_parallel(model.config, 2)
    with pytest.raises(TensorParallelError, match=r"tp 4 does not divide the llama's 2 KV heads\. To fix: .*\(e\.g\. 2\)"):
        check_tensor_parallel(model.config, 4)
    with pytest.raises(TensorParallelError, match=r"tp 3 does not divide the llama's 4 attention heads"):
        check_tensor_parallel(model.config, 3)


def test_family_without_a_split_table_is_refused():
    gpt2 = build_model({"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 2, "vocab_size": 64,
                        "n_positions": 32})
    with pytest.raises(TensorParallelError, match=r"not available for 'gpt2'.*To fix: set tp: 1"):
        tp_layout(gpt2)
    layout = tp_layout(build_model(LLAMA))
    assert layout.base_prefix == "model"
    assert "layers.*.self_attn.q_proj" in layout.column and "layers.*.mlp.down_proj" in layout.row
    assert layout.regions == ("layers.*.self_attn", "layers.*.mlp")


def test_plan_settings_that_cannot_run_together():
    with pytest.raises(ConfigError, match=r"offload: optimizer needs zero_stage >= 1"):
        ParallelConfig(offload="optimizer")
    with pytest.raises(ConfigError, match=r"sequence_parallel needs tp > 1"):
        ParallelConfig(sequence_parallel=True)
    with pytest.raises(ConfigError, match=r"recompute must be one of none, selective, matmuls, full \(got 'some'\)"):
        apply_recompute(build_model(LLAMA), "some")
    with pytest.raises(ConfigError, match=r"TinyLM has no nn.ModuleList of blocks"):
        decoder_blocks(TinyLM())


def _activation_bytes(mode: str) -> tuple[int, torch.Tensor, dict[str, torch.Tensor]]:
    """Bytes of activations alive after the forward (torch's MemTracker), the loss and the gradients."""
    model = apply_recompute(build_model(LLAMA, seed=1), mode)
    activations, loss = forward_activation_bytes(model, torch.arange(64).reshape(2, 32) % LLAMA["vocab_size"])
    loss.backward()
    grads = {k.replace("._checkpoint_wrapped_module", ""): p.grad for k, p in model.named_parameters()}
    return activations, loss.detach(), grads


def test_recompute_saves_less_and_changes_nothing():
    none, loss0, grads0 = _activation_bytes("none")
    selective, loss1, grads1 = _activation_bytes("selective")
    matmuls, loss3, grads3 = _activation_bytes("matmuls")
    full, loss2, grads2 = _activation_bytes("full")
    assert full < selective < none
    assert matmuls == selective  # the same op-level policy (runtime/parallel/recompute.py)
    for loss, grads in ((loss1, grads1), (loss2, grads2), (loss3, grads3)):
        torch.testing.assert_close(loss, loss0, rtol=0, atol=0)
        assert grads.keys() == grads0.keys()
        for k in grads0:
            torch.testing.assert_close(grads[k], grads0[k], rtol=0, atol=0, msg=k)


def test_the_cost_model_prices_matmuls_recompute_as_the_runtime_keeps_it():
    # recompute: matmuls keeps each block's input and every matmul's output (q, k, v, o, gate, up, down); full keeps
    # the input alone. The runtime's activations after the forward differ by exactly those outputs (torch's
    # MemTracker; everything outside the blocks is the same under both), and so must the estimate's memory
    measured = _activation_bytes("matmuls")[0] - _activation_bytes("full")[0]
    predicted = estimated_memory_bytes(LLAMA, 32, 2, "matmuls") - estimated_memory_bytes(LLAMA, 32, 2, "full")
    h, q, kv, ffn, tokens, layers = 32, 32, 16, 64, 64, 2
    assert measured == layers * tokens * 4 * (q + 2 * kv + h + 2 * ffn + h)
    assert predicted == pytest.approx(measured, rel=1e-6)


def test_qlora_with_tensor_parallel_or_fsdp_is_refused_lora_is_not():
    from starverse.runtime.cluster import local_plan
    from starverse.runtime.launch import RankSpec
    from starverse.runtime.parallel.parallelize import check_parallel_plan

    ranks = [RankSpec(r, "cpu", "cpu") for r in range(2)]
    base = local_plan(ranks, "tiny", 2, 16, 4, precision="fp32")

    def plan(tp: int = 1, **train: object):
        g = base.groups[0]
        stages = [g.stages[0].model_copy(update={"tp": tp})]
        return base.model_copy(update={"train": base.train.model_copy(update=train),
                                       "groups": [g.model_copy(update={"replicas": 2 // tp, "stages": stages})]})

    with pytest.raises(ConfigError, match=r"tp: 2: tensor parallelism with train.mode: qlora is not run"):
        check_parallel_plan(plan(2, mode="qlora"), ["cpu", "cpu"], 0)
    with pytest.raises(ConfigError, match=r"zero_stage: 3 \(offload: none\) with train.mode: qlora is not run"):
        check_parallel_plan(plan(zero_stage=3, mode="qlora"), ["cpu", "cpu"], 0)
    check_parallel_plan(plan(2, mode="lora"), ["cpu", "cpu"], 0, model=build_model(LLAMA))
    check_parallel_plan(plan(zero_stage=1, mode="qlora"), ["cpu", "cpu"], 0)  # ZeRO-1 shards adapter state only


def test_full_recompute_does_not_run_the_mlp_down_projection_again():
    """The runtime's ``full`` (PyTorch's non-reentrant checkpoint) stops recomputing once the backward's last saved
    tensor is back: of a llama block's seven projections it runs six again, not the MLP's down projection, and
    all seven with ``train.recompute_early_stop: false``, as the cost model charges either
    (tests/unit/test_costmodel_recompute.py)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountMatmuls(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.n += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
            return func(*args, **(kwargs or {}))

    def backward_matmuls(mode: str, early_stop: bool = True, lora: bool = False) -> int:
        model = build_model(LLAMA, seed=1)
        if lora:
            apply_lora(model, 4)  # adapters on all seven projections
        model = apply_recompute(model, mode, early_stop=early_stop)
        loss = model(torch.arange(64).reshape(2, 32) % LLAMA["vocab_size"], labels=None).logits.float().pow(2).mean()
        counter = CountMatmuls()
        with counter:
            loss.backward()
        return counter.n

    layers = LLAMA["num_hidden_layers"]
    assert backward_matmuls("full") - backward_matmuls("none") == 6 * layers
    assert backward_matmuls("full", early_stop=False) - backward_matmuls("none") == 7 * layers
    # with LoRA the down projection's adapter saves its input after the frozen GEMM ran: that GEMM runs again,
    # only the adapter's second matmul does not (3 matmuls per projection: the base, A, B)
    lora_none = backward_matmuls("none", lora=True)
    assert backward_matmuls("full", lora=True) - lora_none == (7 * 3 - 1) * layers
    assert backward_matmuls("full", early_stop=False, lora=True) - lora_none == 7 * 3 * layers
