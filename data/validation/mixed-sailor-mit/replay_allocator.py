"""Replay of one TP rank's device allocations through PyTorch's CUDA caching allocator, on three MIT runs' stages.

Usage, from this folder (CPU only, torch; about 5 minutes and 4 GB of host memory per stage):

    MALLOC_MMAP_THRESHOLD_=131072 python replay_allocator.py pp1      # sailor-mit-n4-d4 / n6-d6: the single stage
    MALLOC_MMAP_THRESHOLD_=131072 python replay_allocator.py pp2s0    # sailor-mit-n4-d2 / n6-d3: stage 0 (11 layers)
    MALLOC_MMAP_THRESHOLD_=131072 python replay_allocator.py pp2s1    # their stage 1 (13 layers + head)

An analysis aid for docs/costmodel.md (Validation, Sailor: peak memory), not part of the cost model. It asks
whether the caching allocator's fragmentation explains why the pure data-parallel TP 8 runs log 2.6 GB more device
memory than the 2-stage pipelines. Part 1 runs one TP rank of Sailor's OPT-350M as its Megatron-DeepSpeed runs it
(``third_party/Megatron-DeepSpeed/megatron/model/opt_model.py`` of eth-easl/sailor: fp32, TP 8 per-rank shapes,
micro-batch 2, sequence 2048, no dropout, ReLU, unscaled scores masked in place before a torch softmax, Megatron's
linear autograd function, ``vocab_parallel_cross_entropy``) under DeepSpeed 0.16.5's ``TrainSchedule`` order with
Sailor's ``deepspeed/pipe_engine.py`` buffers (inputs cloned, a non-last stage's output replaced by a 1-element
tensor after its 1/t partition is cloned, received tensors rebuilt as ``torch.zeros`` of the full size, the last
stage's outputs kept in the pipe buffers), DeepSpeed's ``buffered_allreduce_fallback`` (zeros for parameters
without a gradient, one flat copy), FusedAdam's states created at the first step and ``zero_grad`` setting every
gradient to None (``deepspeed/engine.py``). Matmul outputs are allocated, not computed (``new_empty``): only sizes
and lifetimes matter. ``torch.profiler`` records every allocation and free in order. Part 2 replays that trace
through a model of ``c10/cuda/CUDACachingAllocator.cpp`` (PyTorch 2.x defaults: 512-byte rounding, a small pool for
requests up to 1 MiB in 2 MiB segments, 20 MiB segments for requests under 10 MiB, larger ones rounded to 2 MiB,
best fit, blocks split when the rest exceeds 1 MiB (small pool: 512 B), neighbours merged on free, segments never
released) and prints the reserved bytes after each optimizer step: what ``nvidia-smi`` shows less the CUDA context
and library buffers. One stream (NCCL's streams and the collectives' in-place buffers are not replayed).
"""

from __future__ import annotations

import bisect
import json
import os
import sys
import torch
import torch.nn.functional as F
from torch.profiler import profile, ProfilerActivity

torch.set_num_threads(1)
torch.manual_seed(0)
B, S, H, T = 2, 2048, 1024, 8
HEADS, D = 16 // T, 64
FF = 4096 // T
V = 51200 // T          # GPT-2 vocab 50257 padded to a multiple of 128 x TP
f32 = torch.float32


class Lin(torch.autograd.Function):
    """Megatron's LinearWithGradAccumulationAndAsyncCommunication (no SP, no wgrad fusion)."""
    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        ctx.has_b = b is not None
        out = x.new_empty(x.shape[:-1] + (w.shape[0],))   # matmul's output (values not needed)
        if b is not None:
            out = out + b
        return out

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gi = g.new_empty(g.shape[:-1] + (w.shape[1],))
        g2 = g.reshape(-1, g.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        gw = g2.new_empty((g2.shape[1], x2.shape[1]))
        gb = g2.sum(dim=0) if ctx.has_b else None
        return gi, gw, gb


class VocabCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target):
        mx = torch.max(logits, dim=-1)[0]
        logits = logits - mx.unsqueeze(-1)
        tmask = (target < 0) | (target >= V)
        mt = target.clone() - 0
        mt[tmask] = 0
        l2 = logits.view(-1, V)
        mt1 = mt.view(-1)
        ar = torch.arange(0, l2.size(0))
        pl = l2[ar, mt1].clone().contiguous().view_as(target)
        pl[tmask] = 0.0
        exp = logits
        torch.exp(logits, out=exp)
        se = exp.sum(dim=-1)
        loss = torch.log(se) - pl
        exp.div_(se.unsqueeze(-1))
        ctx.save_for_backward(exp, tmask, mt1)
        return loss

    @staticmethod
    def backward(ctx, go):
        sm, tmask, mt1 = ctx.saved_tensors
        gi = sm
        g2 = gi.view(-1, V)
        ar = torch.arange(0, g2.size(0))
        sub = 1.0 - tmask.view(-1).float()
        g2[ar, mt1] -= sub
        gi.mul_(go.unsqueeze(-1))
        return gi, None


