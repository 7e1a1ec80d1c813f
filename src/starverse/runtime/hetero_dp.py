"""Heterogeneous data parallelism: uneven integer shares of a fixed global batch, rebalanced from measured time.

The global batch (``global_batch`` sequences = ``num_micro`` micro-batches of ``micro_batch``) is fixed;
rank *r* processes ``shares[r]`` whole micro-batches. Each micro-batch's mean loss is scaled by
``micro_batch / global_batch`` before ``backward`` and the gradients are *summed* over ranks, so the
result is exactly the gradient of the mean loss over the global batch -- one step equals one step of a
single process on the same batch, whatever the shares (packing gives every sequence the same number of
loss tokens, so the mean over sequences is the mean over tokens).

Shares start from the plan (group ``batch_share``, else device speed) and are rebalanced every N steps
from the measured forward+backward time per micro-batch of each rank: the new shares minimise the
predicted step time (greedy min-max, optimal for this problem), and are adopted only when they are
predicted to be faster by more than the hysteresis, so noise does not make shares oscillate.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from starverse.errors import ConfigError
from starverse.runtime.parallel.dtensor import is_dtensor

log = logging.getLogger(__name__)


def proportional_shares(num_micro: int, weights: Sequence[float], min_shares: Sequence[int] | None = None) -> list[int]:
    """Split ``num_micro`` micro-batches in proportion to ``weights``, at least ``min_shares`` (default 1) each
    (largest remainder)."""
    n = len(weights)
    if n == 0:
        raise ConfigError("no ranks to share the batch between.")
    low = list(min_shares) if min_shares is not None else [1] * n
    if num_micro < sum(low):
        need = (
            "every rank needs at least one" if max(low) == 1
            else f"together they need at least {sum(low)} ({low}: a pipeline needs one per stage)"
        )
        raise ConfigError(
            f"the global batch holds {num_micro} micro-batch(es) for {n} {'ranks' if max(low) == 1 else 'replicas'}; "
            f"{need}. To fix: raise the global batch or lower per_device_batch_size."
        )
    if any(w <= 0 for w in weights):
        raise ConfigError(f"share weights must be > 0 (got {list(weights)}).")
    total = float(sum(weights))
    exact = [num_micro * w / total for w in weights]
    shares = [max(lo, int(e)) for lo, e in zip(low, exact, strict=True)]
    while sum(shares) < num_micro:
        i = max(range(n), key=lambda r: (exact[r] - shares[r], -r))
        shares[i] += 1
    while sum(shares) > num_micro:
        i = max((r for r in range(n) if shares[r] > low[r]), key=lambda r: (shares[r] - exact[r], r))
        shares[i] -= 1
    return shares


def balanced_shares(
    num_micro: int, time_per_micro_s: Sequence[float], min_shares: Sequence[int] | None = None
) -> list[int]:
    """Shares minimising ``max_r shares[r] * time_per_micro_s[r]`` with every share ≥ ``min_shares`` (default 1).

    Greedy: give each next micro-batch to the rank that would finish it first. For identical
    independent items this greedy choice is optimal for the makespan.
    """
    n = len(time_per_micro_s)
    shares = list(min_shares) if min_shares is not None else [1] * n
    if num_micro < sum(shares):
        raise ConfigError(f"{num_micro} micro-batches cannot give the {n} replicas their minimum {shares}.")
    for _ in range(num_micro - sum(shares)):
        best = min(range(n), key=lambda r: ((shares[r] + 1) * time_per_micro_s[r], r))
        shares[best] += 1
    return shares


def predicted_step_s(shares: Sequence[int], time_per_micro_s: Sequence[float]) -> float:
    """Compute-bound step time of ``shares``: the slowest rank's share times its time per micro-batch."""
    return max(s * t for s, t in zip(shares, time_per_micro_s, strict=True))


