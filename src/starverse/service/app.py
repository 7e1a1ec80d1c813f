"""The FastAPI application: ``create_app(settings)``.

Every route under ``/api`` except ``/api/health`` needs ``Authorization: Bearer <token>``; the token names
the tenant, and every lookup is filtered by it, so another tenant's job id answers 404 exactly like an id
that does not exist. Request bodies are capped (413) before they are read whole; malformed bodies and
invalid jobs answer 400/422 with one line that says what to fix. The web console is served from the
package's ``static/`` folder at ``/`` (no CDN).
"""

from __future__ import annotations

import gc
import math
import multiprocessing
import time
from collections.abc import AsyncIterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from starverse.errors import BudgetExceededError, ConfigError, SearchTimeLimitError, StarverseError
from starverse.service.cache import Memo, TTLCache
from starverse.service.db import Database, Tenant
from starverse.service.settings import ServiceSettings
from starverse.service.storage import NotFoundError, QuotaExceededError
from starverse.service.tenants import TOKEN_PREFIX, authenticate, hash_token, upgrade_state

STATIC_DIR = Path(__file__).with_name("static")
UPLOAD_PREFIX = "/api/storage/"


@dataclass
class ServiceContext:
    """What every route needs: the settings and the database; the planner processes, started on first use."""

    settings: ServiceSettings
    db: Database
    _planners: ProcessPoolExecutor | None = None
    tokens: TTLCache[tuple[Tenant, float | None]] = field(init=False)
    """Token hash -> (tenant, token expiry) of tokens found valid."""
    statuses: Memo[dict[str, Any]] = field(init=False)
    """(tenant id, job id) -> the job's status answer."""
    plans: Memo[dict[str, Any]] = field(init=False)
    """:func:`~starverse.service.cache.plan_key` -> the ``/api/plan`` answer."""

    def __post_init__(self) -> None:
        self.tokens = TTLCache(self.settings.auth_cache_s)
        # refreshed in the background after half its life: no status request waits for the database
        self.statuses = Memo(self.settings.status_cache_s, 10_000, refresh_after_s=self.settings.status_cache_s / 2)
        self.plans = Memo(math.inf, self.settings.plan_cache_entries)

    def job_changed(self, job_id: str) -> None:
        """This process changed job ``job_id``: drop its cached status."""
        self.statuses.drop(lambda k: isinstance(k, tuple) and k[1] == job_id)

    def planner_pool(self) -> ProcessPoolExecutor:
        """Processes that run planner searches (spawned: the server's threads are not forked)."""
        if self._planners is None:
            self._planners = ProcessPoolExecutor(max_workers=self.settings.planner_processes,
                                                 mp_context=multiprocessing.get_context("spawn"))
        return self._planners

    def close(self) -> None:
        """Stop the planner processes and close the database connections."""
        if self._planners is not None:
            self._planners.shutdown(cancel_futures=True)
            self._planners = None
        self.db.dispose()


