"""``starverse serve``: the REST API and web console (and its worker), plus tenant, token and registry admin.

    starverse serve --root /srv/starverse                      # http://127.0.0.1:8000 (console at /, API docs at /docs)
    starverse serve tenant create alice --root /srv/starverse  # tenant alice, with the sign-up credit
    starverse serve token create alice --root /srv/starverse   # prints a new token of tenant alice
    starverse serve tenant topup alice 20 --root /srv/starverse
    starverse serve dataset register wikipedia-202403 ./wiki.jsonl --root /srv/starverse
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Annotated, Any

import typer

from starverse.cli.options import finite_at_most
from starverse.config import MAX_MONEY, MAX_SECONDS

serve_app = typer.Typer(name="serve", help="Run Starverse as a service (REST API + web console), and administer it.",
                        add_completion=False, invoke_without_command=True)
tenant_app = typer.Typer(help="Create tenants and top up their prepaid balance.", no_args_is_help=True)
token_app = typer.Typer(help="Create API tokens.", no_args_is_help=True)
registry_help = "Register a local file or folder as a platform {} every tenant can name."
dataset_app = typer.Typer(help=registry_help.format("dataset"), no_args_is_help=True)
model_app = typer.Typer(help=registry_help.format("model config"), no_args_is_help=True)
serve_app.add_typer(tenant_app, name="tenant")
serve_app.add_typer(token_app, name="token")
serve_app.add_typer(dataset_app, name="dataset")
serve_app.add_typer(model_app, name="model")

ROOT_ENV = "STARVERSE_SERVICE_ROOT"
DATABASE_ENV = "STARVERSE_DATABASE"
RootOpt = Annotated[Path | None, typer.Option(
    "--root", help=f"State directory (default ${ROOT_ENV}, else ~/.local/share/starverse/service).",
    show_default=False)]
DatabaseOpt = Annotated[str | None, typer.Option(
    "--database", help=f"postgresql://USER@HOST:PORT/DB or sqlite:///FILE (default ${DATABASE_ENV}, else "
                       "ROOT/service.sqlite).", show_default=False)]


def _settings(root: Path | None, database: str | None, ctx: typer.Context | None = None,  # type: ignore[no-untyped-def]
              **kw: object):
    from starverse.service.settings import ServiceSettings
    from starverse.service.tenants import upgrade_state

    given = (ctx.obj if ctx is not None and isinstance(ctx.obj, dict) else {})
    root = root or given.get("root")
    database = database or given.get("database")
    base = root or Path(os.environ.get(ROOT_ENV) or Path.home() / ".local" / "share" / "starverse" / "service")
    from sqlalchemy.exc import DatabaseError

    from starverse.errors import ConfigError

    settings = ServiceSettings(root=base.resolve(), database_url=database or os.environ.get(DATABASE_ENV, ""),
                               **kw)  # type: ignore[arg-type]
    try:
        settings.root.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file in the way, no permission
        raise ConfigError(f"--root {base}: cannot be the state directory ({e.strerror}). To fix: give a directory "
                          "(created if missing)") from None
    try:
        upgrade_state(settings)
    except DatabaseError as e:  # the server is not running, the database does not exist, no access, not a database
        first = " ".join(str(e.orig or e).split("\n")[0].split())[:200]
        raise ConfigError(f"--database: cannot open the database ({first}). To fix: start its server or check "
                          "the URL") from None
    return settings


def _amount(text: str, what: str) -> Decimal:
    from starverse.errors import ConfigError

    try:
        value = Decimal(text)
    except InvalidOperation:
        raise ConfigError(f"{what}: {text!r} is not a number. To fix: e.g. 20 or 12.50") from None
    if not value.is_finite() or value < 0:
        raise ConfigError(f"{what}: {text!r} must be a non-negative amount")
    if value > MAX_MONEY:
        raise ConfigError(f"{what}: {text[:40]!r} is above {MAX_MONEY:,}, the largest amount the ledger holds. "
                          "To fix: give a smaller amount")
    return value


def _check_bindable(host: str, port: int) -> None:
    """ConfigError when ``host:port`` cannot be bound here (uvicorn would print its own two lines and exit 3)."""
    import socket

    from starverse.errors import ConfigError

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise ConfigError(f"--host {host[:60]!r}: not an address ({getattr(e, 'strerror', None) or e}). To fix: "
                          "give 127.0.0.1 (this machine only) or an address of this machine") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind(address)
        except OSError as e:
            raise ConfigError(f"--host {host} --port {port}: cannot listen there ({e.strerror}). To fix: another "
                              "--port (or stop what uses it), or an address of this machine") from None


@serve_app.callback()
def serve(
    ctx: typer.Context,
    root: RootOpt = None,
    database: DatabaseOpt = None,
    host: Annotated[str, typer.Option("--host", help="Address to bind (127.0.0.1: this machine only).")
                    ] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="Port to bind.")] = 8000,
    slots: Annotated[int, typer.Option("--slots", min=0, help="Jobs run at once by the worker (0: no worker).")
                     ] = 2,
    signup_credit: Annotated[str, typer.Option("--signup-credit", help="Prepaid credit of a new tenant.")] = "5",
    plan_cache: Annotated[int, typer.Option("--plan-cache", min=0, help="Answers of identical plan requests "
                                                                        "kept (0: every request searches).")] = 256,
) -> None:
    """Serve the REST API (OpenAPI at /docs) and the web console (/) and run queued jobs in a worker."""
    if ctx.invoked_subcommand is not None:
        ctx.obj = {"root": root, "database": database}  # `serve --root R token create ...` means R too
        return
    import uvicorn

    from starverse.service.app import create_app
    from starverse.service.protocol import http_protocol

    settings = _settings(root, database, worker_slots=slots, signup_credit=_amount(signup_credit, "--signup-credit"),
                         plan_cache_entries=plan_cache)
    _check_bindable(host, port)
    worker = None
    if slots > 0:
        worker = subprocess.Popen([sys.executable, "-m", "starverse.service.worker", str(settings.root),
                                   settings.url, str(slots)], stdin=subprocess.DEVNULL)
    typer.echo(f"starverse serve: http://{host}:{port}/ (API docs /docs), state in {settings.root}, "
               f"worker {'pid ' + str(worker.pid) if worker else 'off'}", err=True)
    try:
        uvicorn.run(create_app(settings, migrate_db=False), host=host, port=port, log_level="warning",
                    http=http_protocol())
    finally:
        if worker is not None:
            worker.send_signal(signal.SIGTERM)  # running jobs checkpoint; the next start resumes them
            worker.wait()


@tenant_app.command("create")
def tenant_create(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Tenant name (lower-case letters, digits, '-', '_').")],
    credit: Annotated[str | None, typer.Option("--credit", help="Sign-up credit (default: the service's).")] = None,
    root: RootOpt = None, database: DatabaseOpt = None,
) -> None:
    """Create a tenant with its sign-up credit."""
    from starverse.service.db import Database
    from starverse.service.tenants import create_tenant

    settings = _settings(root, database, ctx)
    t = create_tenant(Database(settings.url), settings, name,
                      credit=None if credit is None else _amount(credit, "--credit"))
    typer.echo(t.id)


@tenant_app.command("topup")
def tenant_topup(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Tenant name.")],
    amount: Annotated[str, typer.Argument(help="Amount added to the prepaid balance.")],
    root: RootOpt = None, database: DatabaseOpt = None,
) -> None:
    """Add prepaid credit to a tenant (a payment in its billing ledger)."""
    from starverse.service.db import Database
    from starverse.service.tenants import top_up

    settings = _settings(root, database, ctx)
    top_up(Database(settings.url), settings, name, _amount(amount, "AMOUNT"))


@token_app.command("create")
def token_create(
    ctx: typer.Context,
    tenant: Annotated[str, typer.Argument(help="Tenant the token acts for (`serve tenant create` makes one).")],
    ttl_hours: Annotated[float | None, typer.Option("--ttl-hours", callback=finite_at_most(MAX_SECONDS / 3600),
                                                    help="Expire after this many hours.")] = None,
    root: RootOpt = None, database: DatabaseOpt = None,
) -> None:
    """Print a new API token of an existing tenant (shown once: only its hash is stored).

    An unknown tenant is refused (exit 2, naming `serve tenant create`): a typo must not make a new tenant
    and hand it the sign-up credit."""
    from starverse.errors import ConfigError
    from starverse.service.db import Database
    from starverse.service.tenants import create_token

    if ttl_hours is not None and not ttl_hours * 3600 >= 1:  # a token expired when it is made
        raise ConfigError(f"--ttl-hours: {ttl_hours:g} gives a token that has expired when it is printed. To fix: "
                          "pass at least 0.0003 (one second), or omit it for a token that does not expire")

    settings = _settings(root, database, ctx)
    db = Database(settings.url)
    try:
        typer.echo(create_token(db, tenant, ttl_s=None if ttl_hours is None else ttl_hours * 3600))
    finally:
        db.dispose()


def _register(kind: str, name: str, path: Path, settings: Any) -> None:
    from starverse.service.storage import register_platform

    dest = register_platform(settings, kind, name, path)  # type: ignore[arg-type]
    typer.echo(str(dest))


@dataset_app.command("register")
def dataset_register(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Name jobs use (dataset: NAME).")],
    path: Annotated[Path, typer.Argument(help="Text file, folder of text files or .jsonl.")],
    root: RootOpt = None, database: DatabaseOpt = None,
) -> None:
    """Register a platform dataset (copied into ROOT/platform/datasets)."""
    _register("datasets", name, path, _settings(root, database, ctx))


@model_app.command("register")
def model_register(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Name jobs use (model: NAME).")],
    path: Annotated[Path, typer.Argument(help="A Hugging Face config.json.")],
    root: RootOpt = None, database: DatabaseOpt = None,
) -> None:
    """Register a platform model config (copied into ROOT/platform/models)."""
    _register("models", name, path, _settings(root, database, ctx))


def register(app: typer.Typer) -> None:
    """Add ``serve`` and its admin subcommands."""
    app.add_typer(serve_app, name="serve")
