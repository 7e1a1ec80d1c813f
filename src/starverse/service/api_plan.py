"""Catalog, models, estimate, plan and validate: the planning library behind HTTP.

Bodies carry the files the CLI reads (a plan, a job and a pool, a validation case) as JSON objects, or as
YAML text in ``*_yaml`` fields; they are written to a scratch folder and loaded by the library's own loaders,
so the service accepts and rejects exactly what the CLI does, with the same messages.

A plan request is bounded, so that one tenant cannot hold the planner process for minutes: a pool of more
than ``max_plan_offers`` offers or ``max_plan_devices`` devices is refused before any search (422), and a
search that runs past ``plan_time_limit_s`` is stopped (:class:`~starverse.errors.SearchTimeLimitError`,
422) — the planner process is free for the next request at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import yaml
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from starverse.config import MAX_COUNT, parse_yaml_text
from starverse.errors import ConfigError, InfeasiblePlanError, SearchTimeLimitError

router = APIRouter(prefix="/api", tags=["planning"])


class FileBody(BaseModel):
    """A file given inline: an object, or YAML text."""

    model_config = ConfigDict(extra="forbid")


class EstimateRequest(FileBody):
    """``POST /api/estimate``."""

    plan: dict[str, Any] | None = None
    """The plan file's fields (DESIGN.md plan.yaml)."""
    plan_yaml: str | None = Field(default=None, max_length=200_000)
    """Or the plan file as YAML text."""


class PlanRequest(FileBody):
    """``POST /api/plan``."""

    job: dict[str, Any] | None = None
    """The planning job (model, train, objective, constraints)."""
    job_yaml: str | None = Field(default=None, max_length=200_000)
    pool: dict[str, Any] | None = None
    """The pool (offers that can be rented)."""
    pool_yaml: str | None = Field(default=None, max_length=200_000)
    top: int = Field(default=5, ge=1, le=50)
    """How many ranked plans to return."""


class ValidateRequest(FileBody):
    """``POST /api/validate``: one validation case (a plan plus what was measured)."""

    case: dict[str, Any] | None = None
    case_yaml: str | None = Field(default=None, max_length=200_000)


def _file(folder: Path, name: str, obj: dict[str, Any] | None, text: str | None) -> Path:
    """Write the inline file ``name`` (object or YAML text) into ``folder``; a model path may not escape."""
    if (obj is None) == (text is None):
        raise ConfigError(f"{name}: give exactly one of '{name}' (an object) or '{name}_yaml' (YAML text)")
    if text is not None:
        # read as a file is: a key given twice, an alias bomb, a nesting thousands deep are refused
        try:
            obj = parse_yaml_text(text, "text")[0]
        except ConfigError as e:
            raise ConfigError(f"{name}_yaml: not valid YAML ({e})") from None
        if not isinstance(obj, dict):
            raise ConfigError(f"{name}_yaml: expected a mapping of the {name} file's fields")
    assert obj is not None
    model = obj.get("model")
    if isinstance(model, str) and (".." in model or model.startswith(("/", "~")) or model.endswith(".json")):
        raise ConfigError(f"{name}: model: {model!r}: give a registry id (GET /api/models); the service does not "
                          "read model files by path")
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(obj, sort_keys=False))
    return path


def _clean(message: str, folder: Path) -> str:
    return message.replace(str(folder) + "/", "").replace(str(folder), ".")


@router.get("/catalog")
def catalog() -> dict[str, Any]:
    """Accelerators (figures with their sources) and the bundled offers."""
    from starverse.catalog import load_catalog

    cat = load_catalog()
    return {"accelerators": [a.to_dict() for a in cat.accelerators.values()],
            "offers": [dataclasses.asdict(o) for o in cat.offers]}


@router.get("/models")
def models() -> list[dict[str, Any]]:
    """The bundled model registry."""
    from starverse.models import list_models

    return [s.summary() for s in list_models()]


def _scratch_base(request: Request) -> Path:
    from starverse.service.app import context

    base = context(request).settings.root / "scratch"
    base.mkdir(parents=True, exist_ok=True)
    return base


def _scratch(request: Request) -> tempfile.TemporaryDirectory[str]:
    return tempfile.TemporaryDirectory(dir=_scratch_base(request))


@router.post("/estimate")
def estimate(body: EstimateRequest, request: Request) -> dict[str, Any]:
    """Step time, tokens/s, MFU, memory per device, cost and power of a plan."""
    from starverse.catalog import load_catalog
    from starverse.costmodel import estimate as run_estimate
    from starverse.costmodel.validate import load_plan_or_case
    from starverse.models import load_model

    with _scratch(request) as d:
        folder = Path(d)
        path = _file(folder, "plan", body.plan, body.plan_yaml)
        try:
            plan = load_plan_or_case(path)
            est = run_estimate(plan, load_catalog(), load_model(plan.model))
        except ConfigError as e:
            raise type(e)(_clean(str(e), folder)) from None
        out: dict[str, Any] = est.to_dict()
        return out


def check_pool_size(body: PlanRequest, max_offers: int, max_devices: int) -> None:
    """ConfigError when the request's pool has more than ``max_offers`` offers or ``max_devices`` devices (what
    is malformed otherwise is left to the pool's loader, which names its line)."""
    pool: Any = body.pool
    if body.pool_yaml is not None:
        try:
            pool = parse_yaml_text(body.pool_yaml, "text")[0]
        except ConfigError:
            return
    offers = pool.get("offers") if isinstance(pool, dict) else None
    if not isinstance(offers, list):
        return
    fix = "or run `starverse plan` on your own machine, which has no limit"
    if len(offers) > max_offers:
        raise ConfigError(f"pool.offers: {len(offers):,} offers; the service plans pools of at most {max_offers}. "
                          f"To fix: keep the offers you would rent from, {fix}")
    # a count the loader refuses (not an int, past MAX_COUNT) is left to it
    devices = sum(o["count"] for o in offers
                  if isinstance(o, dict) and o.get("count").__class__ is int and 0 < o["count"] <= MAX_COUNT)
    if devices > max_devices:
        raise ConfigError(f"pool.offers: {devices:,} devices in all; the service plans at most {max_devices:,} at "
                          f"once. To fix: give fewer devices (count), {fix}")


