"""Submitting a tenant's training job and reading back what it did.

A submitted job is the job file of ``starverse train`` (:class:`starverse.elastic.job.TrainJob`) given as
JSON or YAML, minus everything that names a place on the server: the service sets the run directory
(``ROOT/tenants/<tenant>/jobs/<id>/run``, its ledger inside), the job's name in the ledger (the job id)
and the metrics port; ``dataset`` and ``model`` are names resolved through :mod:`starverse.service.storage`
and ``pool``/``plan`` are given inline. The file is then loaded by the library's own loader, so the service
accepts exactly what ``starverse train`` accepts, with the same messages.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from sqlalchemy import select
from sqlalchemy.orm import Session

from starverse.config import parse_yaml_text
from starverse.elastic.job import DEFAULT_MODEL, check_job_inputs, load_job
from starverse.errors import ConfigError
from starverse.service import storage
from starverse.service.db import Database, Job, JobEvent, JobSample, JobState, Tenant
from starverse.service.settings import ServiceSettings
from starverse.service.tenants import job_ledgers

MAX_DB_INT = 2**31 - 1
"""Largest value of the job tables' INTEGER columns (steps, sample ids; 32-bit on PostgreSQL)."""
JOB_FILE = "job.yaml"
LAUNCH_FILE = "launch.yaml"
LOG_FILE = "log.txt"
RESULT_FILE = "result.json"
RUN_DIR = "run"

# fields the service sets itself: a tenant may not point them anywhere
_FORBIDDEN = {
    "run_dir": "the service keeps each job's run directory",
    "checkpoint.dir": "checkpoints live in the job's run directory",
    "checkpoint.trace": "traces are not read from the server's disk; give checkpoint.interruptions_per_hour",
    "checkpoint.notice_file": "the service sends stop notices itself (POST /api/jobs/{id}/stop)",
    "checkpoint.notice_url": "the service sends stop notices itself (POST /api/jobs/{id}/stop)",
    "billing.ledger": "every job is billed in its own ledger, in its run directory",
    "billing.job": "the job's name in the ledger is its id",
    "billing.enabled": "the service bills every job",
    "metrics.port": "the service picks a free port",
    "devices.launcher": "the service runs jobs with the local launcher",
    "devices.use_gpus": "the service decides which devices a job gets",
}


def job_dir(settings: ServiceSettings, job: Job) -> Path:
    """The job's folder in its tenant's directory."""
    return settings.tenant_dir(job.tenant_id) / "jobs" / job.id


def parse_body(body: bytes, content_type: str) -> dict[str, Any]:
    """A job given as JSON (``{"name":..., "job": {...}}`` or the job's fields) or as YAML text (read as job
    files are: a key given twice, an alias bomb or a recursive alias is refused)."""
    is_yaml = "yaml" in content_type
    try:
        text = body.decode("utf-8")
        data = parse_yaml_text(text, "text")[0] if is_yaml else json.loads(text)
    except ConfigError as e:
        raise ConfigError(f"request body: not valid YAML ({e})") from None
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError, or an int of more than 4300 digits
        raise ConfigError(f"request body: not valid {'YAML' if is_yaml else 'JSON'} "
                          f"({str(e).splitlines()[0].split(';')[0]})") from None
    except RecursionError:
        raise ConfigError("request body: not valid JSON (nested too deeply). To fix: a job nests a few "
                          "levels") from None
    if not isinstance(data, dict):
        raise ConfigError("request body: expected an object with the job file's fields")
    return data


def _check_forbidden(job: Mapping[str, Any]) -> None:
    for key, why in _FORBIDDEN.items():
        head, _, tail = key.partition(".")
        section = job.get(head)
        present = (head in job) if not tail else isinstance(section, dict) and tail in section
        if present:
            raise ConfigError(f"job: {key}: not accepted by the service ({why}). To fix: remove it")


def _write_yaml(path: Path, data: Any, what: str) -> str:
    if not isinstance(data, dict):
        raise ConfigError(f"job: {what}: give the {what} file's fields inline as an object")
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


_SECTIONS = ("train", "devices", "checkpoint", "billing", "metrics")
"""Sections of a job that are objects (the service adds its own fields to some of them)."""
_TOKENIZERS = ("auto", "bpe", "bytes")
"""``train.tokenizer`` values that name no file (a path would be read from the server's disk)."""