class BMM(torch.autograd.Function):
    """bmm / baddbmm(beta=0): saves both inputs, backward allocates both input gradients."""
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a.new_empty((a.shape[0], a.shape[1], b.shape[2]))

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g.new_empty(a.shape), g.new_empty(b.shape)


def P(*shape):
    return torch.nn.Parameter(torch.empty(*shape).normal_(0.0, 0.02))


MARK = 777777  # bytes of a marker allocation between iterations (skipped by the replay)


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1w, self.ln1b = P(H), P(H)
        self.qkvw, self.qkvb = P(3 * H // T, H), P(3 * H // T)
        self.densew, self.denseb = P(H, H // T), P(H)      # bias unused (skip_bias_add, ignored)
        self.ln2w, self.ln2b = P(H), P(H)
        self.fc1w, self.fc1b = P(FF, H), P(FF)             # bias unused
        self.fc2w, self.fc2b = P(H, FF), P(H)              # bias unused

    def forward(self, x, mask):
        res = x
        h = F.layer_norm(x, (H,), self.ln1w, self.ln1b)
        qkv = Lin.apply(h, self.qkvw, self.qkvb).view(S, B, HEADS, 3 * D)
        q, k, v = torch.split(qkv, D, dim=-1)
        q = q.reshape(S, B * HEADS, D)
        k = k.reshape(S, B * HEADS, D)
        mm = torch.empty(B * HEADS, S, S)
        sc = BMM.apply(q.transpose(0, 1), k.transpose(0, 1).transpose(1, 2))
        del mm
        sc = sc.view(B, HEADS, S, S)
        sc.masked_fill_(mask, -10000.0)
        pr = torch.nn.Softmax(dim=-1)(sc)
        del sc
        v = v.reshape(S, B * HEADS, D)
        pr = pr.view(B * HEADS, S, -1)
        c = BMM.apply(pr, v.transpose(0, 1))
        c = c.view(B, HEADS, S, D).permute(2, 0, 1, 3).contiguous().view(S, B, H // T)
        o = Lin.apply(c, self.densew, None)
        x = res + o
        shp = x.shape
        x = x.reshape(-1, H)
        res = x
        h = F.layer_norm(x, (H,), self.ln2w, self.ln2b)
        h = Lin.apply(h, self.fc1w, None)
        h = F.relu(h)
        h = Lin.apply(h, self.fc2w, None)
        return (res + h).view(shp)


class Emb(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.word, self.pos = P(V, H), P(S, H)

    def forward(self, ids, pos):
        m = (ids < 0) | (ids >= V)
        mi = ids.clone() - 0
        mi[m] = 0
        we = F.embedding(mi, self.word)
        we[m, :] = 0.0
        pe = F.embedding(pos, self.pos)
        e = we + pe
        return e.transpose(0, 1).contiguous()


class Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lnw, self.lnb, self.w = P(H), P(H), P(V, H)

    def forward(self, x):
        return Lin.apply(F.layer_norm(x, (H,), self.lnw, self.lnb), self.w, None)


class Stage(torch.nn.Module):
    def __init__(self, layers, first, last):
        super().__init__()
        self.first, self.last = first, last
        self.emb = Emb() if first else None
        self.layers = torch.nn.ModuleList(Layer() for _ in range(layers))
        self.head = Head() if last else None

    def forward(self, x, mask):
        if self.first:
            x = self.emb(*x)
        for layer in self.layers:
            x = layer(x, mask)
        if self.last:
            x = self.head(x)
        return x


def record(kind, layers, first, last, stages, stage_id, m, iters, out):
    """Run ``iters`` steps of ``m`` micro-batches of one stage; the ordered (address, bytes) events."""
    state = {}
    nbuf = max(2, min(stages - stage_id, m))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = Stage(layers, first, last)
        mask = torch.tril(torch.ones((1, S, S))).view(1, 1, S, S)
        mask = (mask < 0.5).to(torch.bool)
        mk = torch.empty(MARK, dtype=torch.uint8)
        del mk
        bufs = {"inputs": [None] * nbuf, "labels": [None] * nbuf, "outputs": [None] * nbuf, "out_t": [None] * nbuf}
        loss = None
        for it in range(iters):
            # DeepSpeed TrainSchedule order of this stage
            steps = []
            for step_id in range(2 * (m + stages - 1)):
                even_step, even_stage = step_id % 2 == 0, stage_id % 2 == 0
                if even_step == even_stage:
                    mb = (step_id // 2 - stage_id // 2) if even_step else ((step_id - 1) // 2 - stage_id // 2)
                    fwd = True
                else:
                    base = (step_id // 2 - stages + 1) if even_step else ((step_id - 1) // 2 - stages + 1)
                    mb = base + stage_id // 2
                    fwd = False
                if 0 <= mb < m:
                    steps.append((fwd, mb))
            for fwd, mb in steps:
                bi = mb % nbuf
                if fwd:
                    if first:
                        ids = torch.randint(0, V * T, (B, S))
                        bufs["inputs"][bi] = (ids.clone(), torch.arange(S).unsqueeze(0).expand(B, S).clone())
                        inp = tuple(t.clone() for t in bufs["inputs"][bi])
                    else:
                        full = torch.zeros(S * B * H, dtype=f32)   # reconstruct_tensor: zeros + copy of parts
                        full = full.view(S, B, H)
                        full.requires_grad = True
                        bufs["inputs"][bi] = full
                        inp = full
                    if last:
                        bufs["labels"][bi] = torch.randint(0, V * T, (B, S))
                    o = model(inp, mask)
                    if not last:
                        part = o.detach().contiguous().view(-1).narrow(0, 0, o.numel() // T).clone()
                        o.data = torch.zeros(1)
                        bufs["out_t"][bi] = o
                        bufs["outputs"][bi] = part
                        del part
                    else:
                        bufs["outputs"][bi] = o
                        lab = bufs["labels"][bi].transpose(0, 1).contiguous()
                        losses = VocabCE.apply(o.contiguous().float(), lab).transpose(0, 1).contiguous()
                        loss = torch.sum(losses.view(-1)) / float(B * S)
                        del losses, lab
                    del o, inp
                else:
                    if last:
                        (loss / m).backward()
                        if not first:
                            g = bufs["inputs"][bi].grad
                            part = g.contiguous().view(-1).narrow(0, 0, g.numel() // T).clone()
                            del part, g
                            bufs["inputs"][bi] = None
                    else:
                        g = torch.zeros(S * B * H, dtype=f32).view(S, B, H)
                        t = bufs["out_t"][bi]
                        t.data = g
                        torch.autograd.backward(tensors=[t], grad_tensors=[g])
                        del t, g
                        bufs["out_t"][bi] = None
                        bufs["outputs"][bi] = None
            # ReduceGrads: DeepSpeed's buffered_allreduce_fallback (params without grads get zeros first)
            grads = []
            for p in model.parameters():
                if p.grad is None:
                    p.grad = torch.zeros(p.size(), dtype=p.dtype)
                grads.append(p.grad.data)
            flat = torch._utils._flatten_dense_tensors(grads)
            for buf, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                buf.copy_(synced)
            del flat, grads, buf, synced
            # OptimizerStep: FusedAdam (states created at the first step, no temporaries), then zero_grad (None)
            for p in model.parameters():
                if p not in state:
                    state[p] = (torch.zeros_like(p.data), torch.zeros_like(p.data))
            for p in model.parameters():
                p.grad = None
            mk = torch.empty(MARK, dtype=torch.uint8)
            del mk
            print(kind, "iteration", it, "done", flush=True)
    prof.export_chrome_trace(out + ".json")
    ev = json.load(open(out + ".json"))["traceEvents"]
    mem = [(e["ts"], e["args"]["Ev Idx"], e["args"]["Addr"], e["args"]["Bytes"])
           for e in ev if e.get("name") == "[memory]"]
    mem.sort(key=lambda r: (r[0], r[1]))
    os.remove(out + ".json")
    return [(a, b) for _, _, a, b in mem]



K_MIN_BLOCK = 512
K_SMALL_SIZE = 1 << 20
K_SMALL_BUFFER = 2 << 20
K_LARGE_BUFFER = 20 << 20
K_MIN_LARGE_ALLOC = 10 << 20
K_ROUND_LARGE = 2 << 20


def round_size(n):
    return K_MIN_BLOCK if n < K_MIN_BLOCK else K_MIN_BLOCK * ((n + K_MIN_BLOCK - 1) // K_MIN_BLOCK)


def allocation_size(n):
    if n <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if n < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * ((n + K_ROUND_LARGE - 1) // K_ROUND_LARGE)


class Block:
    __slots__ = ("ptr", "size", "free", "prev", "next", "small")

    def __init__(self, ptr, size, small):
        self.ptr, self.size, self.free, self.prev, self.next, self.small = ptr, size, True, None, None, small


class Allocator:
    def __init__(self):
        self.pools = {True: [], False: []}   # sorted lists of (size, ptr, block) of free blocks
        self.next_ptr = 0
        self.reserved = 0
        self.allocated = 0
        self.peak_reserved = 0
        self.peak_allocated = 0

    def _insert(self, b):
        bisect.insort(self.pools[b.small], (b.size, b.ptr, id(b), b))

    def _remove(self, b):
        pool = self.pools[b.small]
        i = bisect.bisect_left(pool, (b.size, b.ptr, id(b)))
        assert pool[i][3] is b
        pool.pop(i)

    def malloc(self, n):
        size = round_size(n)
        small = size <= K_SMALL_SIZE
        pool = self.pools[small]
        i = bisect.bisect_left(pool, (size, -1, -1))
        if i < len(pool):
            b = pool[i][3]
            pool.pop(i)
        else:
            seg = allocation_size(size)
            b = Block(self.next_ptr, seg, small)
            self.next_ptr += seg + (1 << 30)
            self.reserved += seg
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        rest = b.size - size
        if (small and rest >= K_MIN_BLOCK) or (not small and rest > K_SMALL_SIZE):
            r = Block(b.ptr + size, rest, small)
            r.prev, r.next = b, b.next
            if b.next is not None:
                b.next.prev = r
            b.next = r
            b.size = size
            self._insert(r)
        b.free = False
        self.allocated += b.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return b

    def free(self, b):
        b.free = True
        self.allocated -= b.size
        for nb in (b.prev, b.next):
            if nb is not None and nb.free:
                self._remove(nb)
                if nb is b.prev:
                    nb.size += b.size
                    nb.next = b.next
                    if b.next is not None:
                        b.next.prev = nb
                    b = nb
                else:
                    b.size += nb.size
                    b.next = nb.next
                    if nb.next is not None:
                        nb.next.prev = b
        self._insert(b)


def replay(ev):
    """Reserved, allocated, peak reserved and peak allocated bytes at each marker of an event list."""
    a = Allocator()
    live = {}
    out = []
    for addr, nbytes in ev:
        if nbytes == MARK:
            out.append((a.reserved, a.allocated, a.peak_reserved, a.peak_allocated))
            continue
        if nbytes == -MARK:
            continue
        if nbytes > 0:
            live[addr] = a.malloc(nbytes)
        elif nbytes < 0 and addr in live:
            a.free(live.pop(addr))
    return out, a


STAGES = {"pp1": (24, True, True, 1, 0), "pp2s0": (11, True, False, 2, 0), "pp2s1": (13, False, True, 2, 1)}

if __name__ == "__main__":
    kind = sys.argv[1]
    m = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    iters = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    marks, _ = replay(record(kind, *STAGES[kind], m, iters, kind))
    for i, (r, al, pr, pa) in enumerate(marks[1:]):
        print(f"{kind} after step {i + 1}: reserved {r / 1e9:.3f} GB, allocated {al / 1e9:.3f} GB, "
              f"peak reserved {pr / 1e9:.3f} GB, peak allocated {pa / 1e9:.3f} GB")