@dataclass
class Rebalancer:
    """Decides new shares from measured compute times; identical decisions on every rank (same inputs)."""

    num_micro: int
    """Micro-batches per global batch."""
    every: int = 10
    """Consider rebalancing every this many steps (0: never)."""
    hysteresis: float = 0.05
    """Adopt new shares only if predicted ≥ this fraction faster than the current ones."""
    window: int = 5
    """Steps of history used (median time per micro-batch per rank)."""
    min_shares: tuple[int, ...] | None = None
    """Fewest micro-batches each unit may get (None: 1; a pipeline replica: as its schedule needs)."""
    _history: deque[list[float]] = field(default_factory=deque)

    def observe(self, shares: Sequence[int], compute_times_s: Sequence[float]) -> None:
        """Record one step: each rank's compute time for its share."""
        self._history.append([t / max(1, s) for s, t in zip(shares, compute_times_s, strict=True)])
        while len(self._history) > self.window:
            self._history.popleft()

    def time_per_micro_s(self) -> list[float]:
        """Median measured time per micro-batch of each rank over the window."""
        cols = list(zip(*self._history, strict=True))
        return [float(torch.tensor(c, dtype=torch.float64).median()) for c in cols]

    def propose(self, step: int, shares: Sequence[int]) -> list[int] | None:
        """New shares if it is time to rebalance and they beat the current ones by the hysteresis; else None."""
        if self.every <= 0 or step % self.every != 0 or not self._history:
            return None
        t = self.time_per_micro_s()
        if any(x <= 0 for x in t):
            return None
        new = balanced_shares(self.num_micro, t, self.min_shares)
        if new == list(shares):
            return None
        now_s, new_s = predicted_step_s(shares, t), predicted_step_s(new, t)
        if new_s < now_s * (1.0 - self.hysteresis):
            log.info("rebalance at step %d: %s -> %s (predicted %.3fs -> %.3fs)", step, list(shares), new, now_s, new_s)
            # Fresh measurements for the new shares: old ones reflected the old split.
            self._history.clear()
            return new
        return None


class GradientSync:
    """Sums the gradients of ``params`` over all ranks through a mesh, in flat buckets.

    With :meth:`arm` called before the last micro-batch's backward, each bucket's all-reduce starts as
    soon as all its gradients are accumulated (post-accumulate-grad hooks), overlapping communication
    with the rest of the backward as DDP does; :meth:`finish` starts what is left and waits. Buckets are
    started strictly in order, so every rank issues the same collectives in the same order.
    """

    def __init__(
        self, params: Sequence[torch.nn.Parameter], mesh: object, bucket_mb: float = 25.0, world_size: int = 2
    ):
        # One rank has nothing to sum: no buckets, no hooks.
        self.params = [p for p in params if p.requires_grad] if world_size > 1 else []
        self.mesh = mesh
        # Reverse order: the last layers' gradients are ready first during backward.
        self.buckets: list[list[torch.nn.Parameter]] = []
        cur: list[torch.nn.Parameter] = []
        size = 0
        limit = int(bucket_mb * 2**20)
        for p in reversed(self.params):
            cur.append(p)
            size += p.numel() * p.element_size()
            if size >= limit:
                self.buckets.append(cur)
                cur, size = [], 0
        if cur:
            self.buckets.append(cur)
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self._ready = [0] * len(self.buckets)
        self._next = 0
        self._armed = False
        self._pending: list[tuple[list[torch.nn.Parameter], torch.Tensor, Any]] = []
        self.blocked_s = 0.0
        """Seconds spent inside collectives started from backward hooks (the gloo bridge between device kinds
        is synchronous: a fast rank waits there for the slowest). The trainer resets it each step and takes it
        out of the measured compute time, so the rebalancer sees each device's own speed."""
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def arm(self) -> None:
        """The next backward is the step's last: start each bucket's all-reduce as soon as it is ready."""
        self._ready = [0] * len(self.buckets)
        self._next = 0
        self._armed = True

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if not self._armed:
            return
        b = self._bucket_of[id(p)]
        self._ready[b] += 1
        while self._next < len(self.buckets) and self._ready[self._next] == len(self.buckets[self._next]):
            self._launch(self._next)
            self._next += 1

    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        flat = torch.cat([(local(p.grad) if p.grad is not None else torch.zeros_like(local(p))).reshape(-1)
                          for p in bucket])
        t0 = time.perf_counter()
        self._pending.append((bucket, flat, self.mesh.all_reduce_async(flat)))  # type: ignore[attr-defined]
        self.blocked_s += time.perf_counter() - t0

    def finish(self) -> None:
        """Start the buckets not started yet, wait for all, and write the sums back into ``.grad``."""
        while self._next < len(self.buckets):
            self._launch(self._next)
            self._next += 1
        self._armed = False
        for bucket, flat, work in self._pending:
            work.wait()
            offset = 0
            for p in bucket:
                n = local(p).numel()
                chunk = flat[offset : offset + n].view_as(local(p))
                if p.grad is None:
                    p.grad = like(p, chunk.clone())
                else:
                    local(p.grad).copy_(chunk)
                offset += n
        self._pending.clear()

    def all_reduce(self) -> None:
        """Sum every parameter's ``.grad`` over all ranks in place, without overlap (missing grads count as zero)."""
        self._armed = True
        self._next = 0
        self.finish()