def _check_sections(job: Mapping[str, Any]) -> None:
    for key in _SECTIONS:
        if job.get(key) is not None and not isinstance(job[key], dict):
            raise ConfigError(f"job: {key}: expected an object of the job file's {key} fields (got "
                              f"{type(job[key]).__name__}). To fix: give {key} as {{...}}")
    tokenizer = (job.get("train") or {}).get("tokenizer")
    if tokenizer is not None and tokenizer not in _TOKENIZERS:
        raise ConfigError(f"job: train.tokenizer: {str(tokenizer)[:60]!r}: the service does not read tokenizer "
                          f"files by path. To fix: use one of {', '.join(_TOKENIZERS)}")
    pool = job.get("pool")
    if isinstance(pool, dict) and "ray" in pool:
        raise ConfigError("job: pool: ray: not accepted by the service (it runs jobs on its own devices). To fix: "
                          "give a pool file's fields inline (currency, offers), or remove pool")


def _check_ranks(settings: ServiceSettings, job: Mapping[str, Any]) -> None:
    """A job asks for at most as many CPU ranks (one process each) as the server has cores: more would only
    share them, and a million would fork the server's machine to a halt."""
    ranks = (job.get("devices") or {}).get("cpu_ranks")
    most = max(settings.cpu_ranks, os.cpu_count() or 1)
    if isinstance(ranks, int) and not isinstance(ranks, bool) and ranks > most:
        raise ConfigError(f"job: devices.cpu_ranks: {ranks:,} is more than the {most} this service runs (one process "
                          f"per rank, its CPU cores). To fix: ask for at most {most}, or omit it ({settings.cpu_ranks})")


def build_job_file(settings: ServiceSettings, tenant: Tenant, job_id: str, job: dict[str, Any]) -> Path:
    """Write the job file of ``job`` into its folder (names resolved, service fields set); returns its path.

    Raises ConfigError (the library loader's message, server paths replaced by ``job``) when it is invalid,
    after removing the folder: nothing of a refused job is kept.
    """
    _check_forbidden(job)
    _check_sections(job)
    _check_ranks(settings, job)
    ds = job.get("dataset")
    if not isinstance(ds, str):
        raise ConfigError("job: dataset: required, the name of a dataset you uploaded or a registered one "
                          "(GET /api/storage/datasets lists them)")
    found = storage.resolve(settings, tenant.id, "datasets", ds)
    if found is None:
        raise ConfigError(f"job: dataset: no dataset {ds!r} (yours or registered). To fix: upload it "
                          "(PUT /api/storage/datasets/NAME) or pick one of GET /api/storage/datasets")
    model = job.get("model", DEFAULT_MODEL)
    if not isinstance(model, str):
        raise ConfigError("job: model: expected a registry id or the name of an uploaded model config")
    if ".." in model or model.startswith(("/", "~", "\\")):
        raise ConfigError(f"job: model: {model!r} is not a model name. To fix: give a registry id "
                          "(GET /api/models) or the name of a model config you uploaded")
    mfile = storage.resolve(settings, tenant.id, "models", model) if "/" not in model else None
    folder = settings.tenant_dir(tenant.id) / "jobs" / job_id
    folder.mkdir(parents=True, exist_ok=False)
    try:
        return _write_job_file(settings, tenant, folder, job, found, str(mfile) if mfile is not None else model)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise


def _write_job_file(settings: ServiceSettings, tenant: Tenant, folder: Path, job: dict[str, Any], dataset: Path,
                    model: str) -> Path:
    """``build_job_file``'s writing and loading, in the job's new ``folder``."""
    data = dict(job)
    data["dataset"] = str(dataset)
    data["model"] = model
    for key, fname in (("pool", "pool.yaml"), ("plan", "plan.yaml")):
        if data.get(key) is not None:
            data[key] = _write_yaml(folder / fname, data[key], key)
    devices = dict(data.get("devices") or {})
    devices.setdefault("cpu_ranks", settings.cpu_ranks)
    data["devices"] = devices
    data["run_dir"] = RUN_DIR
    billing = dict(data.get("billing") or {})
    billing.update({"job": folder.name, "currency": billing.get("currency", tenant.currency)})
    data["billing"] = billing
    data["metrics"] = {**(data.get("metrics") or {}), "port": 0}
    path = folder / JOB_FILE
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    try:
        loaded = load_job(path)
        # what `starverse train` checks before it writes anything: a model that exists, a dataset of text,
        # and the inline plan and pool (read only when the job starts: a bad one would fail in the queue)
        check_job_inputs(loaded, str(path))
        if loaded.plan is not None:
            from starverse.plan import load_plan

            load_plan(loaded.plan)
        if isinstance(loaded.pool, str):
            from starverse.planner import load_pool

            load_pool(loaded.pool)
    except ConfigError as e:
        raise ConfigError(_server_paths_out(str(e), settings, tenant, folder)) from None
    return path


