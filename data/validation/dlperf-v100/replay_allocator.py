"""Replay of one TP rank's device allocations in DLPerf's Megatron-LM runs through PyTorch's caching allocator.

Usage, from this folder (CPU, seconds; the allocator model it imports needs torch installed):

    python replay_allocator.py            # every DLPerf run without pipelining, one TP rank each

An analysis aid for docs/costmodel.md (Validation, ``dlperf``: memory), not part of the cost model. It asks whether
the caching allocator's fragmentation explains why ``dlperf-h1536-l16-dp1-tp8-pp1-mbs16-gbs16`` reads 13.30 GB on
``nvidia-smi`` and ``dlperf-h1536-l16-dp2-tp4-pp1-mbs8-gbs16`` 9.55 GB, where the model gives both about the same
need (same GPUs, global batch and scores per rank). The allocation order is written out by hand, as NVIDIA
Megatron-LM 8aa4619f runs one iteration of one micro-batch (``megatron/training.py`` ``train_step``,
``megatron/model/transformer.py`` ``ParallelSelfAttention`` / ``ParallelTransformerLayer`` /
``_checkpointed_forward``, ``megatron/mpu/random.py`` ``CheckpointFunction``, ``megatron/mpu/cross_entropy.py``,
``megatron/model/distributed.py`` ``allreduce_params``, ``megatron/optimizer/optimizer.py``
``FP16OptimizerWithFP16Params``): fp16 weights and fp32 master copies made at start; ``zero_grad`` (set to None)
before every step's forward; every layer run under ``no_grad`` keeping only its output, then recomputed in the
backward with what its ops save (fused LayerNorm's input, the linears' inputs, the fused causal softmax's output, the
dropout masks, ``bias_gelu``'s input), each gradient allocated when autograd makes it and freed when consumed, the
fp16 ``.grad`` of each weight created at its first gradient; the loss on an fp32 copy of the logits; the local
DDP's flat copy of the fp16 gradients; at the first step the fp32 main gradients (kept: ``zero_grad`` never frees
them at this commit) and Adam's m and v. Tensors under 1 MiB are left out. The events go through the allocator model
of ``../mixed-sailor-mit/replay_allocator.py`` (best fit, block splitting, 2 / 20 MiB segments, no release; PyTorch
1.8's allocator, of NGC 20.12, has no ``max_split_size``, as that model).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location(
    "sailor_replay", Path(__file__).resolve().parent.parent / "mixed-sailor-mit" / "replay_allocator.py")
assert _SPEC is not None and _SPEC.loader is not None
_SAILOR = importlib.util.module_from_spec(_SPEC)
sys.modules["sailor_replay"] = _SAILOR
_SPEC.loader.exec_module(_SAILOR)
Allocator = _SAILOR.Allocator

S = 2048
FP16, FP32 = 2, 4


class Trace:
    """Allocations and frees in program order, replayed as they come."""

    def __init__(self) -> None:
        self.alloc = Allocator()
        self.live: dict[int, object] = {}
        self.next_id = 0

    def new(self, nbytes: float) -> int:
        self.next_id += 1
        self.live[self.next_id] = self.alloc.malloc(int(nbytes))
        return self.next_id

    def free(self, *ids: int) -> None:
        for i in ids:
            self.alloc.free(self.live.pop(i))


def run(tp: int, b: int, h: int = 1536, layers: int = 16, heads: int = 16, vocab: int = 51200,
        iters: int = 3) -> list[tuple[float, float, float]]:
    """(reserved, peak allocated, allocated) GB after each step of ``iters`` steps of one micro-batch."""
    tr = Trace()
    sbh = S * b * h * FP16
    split = S * b * (h // tp) * FP16
    scores = b * (heads // tp) * S * S * FP16
    v = vocab // tp
    # parameters per layer on this rank (the large ones) and the embedding (tied with the head)
    shapes = [3 * h * h // tp, h * h // tp, 4 * h * h // tp, 4 * h * h // tp]
    emb, pos = v * h, S * h
    params = [n for _ in range(layers) for n in shapes] + [emb, pos]
    weights = [tr.new(n * FP16) for n in params]
    master = [tr.new(n * FP32) for n in params]
    grads: dict[int, int] = {}
    stepped = False
    del weights, master

    def wgrad(k: int) -> None:
        """The gradient of parameter ``k``: the .grad itself the first time, else a temporary added into it."""
        if k in grads:
            tr.free(tr.new(params[k] * FP16))
        else:
            grads[k] = tr.new(params[k] * FP16)

    def layer_forward(x: int, keep: bool) -> tuple[int, dict[str, int]]:
        saved: dict[str, int] = {}
        ln1 = tr.new(sbh)
        qkv = tr.new(3 * split)
        empty = tr.new(scores)
        sc = tr.new(scores)
        tr.free(empty)
        probs = tr.new(scores)
        mask = tr.new(scores // 2)
        dropped = tr.new(scores)
        ctx = tr.new(split)
        ctxp = tr.new(split)
        tr.free(ctx, sc)
        dense = tr.new(sbh)
        m1 = tr.new(sbh // 2)
        ln_in = tr.new(sbh)
        tr.free(dense)
        if not keep:
            tr.free(probs, mask, dropped, qkv, ctxp, m1)
        ln2 = tr.new(sbh)
        if not keep:
            tr.free(ln1)
        fc1 = tr.new(4 * split)
        gelu = tr.new(4 * split)
        if not keep:
            tr.free(fc1)
        fc2 = tr.new(sbh)
        m2 = tr.new(sbh // 2)
        out = tr.new(sbh)
        tr.free(fc2)
        if not keep:
            tr.free(gelu, m2, ln_in, ln2)
        else:
            saved = dict(ln1=ln1, qkv=qkv, probs=probs, mask=mask, dropped=dropped, ctxp=ctxp, m1=m1, ln_in=ln_in,
                         ln2=ln2, fc1=fc1, gelu=gelu, m2=m2)
        return out, saved

    def layer_backward(i: int, g_out: int, sv: dict[str, int]) -> int:
        k = 4 * i
        g_fc2 = tr.new(sbh)
        tr.free(sv["m2"])
        g_gelu = tr.new(4 * split)
        wgrad(k + 3)
        tr.free(g_fc2, sv["gelu"])
        g_fc1 = tr.new(4 * split)
        tr.free(g_gelu, sv["fc1"])
        g_ln2 = tr.new(sbh)
        wgrad(k + 2)
        tr.free(g_fc1, sv["ln2"])
        g_part = tr.new(sbh)
        tr.free(g_ln2, sv["ln_in"])
        g_ln_in = tr.new(sbh)
        tr.free(g_part)
        g_dense = tr.new(sbh)
        tr.free(sv["m1"])
        g_ctxp = tr.new(split)
        wgrad(k + 1)
        tr.free(g_dense, sv["ctxp"])
        g_dropped = tr.new(scores)
        g_v = tr.new(split)
        tr.free(g_ctxp, sv["dropped"])
        g_probs = tr.new(scores)  # the fused softmax's backward runs in place on it
        tr.free(g_dropped, sv["mask"], sv["probs"])
        g_q = tr.new(split)
        g_k = tr.new(split)
        tr.free(g_probs)
        g_qkv = tr.new(3 * split)
        tr.free(g_q, g_k, g_v, sv["qkv"])
        g_ln1 = tr.new(sbh)
        wgrad(k)
        tr.free(g_qkv, sv["ln1"])
        g_x_part = tr.new(sbh)
        tr.free(g_ln1)
        g_x = tr.new(sbh)
        tr.free(g_x_part, g_ln_in)
        return g_x

    out: list[tuple[float, float, float]] = []
    for _step in range(iters):
        for k in list(grads):  # zero_grad(set_to_none=True) of the fp16 groups
            tr.free(grads.pop(k))
        tr.alloc.peak_allocated = tr.alloc.allocated
        # embedding (not checkpointed): word + position, transposed to [s, b, h], dropout
        words = tr.new(sbh)
        pe = tr.new(sbh)
        e = tr.new(sbh)
        tr.free(words, pe)
        et = tr.new(sbh)
        tr.free(e)
        emask = tr.new(sbh // 2)
        x = tr.new(sbh)
        tr.free(et)
        inputs = [x]
        for _ in range(layers):  # _checkpointed_forward: each layer under no_grad, its input saved
            x = layer_forward(x, keep=False)[0]
            inputs.append(x)
        lnf = tr.new(sbh)
        logits16 = tr.new(S * b * v * FP16)
        logits32 = tr.new(S * b * v * FP32)
        tr.free(logits16)
        # backward: the loss in place on the fp32 softmax, its fp16 cast, the head's linear, the final LayerNorm
        g16 = tr.new(S * b * v * FP16)
        tr.free(logits32)
        g = tr.new(sbh)
        wgrad(len(params) - 2)
        tr.free(g16, lnf)
        g_last = tr.new(sbh)
        tr.free(g)
        g = g_last
        for i in reversed(range(layers)):  # CheckpointFunction.backward: recompute with grad, then backward
            recomputed, sv = layer_forward(inputs[i], keep=True)
            tr.free(recomputed)
            g_in = layer_backward(i, g, sv)
            tr.free(g, inputs[i + 1])
            g = g_in
        g_drop = tr.new(sbh)
        tr.free(g, emask)
        g_t = tr.new(sbh)
        tr.free(g_drop)
        wgrad(len(params) - 2)
        wgrad(len(params) - 1)
        tr.free(g_t, inputs[0])
        # allreduce_params: one flat fp16 copy of every gradient
        flat = tr.new(sum(params) * FP16)
        tr.free(flat)
        # optimizer step: fp32 main gradients (first step, kept) and Adam's m and v (first step)
        if not stepped:
            for n in params:
                tr.new(n * FP32)  # main_param.grad = torch.empty_like(main_param)
            for n in params:
                tr.new(n * FP32)  # exp_avg
                tr.new(n * FP32)  # exp_avg_sq
            stepped = True
        a = tr.alloc
        out.append((a.reserved / 1e9, a.peak_allocated / 1e9, a.allocated / 1e9))
    return out


RUNS = {  # case: (TP, micro-batch, hidden, layers, heads, padded vocabulary, nvidia-smi reading GB)
    "dlperf-h768-l12-dp1-tp1-pp1-mbs8-gbs8": (1, 8, 768, 12, 12, 50304, 10.287),
    "dlperf-h1536-l16-dp1-tp1-pp1-mbs2-gbs2": (1, 2, 1536, 16, 16, 50304, 15.06),
    "dlperf-h1536-l16-dp8-tp1-pp1-mbs2-gbs16": (1, 2, 1536, 16, 16, 50304, 15.664),
    "dlperf-h1536-l16-dp16-tp1-pp1-mbs2-gbs32": (1, 2, 1536, 16, 16, 50304, 15.213),
    "dlperf-h1536-l16-dp4-tp2-pp1-mbs4-gbs16": (2, 4, 1536, 16, 16, 50432, 10.11),
    "dlperf-h1536-l16-dp2-tp4-pp1-mbs8-gbs16": (4, 8, 1536, 16, 16, 50688, 9.546),
    "dlperf-h1536-l16-dp1-tp8-pp1-mbs16-gbs16": (8, 16, 1536, 16, 16, 51200, 13.3),
    "dlperf-h2304-l24-dp2-tp8-pp1-mbs8-gbs16": (8, 8, 2304, 24, 24, 51200, 15.653),
    "dlperf-h2304-l24-dp4-tp8-pp1-mbs8-gbs32": (8, 8, 2304, 24, 24, 51200, 15.733),
    "dlperf-h3072-l16-dp1-tp16-pp1-mbs16-gbs16": (16, 16, 3072, 16, 32, 51200, 12.74),
}

if __name__ == "__main__":
    for name, (tp, b, h, layers, heads, vocab, read) in RUNS.items():
        r, pa, al = run(tp, b, h=h, layers=layers, heads=heads, vocab=vocab)[-1]
        print(f"{name}: after step 3 reserved {r:.2f} GB (peak allocated {pa:.2f}); read {read:.2f} GB, "
              f"{read - r:.2f} GB beside the allocator's reserve")