class HolderSync:
    """Sums each parameter's gradient over every rank that holds it, in groups of ranks holding the same ones.

    With pipelines, and groups whose pipelines split the layers differently, a parameter lives on one rank per
    replica, and which ranks those are differs between parameters. Parameters are keyed by their name in the
    unsplit model (and the rank's tensor-parallel index, whose shard differs); ranks holding the same set of
    parameters get one mesh over them (native inside a device kind, gloo bridge between kinds) and one
    :class:`GradientSync`. Built collectively: every rank passes its own ``(name, parameter)`` list.

    ``replica``: under ZeRO inside the stages, FSDP2 already summed each shard over the replicas of the group;
    only the parameters a replica holds twice (a tied head on the last stage) are left to sum, inside the
    replica, so the keys carry it. Tensor parallel and ZeRO parameters are DTensors: their local shards are
    summed. The gradient norm counts every parameter once: a shard once per holder set, a parameter that
    tensor parallelism leaves whole only on TP rank 0.
    """

    def __init__(
        self, named_params: Sequence[tuple[str, torch.nn.Parameter]], tp_rank: int, rank_kinds: Sequence[str],
        rank_devices: Sequence[str], host_group: Any, bucket_mb: float = 25.0, replica: int | None = None,
    ):
        import torch.distributed as dist

        from starverse.runtime.mesh import MixedMesh

        world = dist.get_world_size()
        scope = "" if replica is None else f"r{replica}:"
        mine = [(f"{scope}{tp_rank}:{n}", p) for n, p in named_params if p.requires_grad]
        every: list[Any] = [None] * world
        dist.all_gather_object(every, [k for k, _ in mine], group=host_group)
        holders: dict[str, list[int]] = {}
        for r, keys in enumerate(every):
            for k in keys:
                holders.setdefault(k, []).append(r)
        self.owner = {k: rs[0] for k, rs in holders.items()}
        """The rank that counts each parameter once in the gradient norm (its first holder)."""
        by_set: dict[tuple[int, ...], list[torch.nn.Parameter]] = {}
        me = dist.get_rank()
        params = dict(mine)
        for k in sorted(holders):
            rs = tuple(holders[k])
            if me in rs and k in params:
                by_set.setdefault(rs, []).append(params[k])
        self.syncs: list[GradientSync] = []
        for rs in sorted({tuple(v) for v in holders.values() if len(v) > 1}):
            mesh = MixedMesh.build_over(rank_kinds, rank_devices, rs)  # collective: every rank, same order
            if mesh is not None:
                self.syncs.append(GradientSync(by_set[rs], mesh, bucket_mb, len(rs)))
        self._owned = [p for k, p in mine if self.owner[k] == me and (tp_rank == 0 or split_over_tp(p))]
        self._held = [p for _, p in mine]
        self._host = host_group
        self.blocked_s = 0.0
        """As :attr:`GradientSync.blocked_s` (always 0: the sums run after the schedule, not inside backward)."""

    def arm(self) -> None:
        """No overlap with backward: a pipeline's backward runs inside its schedule; :meth:`all_reduce` follows it."""

    def all_reduce(self) -> None:
        """Sum every held parameter's gradient over its holders, in place.

        A DTensor gradient laid out unlike its parameter is redistributed first (the input embedding of a first
        stage under tensor parallel gets a replicated gradient from the pipeline's backward), so the local parts
        summed, clipped and stepped are the parameter's own shard."""
        for p in self._held:
            if is_dtensor(p.grad) and p.grad.placements != p.placements:  # type: ignore[attr-defined]
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)  # type: ignore[attr-defined]
        for s in self.syncs:
            s.all_reduce()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The global gradient norm over all parameters (each counted once); scales gradients to ``max_norm``
        when it is above (``max_norm`` 0: only measured), as ``torch.nn.utils.clip_grad_norm_`` on one process."""
        import torch.distributed as dist

        sq = torch.zeros((), dtype=torch.float64)
        for p in self._owned:
            if p.grad is not None:
                sq += local(p.grad).detach().double().pow(2).sum().cpu()
        dist.all_reduce(sq, group=self._host)
        norm = sq.sqrt().float()
        if max_norm > 0:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for p in self._held:
                if p.grad is not None:
                    local(p.grad).mul_(coef.to(p.grad.device))
        return norm


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a DTensor (tensor parallel, ZeRO), else ``t`` itself."""
    return t.to_local() if is_dtensor(t) else t


def like(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` (a local tensor shaped as ``p``'s local part) as a gradient for ``p``: a DTensor laid out as ``p`` if
    ``p`` is one."""
    return type(p).from_local(t, p.device_mesh, p.placements, run_check=False) if is_dtensor(p) else t


def split_over_tp(p: torch.Tensor) -> bool:
    """``p`` is split over a tensor-parallel mesh dimension (named ``tp``): each TP rank holds a different part."""
    if not is_dtensor(p):
        return False
    names = p.device_mesh.mesh_dim_names or ()
    return any(n == "tp" and pl.is_shard() for n, pl in zip(names, p.placements, strict=False))