def _server_paths_out(message: str, settings: ServiceSettings, tenant: Tenant, folder: Path) -> str:
    """``message`` without the server's directories: the job's folder becomes ``job``, the tenant's ``~`` and
    the platform's ``platform:``, as in :func:`read_log`."""
    message = message.replace(str(folder) + "/", "").replace(str(folder), "job")
    for base, shown in ((settings.tenant_dir(tenant.id), "~"), (settings.platform_dir, "platform:")):
        message = message.replace(str(base.resolve()), shown).replace(str(base), shown)
    return message


_NAME_CHARS = 128
"""Longest job name."""


def _job_name(body: Mapping[str, Any], spec: Mapping[str, Any]) -> str | None:
    """The job's name from the body (``{"name", "job"}``) or the job's fields; None when not given."""
    name = body.get("name") if "job" in body else spec.get("name")
    if name is None:
        return None
    if not isinstance(name, str) or not name.strip() or len(name) > _NAME_CHARS or not name.isprintable():
        shown = name[:40] + "..." if isinstance(name, str) and len(name) > 40 else name
        raise ConfigError(f"name: {shown!r}: give a job name of 1 to {_NAME_CHARS} printable characters")
    return name


def submit(db: Database, settings: ServiceSettings, tenant: Tenant, body: dict[str, Any]) -> Job:
    """Queue a job of ``tenant`` (validated first); ``body`` is ``{"name":..., "job": {...}}`` or the job."""
    if "job" in body:
        extra = sorted(set(body) - {"name", "job"})
        if extra:
            raise ConfigError(f"request body: {extra[0]}: unknown field; a request is {{\"name\": ..., \"job\": "
                              "{...}} (or the job's fields alone). To fix: move it into job, or remove it")
        if not isinstance(body["job"], dict):
            raise ConfigError(f"job: expected an object with the job file's fields (got {type(body['job']).__name__})")
    spec = body.get("job", body)
    name = _job_name(body, spec)
    spec = {k: v for k, v in spec.items() if k != "name"}
    job_id = uuid.uuid4().hex
    path = build_job_file(settings, tenant, job_id, spec)
    now = time.time()
    steps = int(((spec.get("train") or {}).get("steps")) or 100)
    if steps > MAX_DB_INT:  # the job file allows more (MAX_STEPS); the job table's step columns do not
        shutil.rmtree(path.parent, ignore_errors=True)
        raise ConfigError(f"job: train.steps: {steps:,} is more than the {MAX_DB_INT:,} steps the service tracks. "
                          "To fix: give fewer steps")
    with db.session() as s:
        job = Job(id=job_id, tenant_id=tenant.id, name=str(name or f"job-{job_id[:8]}")[:128],
                  state=JobState.QUEUED.value, spec=path.read_text(), created_at=now, updated_at=now,
                  stop_requested=False, launches=0, fresh_starts=0, max_steps=steps)
        s.add(job)
        db.add_event(s, job_id, "queued", "submitted")
    return job


def get_job(s: Session, tenant: Tenant, job_id: str) -> Job | None:
    """The tenant's job ``job_id``; None when there is none or it is another tenant's."""
    return s.scalar(select(Job).where(Job.id == job_id, Job.tenant_id == tenant.id))


def job_summary(job: Job) -> dict[str, Any]:
    """The JSON form of a job row."""
    return {"id": job.id, "name": job.name, "state": job.state, "created_at": job.created_at,
            "started_at": job.started_at, "finished_at": job.finished_at, "last_step": job.last_step,
            "max_steps": job.max_steps, "launches": job.launches, "exit_code": job.exit_code,
            "stop_reason": job.stop_reason, "resume_from": job.resume_from, "stop_requested": job.stop_requested}


def progress(s: Session, job: Job, after_id: int = 0) -> dict[str, Any]:
    """Samples (step, loss, tokens/s, shares per rank) and events of the job, newer than the given ids."""
    samples = s.scalars(select(JobSample).where(JobSample.job_id == job.id, JobSample.id > after_id)
                        .order_by(JobSample.id)).all()
    events = s.scalars(select(JobEvent).where(JobEvent.job_id == job.id).order_by(JobEvent.id)).all()
    return {
        "job": job_summary(job),
        "samples": [{"id": x.id, "at": x.at, "step": x.step, "loss": x.loss, "tokens_per_s": x.tokens_per_s,
                     "shares": json.loads(x.shares)} for x in samples],
        "events": [{"at": e.at, "kind": e.kind, "detail": e.detail} for e in events],
    }


