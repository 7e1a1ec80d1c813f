"""Validation against published training runs: predicted vs measured tokens/s (``starverse validate``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field

from starverse.config import FrozenModel, parse, read_yaml, where
from starverse.costmodel.constants import FRAGMENTATION_FRACTION, NCCL_NVLINK_COMMUNICATOR_GB, RESERVED_GB
from starverse.errors import ConfigError, StarverseError
from starverse.plan import Plan, _resolve_model_path


class Measured(FrozenModel):
    """What was measured on a real run (any subset)."""

    tokens_per_s: float | None = Field(default=None, gt=0)
    """Whole-job training throughput."""
    tflops_per_device: float | None = Field(default=None, gt=0)
    """Model TFLOP/s per device."""
    step_time_s: float | None = Field(default=None, gt=0)
    """Seconds per optimizer step."""
    peak_memory_gb: float | None = Field(default=None, gt=0)
    """Peak memory the framework allocated on the worst device (GB = 1e9 bytes; what
    ``torch.cuda.max_memory_allocated`` reports, without the CUDA context)."""
    peak_memory_scope: Literal["allocated", "device"] = "allocated"
    """What ``peak_memory_gb`` counts: ``allocated`` (PyTorch's allocated peak: compared with the estimate's
    need minus the fixed reserve ``RESERVED_GB``) or ``device`` (the device's used memory, e.g. NVML: CUDA
    context, NCCL buffers and the allocator's reserve included: compared with the whole need)."""
    peak_memory_devices: Literal["all", "first_node"] = "all"
    """Which devices ``peak_memory_gb`` was read on: ``all`` (the largest over every device, e.g. the maximum
    over all ranks' logs) or ``first_node`` (a reading on the job's first node, e.g. ``nvidia-smi`` there: the
    largest over the devices of its first ``devices_per_node`` ranks, laid out as Megatron-DeepSpeed's
    ``PipeModelDataParallelTopology`` does, TP fastest, then data parallel, then pipeline: the stages of the
    first group whose first rank is on that node, ``first_node_stages``)."""
    out_of_memory: bool = False
    """The run failed for lack of device memory (the estimate must then say it does not fit)."""
    peak_memory_excluded: str = ""
    """Why ``peak_memory_gb`` is kept but not compared: the evidence that the logged figure cannot be what the
    plan as written held (e.g. below the parameters and stored activations its own code keeps, or far from a
    twin run with the same per-device layout). Empty: compared."""


class ValidationCase(Plan):
    """A plan that really ran, with its measurements and their source."""

    measured: Measured
    """Measured figures."""
    source: str = ""
    """Where the figures come from."""


@dataclass(frozen=True)
class CaseResult:
    """One case: prediction vs measurement, or why it could not be estimated."""

    name: str
    """File stem."""
    path: str
    """File path."""
    predicted: float | None
    """Predicted tokens/s."""
    measured: float | None
    """Measured tokens/s."""
    fits: bool
    """The estimator says the published plan fits in memory (it ran, so it must)."""
    reason: str | None = None
    """Why the case failed (not estimable, no measurement, reported as not fitting)."""
    source: str = ""
    """Source id: the case file name up to its first '-' (``korthikanti2022``, ``sailor``, ...)."""
    predicted_memory_gb: float | None = None
    """Predicted peak allocated memory of the worst device (the estimate's need minus the fixed runtime
    reserve, which ``max_memory_allocated`` does not count)."""
    measured_memory_gb: float | None = None
    """``measured.peak_memory_gb`` when given."""
    out_of_memory: bool = False
    """The source reports the run failed for memory."""
    memory_excluded: str = ""
    """``measured.peak_memory_excluded``: why the measured peak is not compared (no ``memory_error``)."""

    @property
    def error(self) -> float | None:
        """predicted / measured - 1."""
        if self.predicted is None or self.measured is None:
            return None
        return self.predicted / self.measured - 1.0

    @property
    def memory_error(self) -> float | None:
        """predicted / measured peak memory - 1."""
        if self.predicted_memory_gb is None or self.measured_memory_gb is None or self.memory_excluded:
            return None
        return self.predicted_memory_gb / self.measured_memory_gb - 1.0

    @property
    def ok(self) -> bool:
        """Estimated, measured and fits."""
        return self.reason is None


def source_of(path: Path) -> str:
    """A case's source id: its file name up to the first '-' (case files are named ``<source>-...``)."""
    return path.stem.split("-", 1)[0]


def find_cases(paths: list[str | Path]) -> list[Path]:
    """``*.yaml`` files in the given folders and their sub-folders (sorted; ``models/`` folders hold
    model configs, not cases), plus files given directly."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out.extend(sorted(f for f in p.rglob("*.yaml") if "models" not in f.relative_to(p).parts[:-1]))
        elif p.is_file():
            out.append(p)
        else:
            raise ConfigError(f"{p}: no such file or folder; pass validation case files or folders of them")
    return out


@dataclass(frozen=True)
class LoadedCase:
    """A parsed validation case: the plan, its model and what was measured."""

    name: str
    """File stem."""
    path: str
    """File path."""
    source: str
    """Source id (:func:`source_of`)."""
    plan: Plan
    """The plan that ran."""
    spec: Any
    """Its ``models.ModelSpec``."""
    measured: Measured
    """What was measured."""


def load_case(path: Path) -> LoadedCase:
    """Parse a case file and load its model; ConfigError names the file."""
    from starverse.models import load_model

    data, node = read_yaml(path)
    case = parse(ValidationCase, data, str(path), node)
    plan = Plan.model_validate(case.model_dump(exclude={"measured", "source"}, exclude_unset=True))
    plan = _resolve_model_path(plan, path.parent)
    try:
        spec = load_model(plan.model, base_dir=path.parent)
    except StarverseError as e:
        raise ConfigError(f"{where(path, ('model',))}: model: {e}") from None
    return LoadedCase(path.stem, str(path), source_of(path), plan, spec, case.measured)


def peak_reading_gb(need_gb: float, scope: str) -> float:
    """What a memory reading of ``scope`` shows for an estimated need (tensors + ``RESERVED_GB``):
    ``allocated`` (``torch.cuda.max_memory_allocated``) the tensors alone; ``device`` (NVML / nvidia-smi
    ``memory.used``) the whole reserve plus the caching allocator's cached-but-free blocks, which grow with
    what it hands out (``FRAGMENTATION_FRACTION`` of the tensors)."""
    tensors = need_gb - RESERVED_GB
    if scope == "allocated":
        return tensors
    return tensors * (1.0 + FRAGMENTATION_FRACTION) + RESERVED_GB


def nvlink_communicators(tp: int, replicas: int, stages: int, devices_per_node: int) -> list[int]:
    """Ranks of each NCCL communicator that one device of a Megatron-DeepSpeed pipeline stage shares with
    NVLink peers on its node (ranks laid out TP fastest, then data parallel, then pipeline): Megatron's
    tensor-parallel group (all-reduces every layer); DeepSpeed's pipeline grid's model-parallel group
    (tp x stages ranks: the engine all-reduces the parameter count over it at start, ``pipe/engine.py``);
    the world group (the pipe engine's ``dist.barrier()`` after the tied-gradient reduce of every step in
    Sailor's ``deepspeed/pipe_engine.py``); the data-parallel group and the pipeline neighbours' groups when
    their ranks share the node. Each appears where it holds at least two of the node's ranks."""
    world = tp * replicas * stages
    on_node = min(world, devices_per_node)
    groups = [(tp, tp), (tp * stages, min(tp * stages, on_node)), (world, on_node),
              (replicas, min(replicas, max(devices_per_node // tp, 1))),
              (2, 2 if stages > 1 and tp * replicas * 2 <= devices_per_node else 1)]
    return [size for size, local in groups if size >= 2 and local >= 2]


def _devices_per_node(case: LoadedCase, acc: Any) -> int:
    """Devices of ``acc``'s kind per node in the case's plan (``network.devices_per_node``, else the catalog's)."""
    return case.plan.network.node_size(acc)


def device_extra_gb(case: LoadedCase, group: int, stage: int, catalog: Any) -> float:
    """Device memory a whole-device reading holds beyond the estimate's need: the buffers of the NCCL
    communicators the stage's device shares with NVLink peers (``NCCL_NVLINK_COMMUNICATOR_GB`` each; none
    on PCIe or single-device nodes)."""
    g = case.plan.groups[group]
    st = g.expanded_stages()[stage]
    acc = catalog.accelerator(st.accelerator)
    if acc.intra_node_link != "nvlink":
        return 0.0
    dpn = _devices_per_node(case, acc)
    sizes = nvlink_communicators(st.tp, g.replicas, len(g.expanded_stages()), dpn)
    return sum(NCCL_NVLINK_COMMUNICATOR_GB[min(n, 3)] for n in sizes)


def first_node_stages(case: LoadedCase, catalog: Any) -> int:
    """Pipeline stages of the plan's first group with a device on the job's first node (at least 1): ranks are
    laid out TP fastest, then data parallel, then pipeline (Megatron-DeepSpeed's
    ``PipeModelDataParallelTopology``), so stage k starts at rank ``replicas x`` (the TP degrees of the stages
    before it) and is on the first node when that is below the node's device count."""
    g = case.plan.groups[0]
    stages = g.expanded_stages()
    acc = catalog.accelerator(stages[0].accelerator)
    per_node = _devices_per_node(case, acc)
    first_rank, n = 0, 0
    for st in stages:
        if first_rank >= per_node:
            break
        n += 1
        first_rank += st.tp * g.replicas
    return max(n, 1)


def score_case(case: LoadedCase, catalog: Any = None) -> CaseResult:
    """Estimate a loaded case and compare (see :func:`run_case`)."""
    from starverse.costmodel.step import estimate

    measured = case.measured.tokens_per_s
    try:
        est = estimate(case.plan, catalog, case.spec)
    except StarverseError as e:
        return CaseResult(case.name, case.path, None, measured, False,
                          reason=f"{where(case.path, getattr(e, 'loc', None))}: {e}",
                          source=case.source)
    scope = case.measured.peak_memory_scope
    if (scope == "device" or case.measured.peak_memory_devices == "first_node") and catalog is None:
        from starverse.catalog import load_catalog

        catalog = load_catalog()

    def reading(gi: int, si: int, s: Any) -> float:
        if scope != "device":
            return peak_reading_gb(s.total_gb, scope)
        # NVLink communicators' buffers, and the flat gradient copy's own allocator segment, which stays
        # reserved (StageMemory.flat_grad_segment_gb)
        return (peak_reading_gb(s.total_gb, scope) + device_extra_gb(case, gi, si, catalog)
                + s.flat_grad_segment_gb)

    # the largest reading over the devices read (a source's maximum over its ranks' logs, or its first node's)
    if case.measured.peak_memory_devices == "first_node":
        peak = max(reading(0, si, s) for si, s in enumerate(est.groups[0].stages[:first_node_stages(case, catalog)]))
    else:
        peak = max(reading(gi, si, s) for gi, g in enumerate(est.groups) for si, s in enumerate(g.stages))
    oom = case.measured.out_of_memory
    result = CaseResult(case.name, case.path, est.tokens_per_s, measured, est.fits, source=case.source,
                        predicted_memory_gb=peak, measured_memory_gb=case.measured.peak_memory_gb,
                        out_of_memory=oom, memory_excluded=case.measured.peak_memory_excluded)
    if oom:
        if est.fits:
            return replace(result, reason=f"the run failed for memory, but the estimator says it fits "
                                          f"({est.memory_gb:.1f} of {est.capacity_gb:.1f} GB)")
        return replace(result, measured=None)
    if measured is None:
        return replace(result, reason="no measured.tokens_per_s in the case")
    if not est.fits:
        return replace(result, reason=f"estimator says the plan does not fit ({est.memory_gb:.1f} of "
                                      f"{est.capacity_gb:.1f} GB), but it ran")
    return result


def run_case(path: Path, catalog: Any = None) -> CaseResult:
    """Estimate one case; errors become the case's ``reason`` (never silently skipped). A run that the
    source reports as failed for memory (``measured.out_of_memory``) passes when the estimate says it
    does not fit; a run that ran passes only when it fits."""
    try:
        case = load_case(path)
    except StarverseError as e:
        return CaseResult(path.stem, str(path), None, None, False, reason=str(e), source=source_of(path))
    return score_case(case, catalog)


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman rank correlation (average ranks for ties); NaN for fewer than 2 points."""
    if len(x) < 2:
        return float("nan")

    def ranks(v: list[float]) -> np.ndarray:
        a = np.asarray(v, dtype=np.float64)
        order = np.argsort(a, kind="mergesort")
        r = np.empty(len(a))
        r[order] = np.arange(len(a), dtype=np.float64)
        for val in np.unique(a):  # average ties
            idx = a == val
            r[idx] = r[idx].mean()
        return r

    rx, ry = ranks(x), ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


MIN_CONFIGS_FOR_SPEARMAN = 8
"""Sources with at least this many scored configurations carry the rank-correlation target."""


def summarize(results: list[CaseResult]) -> dict[str, Any]:
    """n, median/p90/max |error| and Spearman over the cases with both figures; the same for peak
    memory where measured (``memory_n``, ``memory_median_abs_error``, ``memory_max_abs_error``)."""
    scored = [r for r in results if r.error is not None]
    errs = np.abs(np.array([r.error for r in scored], dtype=np.float64))

    def stat(f: Any, e: np.ndarray) -> float | None:
        return float(f(e)) if len(e) else None

    rho = spearman([r.predicted for r in scored], [r.measured for r in scored])  # type: ignore[misc]
    mem = np.abs(np.array([r.memory_error for r in results if r.memory_error is not None], dtype=np.float64))
    return {
        "n": len(scored),
        "median_abs_error": stat(np.median, errs),
        "p90_abs_error": stat(lambda e: np.percentile(e, 90), errs),
        "max_abs_error": stat(np.max, errs),
        "spearman": None if math.isnan(rho) else rho,
        "memory_n": len(mem),
        "memory_median_abs_error": stat(np.median, mem),
        "memory_max_abs_error": stat(np.max, mem),
    }


def by_source(results: list[CaseResult]) -> dict[str, dict[str, Any]]:
    """:func:`summarize` per source id (sorted by id)."""
    sources = sorted({r.source for r in results})
    return {src: summarize([r for r in results if r.source == src]) for src in sources}


def report(results: list[CaseResult]) -> dict[str, Any]:
    """The ``--json`` document: ``{"cases": [...], "summary": {...}, "sources": {id: summary}}`` (failed
    cases have null figures; their reasons are in each ``CaseResult.reason``, which the CLI prints on
    stderr)."""
    cases = [{"name": r.name, "source": r.source, "metric": "tokens_per_s", "predicted": r.predicted,
              "measured": r.measured, "error": r.error, "predicted_memory_gb": r.predicted_memory_gb,
              "measured_memory_gb": r.measured_memory_gb, "memory_error": r.memory_error,
              "memory_excluded": r.memory_excluded or None, "out_of_memory": r.out_of_memory,
              "fits": r.fits} for r in results]
    return {"cases": cases, "summary": summarize(results), "sources": by_source(results)}


def load_plan_or_case(path: str | Path) -> Plan:
    """A plan file, or a validation case file (its ``measured``/``source`` are ignored)."""
    from starverse.plan import load_plan

    data, node = read_yaml(path)
    if isinstance(data, dict) and ("measured" in data or "source" in data):
        case = parse(ValidationCase, data, str(path), node)
        plan = Plan.model_validate(case.model_dump(exclude={"measured", "source"}, exclude_unset=True))
        return _resolve_model_path(plan, Path(path).parent)
    return load_plan(path)
