"""The search space of one device group, and its time-per-batch-share table.

An *option* is one way to run a group on one offer: ``tp × pp × replicas`` devices, a micro-batch size and
the memory settings (ZeRO stage, recompute, offload). Its **time table** ``T[s]`` gives the group's step time
when it processes ``s`` sequences of the global batch per step (``s = replicas × micro_batch × k`` for an
integer number of micro-batches ``k``; ``inf`` where ``s`` is not such a multiple or the group does not fit
in memory). Time tables make heterogeneous data parallelism exact and cheap: a combination of groups runs
at ``min over Σ s_i = B of max_i T_i[s_i]`` (plus the cross-group gradient sync).

Everything is struct-of-arrays over options and evaluated with ``costmodel.batch.estimate_batch``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import product
from typing import Any

import numpy as np
import numpy.typing as npt

from starverse.costmodel.batch import (
    OFFLOAD_CODES,
    RECOMPUTE_CODES,
    Candidates,
    DeviceTable,
    ModelShape,
    TrainShape,
    estimate_batch,
)

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

RECOMPUTE_NAMES = {v: k for k, v in RECOMPUTE_CODES.items()}
SEARCHED_RECOMPUTE = ("none", "matmuls", "full")
"""Recompute modes a search tries where the job leaves it open: what the runtime runs, priced as it runs it
(``matmuls``: ``runtime/parallel/recompute.py`` keeps the matmul outputs for ``selective`` too, where the cost model's
``selective`` is Korthikanti et al.'s, the attention core alone). A job may still fix ``selective``."""
OFFLOAD_NAMES = {v: k for k, v in OFFLOAD_CODES.items()}
MICRO_BATCHES = (1, 2, 4, 8)
"""Micro-batch sizes tried (sequences); larger ones rarely help once a pipeline is full."""


@dataclass(frozen=True)
class Setting:
    """Training settings a whole plan shares (the plan format has one ``train:`` for all groups)."""

    zero_stage: int
    """ZeRO stage."""
    recompute: int
    """``RECOMPUTE_CODES`` value."""
    offload: int
    """``OFFLOAD_CODES`` value."""
    virtual_stages: int = 1
    """Model chunks per device: 1 is 1F1B, more the interleaved 1F1B schedule (pipelines only)."""


def settings(fixed_zero: int | None, fixed_recompute: str | None, fixed_offload: str | None,
             pipeline: bool, max_virtual_stages: int = 1) -> list[Setting]:
    """Memory settings worth trying, then each pipeline-capable one again with the interleaved 1F1B schedule
    at ``2..max_virtual_stages`` chunks per device (:func:`enumerate_options` keeps those for pipelines
    whose stages split into that many chunks).

    ZeRO-2/3 shard gradients/weights across data-parallel ranks, which conflicts with pipeline
    parallelism's per-micro-batch gradient accumulation (DeepSpeed refuses the combination), so pipelines
    use ZeRO ≤ 1. Optimizer offload needs ZeRO ≥ 1 (the offloaded state is the ZeRO shard) and parameter
    offload needs ZeRO-3 (as in ZeRO-Infinity).
    """
    out = []
    zeros = [fixed_zero] if fixed_zero is not None else [0, 1, 2, 3]
    rcs = [RECOMPUTE_CODES[fixed_recompute]] if fixed_recompute else [RECOMPUTE_CODES[r] for r in SEARCHED_RECOMPUTE]
    offs = [OFFLOAD_CODES[fixed_offload]] if fixed_offload else [0, 1, 2]
    for z, rc, off in product(zeros, rcs, offs):
        if pipeline and z > 1:
            continue
        if off == 1 and z < 1:
            continue
        if off == 2 and z < 3:
            continue
        out.append(Setting(z, rc, off))
    return out + [Setting(st.zero_stage, st.recompute, st.offload, v) for v in range(2, max_virtual_stages + 1)
                  for st in out if st.zero_stage <= 1]


def offer_caps(offers: Sequence[Any], budget_per_hour: float | None) -> list[int]:
    """Devices each offer can contribute: its count, or fewer when the hourly budget rents fewer."""
    caps = []
    for o in offers:
        cap = o.count
        if budget_per_hour is not None and o.price_per_hour > 0:
            cap = min(cap, math.floor(budget_per_hour / o.price_per_hour + 1e-9))
        caps.append(cap)
    return caps


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n`` in increasing order."""
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_degrees(spec: Any, devices_per_node: int, count: int) -> list[int]:
    """TP degrees: divide the attention and KV heads, stay inside one node, and fit the offer."""
    g = math.gcd(int(spec.num_heads), int(spec.num_kv_heads))
    return [t for t in divisors(g) if t <= devices_per_node and t <= count]


def pp_depths(num_layers: int, max_depth: int) -> list[int]:
    """Pipeline depths: 1-8, divisors of the layer count, powers of two (bounded by ``max_depth``)."""
    cand = set(range(1, 9)) | set(divisors(num_layers)) | {2**i for i in range(12)}
    return sorted(d for d in cand if d <= min(num_layers, max_depth))


def replica_counts(max_replicas: int, dense_up_to: int = 32, growth: float = 1.25) -> list[int]:
    """Replica counts: every value up to ``dense_up_to``, then a geometric grid, always the maximum.

    Small pools are thus searched completely; on large ones the grid keeps the search fast while the step
    between neighbours (``growth``) bounds how far from the best replica count the search can land.
    """
    vals = set(range(1, min(max_replicas, dense_up_to) + 1))
    x = float(dense_up_to)
    while x < max_replicas:
        x *= growth
        vals.add(min(round(x), max_replicas))
    vals.add(max_replicas)
    return sorted(v for v in vals if v >= 1)


@dataclass(frozen=True)
class Options:
    """Struct of arrays over candidate groups (options) of all offers."""

    offer: IntArray
    """Offer index (row of the device table)."""
    tp: IntArray
    """Tensor-parallel degree."""
    pp: IntArray
    """Pipeline depth."""
    replicas: IntArray
    """Data-parallel replicas."""
    micro_batch: IntArray
    """Sequences per micro-batch."""
    setting: IntArray
    """Index into the search's list of :class:`Setting`."""

    def __len__(self) -> int:
        return int(self.tp.shape[0])

    @property
    def num_devices(self) -> IntArray:
        """Devices rented by the option."""
        return self.tp * self.pp * self.replicas

    def take(self, idx: Any) -> Options:
        """Subset by index or mask."""
        return Options(*(np.asarray(getattr(self, f))[idx] for f in
                         ("offer", "tp", "pp", "replicas", "micro_batch", "setting")))


def enumerate_options(spec: Any, global_batch: int, offers: Sequence[Any], setting_list: Sequence[Setting],
                      fixed_micro_batch: int | None = None, max_devices: Sequence[int] | None = None,
                      dense_replicas_up_to: int = 32, growth: float = 1.25, max_tp: int | None = None,
                      max_pipeline_stages: int | None = None, use_all_devices: bool = False) -> Options:
    """Every (offer, tp, pp, replicas, micro-batch, setting) the space holds, before any evaluation.

    ``max_devices[i]`` caps offer ``i`` (its count, or less when the budget allows fewer). Replica counts
    follow :func:`replica_counts` per row (vectorised: one mask over a shared grid). ``max_tp`` and
    ``max_pipeline_stages`` bound TP and pipeline depth; ``use_all_devices`` keeps only the options that use
    every device of their offer (``tp × pp × replicas = count``).
    """
    base: list[tuple[int, int, int, int, int, int]] = []
    mbs = [fixed_micro_batch] if fixed_micro_batch else [m for m in MICRO_BATCHES if m <= global_batch]
    pipe_settings = [i for i, st in enumerate(setting_list) if st.zero_stage <= 1]
    all_settings = [i for i, st in enumerate(setting_list) if st.virtual_stages == 1]
    layers = int(spec.num_layers)
    for oi, off in enumerate(offers):
        cap = off.count if max_devices is None else min(off.count, max_devices[oi])
        if cap < 1 or (use_all_devices and cap < off.count):
            continue
        for tp in tp_degrees(spec, off.devices_per_node, cap):
            if max_tp is not None and tp > max_tp:
                continue
            max_pp = cap // tp if max_pipeline_stages is None else min(cap // tp, max_pipeline_stages)
            for pp in pp_depths(int(spec.num_layers), max_pp):
                if use_all_devices and cap % (tp * pp):
                    continue
                # interleaved: every stage splits into v chunks of whole layers
                sets = all_settings if pp == 1 else [i for i in pipe_settings if setting_list[i].virtual_stages == 1
                                                     or layers % (pp * setting_list[i].virtual_stages) == 0]
                for mb in mbs:
                    rmax = min(cap // (tp * pp), global_batch // mb)
                    if use_all_devices and rmax * tp * pp != cap:
                        continue  # all the devices cannot take a micro-batch each
                    if rmax >= 1:
                        base.extend((oi, tp, pp, mb, si, rmax) for si in sets)
    if not base:
        z = np.zeros(0, dtype=np.int64)
        return Options(z, z, z, z, z, z)
    b = np.asarray(base, dtype=np.int64)
    if use_all_devices:  # one replica count per row: all of the offer's devices
        return Options(b[:, 0], b[:, 1], b[:, 2], b[:, 5], b[:, 3], b[:, 4])
    grid = np.asarray(replica_counts(int(b[:, 5].max()), dense_replicas_up_to, growth), dtype=np.int64)
    # the grid's points below each row's maximum, plus that maximum itself
    mask = grid[None, :] < b[:, 5:6]
    rows, cols = np.nonzero(mask)
    reps = grid[cols]
    rows = np.concatenate([rows, np.arange(b.shape[0])])
    reps = np.concatenate([reps, b[:, 5]])
    order = np.lexsort((reps, rows))
    rows, reps = rows[order], reps[order]
    return Options(b[rows, 0], b[rows, 1], b[rows, 2], reps, b[rows, 3], b[rows, 4])


def candidates_for(opts: Options, setting_list: Sequence[Setting], num_micro_batches: IntArray) -> Candidates:
    """Batch-API candidates for ``opts`` with ``num_micro_batches`` micro-batches per replica."""
    z = np.array([s.zero_stage for s in setting_list], dtype=np.int64)
    rc = np.array([s.recompute for s in setting_list], dtype=np.int64)
    of = np.array([s.offload for s in setting_list], dtype=np.int64)
    return Candidates.make(
        accelerator=opts.offer, tp=opts.tp, pp=opts.pp, replicas=opts.replicas, micro_batch=opts.micro_batch,
        num_micro_batches=num_micro_batches, zero_stage=z[opts.setting], recompute=rc[opts.setting],
        offload=of[opts.setting], sequence_parallel=opts.tp > 1,
    )


@dataclass(frozen=True)
class Evaluated:
    """What the search reads of the batch estimate of some (option, micro-batch count) rows."""

    fits: npt.NDArray[np.bool_]
    step_time_s: FloatArray
    power_kw: FloatArray
    memory_gb: FloatArray


def estimate_rows(model: ModelShape, train: TrainShape, devices: DeviceTable, opts: Options,
                  setting_list: Sequence[Setting], num_micro_batches: IntArray, runnable: bool = True) -> Evaluated:
    """The batch cost model over options with ``num_micro_batches`` per replica, each under its setting's
    schedule (one batch call per chunk count). ``runnable``: interleaved rows whose micro-batch count is not
    a multiple of the stages do not fit (the runtime's interleaved schedule refuses them); without it,
    ``fits`` is memory alone (which never grows with the replicas: the screening's probe)."""
    v_of = np.array([st.virtual_stages for st in setting_list], dtype=np.int64)[opts.setting]
    n = len(opts)
    fits = np.zeros(n, dtype=bool)
    step = np.full(n, np.inf)
    power = np.zeros(n)
    memory = np.zeros(n)
    for v in np.unique(v_of):
        idx = np.flatnonzero(v_of == v)
        tr = train if v == 1 else replace(train, schedule="interleaved", virtual_stages=int(v))
        est = estimate_batch(model, tr, devices, candidates_for(opts.take(idx), setting_list, num_micro_batches[idx]))
        ok = np.asarray(est.fits, dtype=bool)
        if v > 1 and runnable:
            ok = ok & (num_micro_batches[idx] % opts.pp[idx] == 0)
        fits[idx] = ok
        step[idx] = np.asarray(est.step_time_s, dtype=np.float64)
        power[idx] = np.asarray(est.power_kw, dtype=np.float64)
        memory[idx] = np.asarray(est.memory_gb, dtype=np.float64)
    return Evaluated(fits, step, power, memory)


def evaluate_full_share(model: ModelShape, train: TrainShape, devices: DeviceTable, opts: Options,
                        setting_list: Sequence[Setting], global_batch: int) -> tuple[Evaluated, IntArray]:
    """Evaluate each option as if it processed as much of the batch as it can (``k = B // (r·mb)``), for
    screening: ``fits`` is memory alone (:func:`estimate_rows`; the time tables apply the schedule's rule)."""
    k = global_batch // (opts.replicas * opts.micro_batch)
    return estimate_rows(model, train, devices, opts, setting_list, k, runnable=False), k


def micro_batch_counts(kmax: int, dense_up_to: int | None) -> IntArray:
    """Micro-batch counts per replica whose step time is tabulated: all of ``1..kmax``, or (screened
    searches) every count up to ``dense_up_to``, then a ×1.25 grid, always ``kmax`` itself."""
    if dense_up_to is None or kmax <= dense_up_to:
        return np.arange(1, kmax + 1, dtype=np.int64)
    return np.asarray(replica_counts(kmax, dense_up_to, 1.25), dtype=np.int64)


def time_tables(model: ModelShape, train: TrainShape, devices: DeviceTable, opts: Options,
                setting_list: Sequence[Setting], global_batch: int, dense_k_up_to: int | None = None
                ) -> tuple[FloatArray, FloatArray, int]:
    """``T[option, s]`` for ``s = 0..B`` (inf where unreachable, not tabulated or not fitting), the power per
    option, and the number of rows evaluated. One batch-API call over every (option, k) pair."""
    n = len(opts)
    table = np.full((n, global_batch + 1), np.inf)
    power = np.zeros(n)
    if n == 0:
        return table, power, 0
    gran = opts.replicas * opts.micro_batch
    kmax = global_batch // gran
    ks = [micro_batch_counts(int(k), dense_k_up_to) for k in kmax]
    rows = np.repeat(np.arange(n), [len(k) for k in ks])
    k = np.concatenate(ks)
    est = estimate_rows(model, train, devices, opts.take(rows), setting_list, k)
    t = np.where(est.fits, est.step_time_s, np.inf)
    table[rows, gran[rows] * k] = t
    power[rows] = est.power_kw
    return table, power, int(rows.shape[0])