def checkpoints(settings: ServiceSettings, job: Job) -> list[dict[str, Any]]:
    """The job's complete checkpoints (what rollback accepts)."""
    from starverse.checkpoint.store import CheckpointStore

    root = job_dir(settings, job) / RUN_DIR / "checkpoints"
    if not root.is_dir():
        return []
    out = []
    for info in CheckpointStore(root).list():
        m = info.manifest.get("metrics") or {}
        out.append({"step": info.step, "created_at": info.created_at, "reason": info.reason,
                    "ranks": info.world_size, "size_bytes": info.size_bytes, "loss": m.get("loss")})
    return out


def job_bill(settings: ServiceSettings, job: Job) -> dict[str, Any] | None:
    """The job's bill from the tenant's ledger (None before its first lease)."""
    from starverse.billing import Ledger
    from starverse.errors import BillingError
    from starverse.jobs.ledger import job_bill as ledger_job_bill

    path = job_ledger(settings, job)
    if not path.is_file():
        return None
    try:
        with Ledger.open(path, create=False) as ledger:
            ledger.job(job.id)
    except BillingError:
        return None  # no ledger yet, or the job has not started a lease in it
    bill = ledger_job_bill(path, job.id).as_dict()
    bill.pop("ledger", None)  # a server path
    return bill


def job_ledger(settings: ServiceSettings, job: Job) -> Path:
    """The job's billing ledger."""
    from starverse.billing.ledger import LEDGER_FILE

    return job_dir(settings, job) / RUN_DIR / LEDGER_FILE


def tenant_bill(settings: ServiceSettings, tenant: Tenant, by: str) -> dict[str, Any]:
    """The tenant's bill grouped by job or day: the library's bill of each of its jobs' ledgers (and of no
    other tenant's), lines of the same key and currency added up in exact ticks."""
    from collections import defaultdict

    from starverse.billing import Ledger
    from starverse.billing.money import ticks_to_decimal
    from starverse.billing.report import make_bill
    from starverse.errors import BillingError

    lines: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
    accrued: dict[str, int] = defaultdict(int)
    open_leases = 0
    for path in job_ledgers(settings, tenant.id):
        try:
            ledger = Ledger.open(path, create=False)
        except BillingError:
            continue  # a job creating its ledger right now: nothing billed in it yet
        with ledger:
            bill = make_bill(ledger, by)
        for x in bill.lines:
            acc = lines[(x.key, x.currency)]
            acc[0] += x.seconds
            acc[1] += x.charge_ticks
            acc[2] += x.credit_ticks
        for x in bill.accrued:
            accrued[x.currency] += x.charge_ticks
        open_leases += bill.open_leases

    def line(key: str, ccy: str, secs: int, charge: int, credit: int) -> dict[str, Any]:
        return {"key": key, "currency": ccy, "seconds": secs, "charges": str(ticks_to_decimal(charge)),
                "credits": str(ticks_to_decimal(credit)), "net": str(ticks_to_decimal(charge - credit)),
                "charge_ticks": charge, "credit_ticks": credit}

    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for (_, ccy), v in lines.items():
        totals[ccy] = [a + b for a, b in zip(totals[ccy], v, strict=True)]
    return {"by": by, "lines": [line(k, c, *v) for (k, c), v in sorted(lines.items())],
            "totals": [line("total", c, *v) for c, v in sorted(totals.items())],
            "accrued": [line("accrued", c, 0, t, 0) for c, t in sorted(accrued.items())],
            "open_leases": open_leases}


def read_log(settings: ServiceSettings, job: Job, tail_bytes: int = 64_000) -> str:
    """The end of the job's log (its runner's output)."""
    p = job_dir(settings, job) / LOG_FILE
    if not p.is_file():
        return ""
    with p.open("rb") as fh:
        size = p.stat().st_size
        fh.seek(max(0, size - tail_bytes))
        text = fh.read().decode("utf-8", errors="replace")
    # the tenant's own paths, without the server's layout above them
    return text.replace(str(settings.tenant_dir(job.tenant_id)), "~").replace(str(settings.platform_dir), "platform:")