class BodyLimit:
    """ASGI middleware: refuse bodies over the cap (413) from Content-Length, or while streaming them."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, max_upload_bytes: int):
        self.app = app
        self.max_body = max_body_bytes
        self.max_upload = max_upload_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        cap = self.max_upload if path.startswith(UPLOAD_PREFIX) and scope.get("method") == "PUT" else self.max_body
        for k, v in scope.get("headers", []):
            if k == b"content-length":
                try:
                    declared = int(v)
                except ValueError:
                    declared = cap + 1
                if declared > cap:
                    await _too_large(send, cap)
                    return
        # read the body up to the cap before the app sees it (a parser would turn an error raised while it
        # reads into its own 400); then replay it
        chunks: list[bytes] = []
        seen = 0
        more = True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            seen += len(chunk)
            if seen > cap:
                await _too_large(send, cap)
                return
            chunks.append(chunk)
            more = bool(msg.get("more_body"))
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _too_large(send: Send, cap: int) -> None:
    body = (f'{{"detail": "request body larger than {cap} bytes. To fix: send less (uploads: at most the '
            f'configured upload size)"}}').encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def context(request: Request) -> ServiceContext:
    """The service context of the app serving ``request``."""
    ctx: ServiceContext = request.app.state.ctx
    return ctx


async def current_tenant(request: Request) -> Tenant:
    """The tenant of the request's bearer token; 401 without a valid one.

    A token found valid is remembered for ``auth_cache_s`` (its expiry is still checked every time), so the
    hot path neither hashes into the database nor leaves the event loop."""
    ctx = context(request)
    given = request.headers.getlist("authorization")
    if len(given) > 1:  # which one counts would be up to each proxy on the way: none does
        raise HTTPException(400, f"Authorization: given {len(given)} times. To fix: send one 'Authorization: "
                                 "Bearer <token>' header")
    auth = given[0] if given else ""
    scheme, _, token = auth.partition(" ")
    token = token.strip()
    tenant: Tenant | None = None
    if scheme.lower() == "bearer" and token.startswith(TOKEN_PREFIX) and len(token) <= 200:
        key = hash_token(token)
        hit = ctx.tokens.get(key)
        if hit is not None and (hit[1] is None or hit[1] > time.time()):
            tenant = hit[0]
        elif hit is None:
            found = await run_in_threadpool(authenticate, ctx.db, token)
            if found is not None:
                tenant = found[0]
                ctx.tokens.put(key, found)
    if tenant is None:
        raise HTTPException(401, "missing, wrong or expired token. To fix: send 'Authorization: Bearer <token>' "
                                 "with a token from `starverse serve token create`",
                            headers={"WWW-Authenticate": "Bearer"})
    return tenant


def request_error_line(e: RequestValidationError) -> str:
    """FastAPI's list of errors of a request (its body, query or path) as one line naming the first field:
    ``query.limit: must be less than or equal to 1000 (got '5000')``."""
    from starverse.config import _short, format_loc

    errors = e.errors()
    if not errors:
        return "request: invalid"
    first = errors[0]
    loc = format_loc([p for p in first.get("loc", ()) if isinstance(p, str | int)])
    msg = str(first.get("msg", "invalid")).replace("Input should be ", "must be ").replace("Value error, ", "")
    if first.get("type") == "json_invalid":
        return f"request body: not valid JSON ({msg}). To fix: send a JSON object"
    got = f" (got {_short(first['input'])})" if "input" in first and first.get("type") != "missing" else ""
    more = f"; {len(errors) - 1} more" if len(errors) > 1 else ""
    return " ".join(f"{loc}: {msg}{got}{more}".split())


def body_error_line(e: BaseException) -> str:
    """One line for a request body that is not JSON at all (``e``: what decoding it raised)."""
    if isinstance(e, UnicodeDecodeError):
        why = f"byte {e.object[e.start]:#04x} at offset {e.start} is not {e.encoding.upper()}"
    elif isinstance(e, RecursionError):
        why = "nested too deeply"
    else:  # an int of more than 4300 digits (Python's conversion limit)
        why = str(e).splitlines()[0].split(";")[0] if str(e) else type(e).__name__
    return f"request body: not valid JSON ({why}). To fix: send a JSON object in UTF-8"


def _status_of(e: StarverseError) -> int:
    if isinstance(e, NotFoundError):
        return 404
    if isinstance(e, QuotaExceededError):
        return 413
    if isinstance(e, BudgetExceededError):
        return 402
    if isinstance(e, ConfigError | SearchTimeLimitError):
        return 422
    return 409


def create_app(settings: ServiceSettings, *, db: Database | None = None, migrate_db: bool = True) -> FastAPI:
    """The service app over ``settings`` (its state is upgraded first unless ``migrate_db`` is false)."""
    from starverse.service import api_jobs, api_plan

    settings.root.mkdir(parents=True, exist_ok=True)
    if migrate_db:
        upgrade_state(settings)
    ctx = ServiceContext(settings, db or Database(settings.url))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # everything imported and built so far lives as long as the server: out of the collector's sight,
        # a full collection no longer walks it (the pauses a request would wait through)
        gc.freeze()
        yield
        ctx.close()

    # FastAPI's OpenTelemetry hooks look the global providers up on every request (a tenth of a status
    # request's time); the service has no OpenTelemetry exporter, so they are off
    app = FastAPI(title="Starverse", version="1", description="Plans, jobs, checkpoints and bills as a service.",
                  docs_url="/docs", openapi_url="/openapi.json", lifespan=lifespan,
                  telemetry={"tracing": False, "metrics": False, "logs": False})
    app.state.ctx = ctx

    @app.exception_handler(StarverseError)
    async def _starverse_error(request: Request, e: StarverseError) -> JSONResponse:
        return JSONResponse({"detail": " ".join(str(e).split()), "error": type(e).__name__},
                            status_code=_status_of(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> Response:
        # FastAPI answers a JSON body it cannot decode (bytes that are not UTF-8, nesting thousands deep, an
        # integer of thousands of digits) with a 400 that names nothing; its cause says which it was
        if e.status_code == 400 and isinstance(e.__cause__, UnicodeDecodeError | RecursionError | ValueError):
            return JSONResponse({"detail": body_error_line(e.__cause__), "error": "RequestValidationError"},
                                status_code=422)
        return await http_exception_handler(request, e)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": request_error_line(e), "error": "RequestValidationError"}, status_code=422)

    @app.get("/api/health", tags=["service"])
    def health() -> dict[str, Any]:
        """Liveness (no token needed)."""
        return {"ok": True}

    @app.get("/api/whoami", tags=["service"])
    def whoami(tenant: Tenant = Depends(current_tenant)) -> dict[str, Any]:  # noqa: B008
        """The tenant of the token."""
        return {"tenant": tenant.name, "id": tenant.id, "currency": tenant.currency}

    app.include_router(api_plan.router, dependencies=[Depends(current_tenant)])
    app.include_router(api_jobs.router)

    @app.get("/", include_in_schema=False)
    def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    app.add_middleware(BodyLimit, max_body_bytes=settings.max_body_bytes,  # type: ignore[arg-type]
                       max_upload_bytes=settings.max_upload_bytes)
    return app
