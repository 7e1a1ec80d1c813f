"""Jobs, checkpoints, bills, storage and the balance of the calling tenant.

Every route looks rows up with the tenant's id in the query: another tenant's job id is indistinguishable
from one that does not exist (404). Files are only ever reached below the tenant's own directory.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import FileResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool

from starverse.config import check_path_text
from starverse.service import jobs as jobs_lib
from starverse.service import storage
from starverse.service.app import context, current_tenant
from starverse.service.db import ACTIVE_STATES, Job, JobState, Tenant
from starverse.service.tenants import balance, balance_entries

router = APIRouter(prefix="/api", tags=["jobs"])
MAX_ID = jobs_lib.MAX_DB_INT
"""Largest row id or step a request may name (a larger one overflows the database's column: a 500)."""
TenantDep = Depends(current_tenant)
_NOT_FOUND = "no such job. To fix: list your jobs with GET /api/jobs"


class RollbackRequest(BaseModel):
    """``POST /api/jobs/{id}/rollback``."""

    model_config = ConfigDict(extra="forbid")
    step: int = Field(ge=0, le=MAX_ID, strict=True)  # strict: `true` is not step 1
    """A listed checkpoint step: the job resumes from it (later checkpoints are set aside)."""


class ResumeRequest(BaseModel):
    """``POST /api/jobs/{id}/resume``."""

    model_config = ConfigDict(extra="forbid")
    step: int | None = Field(default=None, ge=0, le=MAX_ID, strict=True)
    """Checkpoint step to resume from; omitted: the latest."""


def _job(request: Request, tenant: Tenant, job_id: str) -> Job:
    with context(request).db.session() as s:
        job = jobs_lib.get_job(s, tenant, job_id)
    if job is None:
        raise HTTPException(404, _NOT_FOUND)
    return job


@router.post("/jobs", status_code=201)
async def submit(request: Request, tenant: Tenant = TenantDep) -> dict[str, Any]:
    """Queue a training job: the job file's fields as JSON (``{"name", "job": {...}}``) or the YAML itself
    (``Content-Type: application/yaml``). Refused (402) while the tenant's balance is not positive."""
    ctx = context(request)
    body = jobs_lib.parse_body(await request.body(), request.headers.get("content-type", ""))
    bal = await run_in_threadpool(balance, ctx.db, ctx.settings, tenant)
    if bal.remaining_ticks <= 0:
        raise HTTPException(402, f"balance {bal.remaining} {bal.currency}: nothing left to run a job on. "
                                 "To fix: top up (`starverse serve tenant topup`)")
    job = await run_in_threadpool(jobs_lib.submit, ctx.db, ctx.settings, tenant, body)
    return jobs_lib.job_summary(job)


@router.get("/jobs")
def list_jobs(request: Request, tenant: Tenant = TenantDep, state: str | None = None,
              limit: int = Query(100, ge=1, le=1000)) -> list[dict[str, Any]]:
    """The tenant's jobs, newest first (``state``: only those in it; ``limit``: 1 to 1000)."""
    states = [x.value for x in JobState]
    if state and state not in states:
        raise HTTPException(422, f"state: {state[:40]!r} is not a job state. To fix: use one of {', '.join(states)}")
    with context(request).db.session() as s:
        q = select(Job).where(Job.tenant_id == tenant.id)
        if state:
            q = q.where(Job.state == state)
        rows = s.scalars(q.order_by(Job.created_at.desc()).limit(limit)).all()
        return [jobs_lib.job_summary(j) for j in rows]


@router.get("/jobs/{job_id}")
async def job_status(job_id: str, request: Request, tenant: Tenant = TenantDep) -> dict[str, Any]:
    """One job's state (reused for ``status_cache_s``; dropped at once when this server changes the job)."""
    async def load() -> dict[str, Any]:
        return jobs_lib.job_summary(await run_in_threadpool(_job, request, tenant, job_id))

    return await context(request).statuses.get((tenant.id, job_id), load)


@router.get("/jobs/{job_id}/progress")
def job_progress(job_id: str, request: Request, tenant: Tenant = TenantDep,
                 after: int = Query(0, ge=0, le=MAX_ID)) -> dict[str, Any]:
    """Samples newer than ``after`` (step, loss, tokens/s, shares per rank) and the job's events; poll it."""
    with context(request).db.session() as s:
        job = jobs_lib.get_job(s, tenant, job_id)
        if job is None:
            raise HTTPException(404, _NOT_FOUND)
        return jobs_lib.progress(s, job, after)


@router.get("/jobs/{job_id}/stream")
async def job_stream(job_id: str, request: Request, tenant: Tenant = TenantDep) -> StreamingResponse:
    """Server-sent events: one ``progress`` event per new batch of samples, ``end`` when the job stops."""
    ctx = context(request)
    _job(request, tenant, job_id)

    async def events() -> AsyncIterator[bytes]:
        after = 0
        while not await request.is_disconnected():
            doc = await run_in_threadpool(_progress_doc, ctx, tenant, job_id, after)
            if doc["samples"]:
                after = doc["samples"][-1]["id"]
                yield f"event: progress\ndata: {json.dumps(doc)}\n\n".encode()
            if doc["job"]["state"] not in ACTIVE_STATES:
                yield f"event: end\ndata: {json.dumps(doc['job'])}\n\n".encode()
                return
            await asyncio.sleep(0.5)

    return StreamingResponse(events(), media_type="text/event-stream")


def _progress_doc(ctx: Any, tenant: Tenant, job_id: str, after: int) -> dict[str, Any]:
    with ctx.db.session() as s:
        job = jobs_lib.get_job(s, tenant, job_id)
        assert job is not None
        return jobs_lib.progress(s, job, after)


@router.get("/jobs/{job_id}/logs", response_class=PlainTextResponse)
def job_logs(job_id: str, request: Request, tenant: Tenant = TenantDep) -> str:
    """The end of the job's log."""
    return jobs_lib.read_log(context(request).settings, _job(request, tenant, job_id))


@router.post("/jobs/{job_id}/stop")
def stop_job(job_id: str, request: Request, tenant: Tenant = TenantDep) -> dict[str, Any]:
    """Stop the job: a running one writes an emergency checkpoint first; a queued one never starts."""
    ctx = context(request)
    with ctx.db.session() as s:
        job = jobs_lib.get_job(s, tenant, job_id)
        if job is None:
            raise HTTPException(404, _NOT_FOUND)
        if job.state == JobState.QUEUED.value:
            job.state, job.stop_reason, job.finished_at = JobState.STOPPED.value, "stopped before it ran", time.time()
            ctx.db.add_event(s, job.id, "stopped", job.stop_reason)
        elif job.state == JobState.RUNNING.value:
            job.stop_requested = True
            ctx.db.add_event(s, job.id, "stop requested", "")
        else:
            raise HTTPException(409, f"job is {job.state}, not running. To fix: resume it first")
        ctx.job_changed(job.id)
        return jobs_lib.job_summary(job)


def _requeue(request: Request, tenant: Tenant, job_id: str, step: int | None, kind: str) -> dict[str, Any]:
    ctx = context(request)
    job = _job(request, tenant, job_id)
    if step is not None and step not in {c["step"] for c in jobs_lib.checkpoints(ctx.settings, job)}:
        raise HTTPException(422, f"step: no checkpoint at step {step}. To fix: pick one of GET "
                                 f"/api/jobs/{job_id}/checkpoints")
    with ctx.db.session() as s:
        row = jobs_lib.get_job(s, tenant, job_id)
        if row is None:
            raise HTTPException(404, _NOT_FOUND)
        job = row
        if job.state in ACTIVE_STATES:
            raise HTTPException(409, f"job is {job.state}. To fix: stop it first")
        job.state, job.resume_from, job.stop_reason, job.finished_at = JobState.QUEUED.value, step, None, None
        job.updated_at = time.time()
        ctx.db.add_event(s, job.id, kind, "from the latest checkpoint" if step is None else f"from step {step}")
        ctx.job_changed(job.id)
        return jobs_lib.job_summary(job)


@router.post("/jobs/{job_id}/resume")
def resume_job(job_id: str, body: ResumeRequest, request: Request, tenant: Tenant = TenantDep) -> dict[str, Any]:
    """Queue a stopped or failed job again, from its latest checkpoint or a given step."""
    return _requeue(request, tenant, job_id, body.step, "resume")


@router.post("/jobs/{job_id}/rollback")
def rollback_job(job_id: str, body: RollbackRequest, request: Request,
                 tenant: Tenant = TenantDep) -> dict[str, Any]:
    """Resume from an earlier checkpoint (the job must be stopped, failed or finished)."""
    return _requeue(request, tenant, job_id, body.step, "rollback")


@router.get("/jobs/{job_id}/checkpoints")
def job_checkpoints(job_id: str, request: Request, tenant: Tenant = TenantDep) -> list[dict[str, Any]]:
    """The job's complete checkpoints."""
    return jobs_lib.checkpoints(context(request).settings, _job(request, tenant, job_id))


@router.get("/jobs/{job_id}/bill")
def job_bill(job_id: str, request: Request, tenant: Tenant = TenantDep) -> dict[str, Any]:
    """The job's bill: charges per lease, insurance credits, net; the ledger's events."""
    bill = jobs_lib.job_bill(context(request).settings, _job(request, tenant, job_id))
    return bill or {"job": job_id, "leases": [], "credits": [], "events": [], "charges": "0", "credit": "0",
                    "net": "0", "open_leases": 0}


@router.get("/jobs/{job_id}/files")
def job_files(job_id: str, request: Request, tenant: Tenant = TenantDep) -> list[dict[str, Any]]:
    """The job's run files (paths relative to its folder)."""
    folder = jobs_lib.job_dir(context(request).settings, _job(request, tenant, job_id))
    return [{"path": str(p.relative_to(folder)), "bytes": p.stat().st_size}
            for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink() and not p.name.startswith(".")]


@router.get("/jobs/{job_id}/files/{rel:path}")
def job_file(job_id: str, rel: str, request: Request, tenant: Tenant = TenantDep) -> FileResponse:
    """One run file; a path that leaves the job's folder answers 404."""
    folder = jobs_lib.job_dir(context(request).settings, _job(request, tenant, job_id)).resolve()
    missing = HTTPException(404, "no such file in this job. To fix: list them with GET /api/jobs/{id}/files")
    try:
        check_path_text(rel, "file path")  # a NUL byte or an over-long name: no file has it
        target = (folder / rel).resolve()
        found = target.is_relative_to(folder) and target.is_file()
    except (ValueError, OSError):
        found = False
    if not found:
        raise missing
    return FileResponse(target)


@router.get("/bill")
def tenant_bill(request: Request, tenant: Tenant = TenantDep, by: str = "job") -> dict[str, Any]:
    """The tenant's bill by job or by day, its balance, and its payments (sign-up credit, top-ups; from its
    ledger)."""
    if by not in ("job", "day"):
        raise HTTPException(422, "by: use 'job' or 'day'")
    ctx = context(request)
    out = jobs_lib.tenant_bill(ctx.settings, tenant, by)
    out["balance"] = balance(ctx.db, ctx.settings, tenant).as_dict()
    out["payments"] = balance_entries(ctx.settings, tenant)
    return out


@router.get("/balance")
def get_balance(request: Request, tenant: Tenant = TenantDep) -> dict[str, Any]:
    """Prepaid balance: paid in (sign-up credit, top-ups), charged, insurance credits, remaining."""
    ctx = context(request)
    return {**balance(ctx.db, ctx.settings, tenant).as_dict(), "entries": balance_entries(ctx.settings, tenant)}


def _kind(kind: str) -> storage.Kind:
    if kind not in storage.KINDS:
        raise HTTPException(404, "no such collection: use datasets or models")
    return kind  # type: ignore[return-value]


@router.get("/storage/{kind}")
def list_stored(kind: str, request: Request, tenant: Tenant = TenantDep) -> dict[str, Any]:
    """The tenant's datasets or models and the platform's registered ones, with the tenant's usage."""
    k = _kind(kind)
    st = context(request).settings
    return {"items": storage.list_items(st, tenant.id, k), "used_bytes": storage.used_bytes(st, tenant.id),
            "quota_bytes": tenant.quota_bytes}


@router.put("/storage/{kind}/{name}", status_code=201)
async def upload(kind: str, name: str, request: Request, tenant: Tenant = TenantDep) -> dict[str, Any]:
    """Upload a dataset (a text or .jsonl file) or a model config (config.json) under ``name``."""
    k = _kind(kind)
    storage.check_name(name)
    st = context(request).settings
    chunks = [c async for c in request.stream()]
    size = await run_in_threadpool(storage.store, st, tenant.id, k, name, chunks, tenant.quota_bytes)
    return {"name": name, "bytes": size, "used_bytes": storage.used_bytes(st, tenant.id)}


@router.delete("/storage/{kind}/{name}")
def delete_stored(kind: str, name: str, request: Request, tenant: Tenant = TenantDep) -> dict[str, Any]:
    """Delete one of the tenant's datasets or models (never a platform one)."""
    storage.delete(context(request).settings, tenant.id, _kind(kind), name)
    return {"deleted": name}