REFIRE_S = 0.001
"""How soon the search's alarm fires again when Python dropped its exception (raised inside a finalizer)."""


@contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise SearchTimeLimitError in this thread once ``seconds`` have passed (SIGALRM: the main thread of a
    process only, which a planner process's task runs in; elsewhere, or with None, no limit)."""
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(signum: int, frame: FrameType | None) -> None:
        raise SearchTimeLimitError(
            f"the plan search ran past the service's limit of {seconds:g} s. To fix: fewer offers or devices in "
            "the pool, a smaller train.global_batch, or run `starverse plan` on your own machine (no limit)")

    previous_hook = sys.unraisablehook

    def swallowed(unraisable: Any) -> None:
        # the alarm fired inside a finalizer or a weakref callback (a gc pass: "Exception ignored in"), where
        # Python drops what it raises: fire again at once, in the search's own code
        if isinstance(unraisable.exc_value, SearchTimeLimitError):
            signal.setitimer(signal.ITIMER_REAL, REFIRE_S)
            return
        previous_hook(unraisable)

    previous = signal.signal(signal.SIGALRM, expired)
    sys.unraisablehook = swallowed
    start = time.monotonic()
    earlier, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        # an alarm set before (pytest-timeout's) is set again with what was left of it
        left = max(earlier - (time.monotonic() - start), 1e-6) if earlier > 0 else 0.0
        signal.setitimer(signal.ITIMER_REAL, left)
        signal.signal(signal.SIGALRM, previous)
        sys.unraisablehook = previous_hook


def plan_document(scratch: str, body: dict[str, Any], time_limit_s: float | None = None) -> dict[str, Any]:
    """The ``/api/plan`` answer for a :class:`PlanRequest` (as a dict); runs in a planner process, stopped
    with SearchTimeLimitError after ``time_limit_s``."""
    with time_limit(time_limit_s):
        return _plan_document(scratch, body)


def _plan_document(scratch: str, body: dict[str, Any]) -> dict[str, Any]:
    from starverse.catalog import load_catalog
    from starverse.checks import check_model
    from starverse.cli.plan import _finite, result_to_json
    from starverse.planner import load_job, load_pool, search
    from starverse.planner.policy import describe

    req = PlanRequest.model_validate(body)
    with tempfile.TemporaryDirectory(dir=scratch) as d:
        folder = Path(d)
        job_path = _file(folder, "job", req.job, req.job_yaml)
        pool_path = _file(folder, "pool", req.pool, req.pool_yaml)
        cat = load_catalog()
        try:
            job = load_job(job_path)
            check_model(job.model, job_path)  # an unknown model names the job's model: line, as `plan` does
            result = search(job, load_pool(pool_path, cat), cat, top=req.top)
        except InfeasiblePlanError as e:
            return {"feasible": False, "message": _clean(str(e), folder), "reasons": list(e.reasons)}
        except ConfigError as e:
            raise ConfigError(_clean(str(e), folder)) from None
        doc: dict[str, Any] = _finite(result_to_json(result))
        doc["feasible"] = True
        doc["chosen"] = describe(result.objective, result.best.objective_value, result.currency)
        return doc


@router.post("/plan")
async def plan(body: PlanRequest, request: Request) -> dict[str, Any]:
    """Ranked plans, the time/cost Pareto frontier and why each plan ranks where it does; an infeasible job
    answers ``feasible: false`` with the reasons and what would make it feasible.

    The search runs in a separate planner process: it is CPU-bound Python, and in the server's own process
    it would hold the interpreter lock and stall every other request (job status included). A search is a
    deterministic function of the job, the pool, ``top`` and the catalog: identical requests (same canonical
    job and pool, same catalog version) are answered from the last ``plan_cache_entries`` answers, or wait
    for the identical search already running."""
    from starverse.catalog.loader import catalog_version
    from starverse.service.app import context
    from starverse.service.cache import plan_key

    ctx = context(request)
    st = ctx.settings
    await run_in_threadpool(check_pool_size, body, st.max_plan_offers, st.max_plan_devices)
    dump = body.model_dump()
    key = await run_in_threadpool(plan_key, dump, catalog_version())
    scratch = str(_scratch_base(request))

    async def search() -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        doc: dict[str, Any] = await loop.run_in_executor(ctx.planner_pool(), plan_document, scratch, dump,
                                                         st.plan_time_limit_s)
        return doc

    return await ctx.plans.get(key, search)


@router.post("/validate")
def validate(body: ValidateRequest, request: Request) -> dict[str, Any]:
    """The cost model's prediction for a run that really happened, against what was measured."""
    from starverse.catalog import load_catalog
    from starverse.costmodel.validate import load_case, score_case

    with _scratch(request) as d:
        folder = Path(d)
        path = _file(folder, "case", body.case, body.case_yaml)
        try:  # a malformed case is the request's fault (422), as `starverse validate` exits 2 for it
            case = load_case(path)
        except ConfigError as e:
            raise type(e)(_clean(str(e), folder)) from None
        r = score_case(case, load_catalog())
        return {"ok": r.ok, "predicted_tokens_per_s": r.predicted, "measured_tokens_per_s": r.measured,
                "fits": r.fits, "error": r.error,
                "reason": _clean(r.reason, folder) if r.reason else None}
