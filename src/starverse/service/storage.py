"""Per-tenant storage of datasets and models, with a quota, and the names jobs use to refer to them.

An upload is checked as what a job will read it as before it is stored (:func:`check_upload`): a dataset is
UTF-8 text with no NUL byte (a ``.jsonl`` name: every line a JSON object with ``text``, ``prompt`` and
``response``, or ``messages``, as the trainer reads it); a model is a config.json the model registry loads. A
refused upload is not kept, and an item it would have replaced stays as it was.

A name is one path component (``[A-Za-z0-9][A-Za-z0-9._-]*``, no ``..``): nothing a request names can
point outside the tenant's directory. A job's ``dataset: wikipedia-202403`` resolves to the tenant's own
upload of that name, else to the platform's registered copy (``ROOT/platform/datasets/``); nothing is
ever downloaded.

A tenant's quota holds under concurrent uploads: the quota check and the write of an upload run under an
exclusive ``flock`` on ``tenants/<id>/.storage.lock`` (:func:`tenant_storage_lock`; kernel-held, so it
covers every server process and is dropped when one dies), so two uploads cannot both count the bytes
that only one of them may use. The body is already in memory (the server reads it whole, capped), so the
lock is held for the disk write and the check of the upload only.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from starverse.checks import not_text_at
from starverse.errors import ConfigError, StarverseError
from starverse.filelock import try_flock
from starverse.service.settings import ServiceSettings

Kind = Literal["datasets", "models"]
KINDS: tuple[Kind, ...] = ("datasets", "models")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class QuotaExceededError(StarverseError):
    """An upload would take the tenant past its storage quota."""


class NotFoundError(StarverseError):
    """The named thing does not exist for this tenant (or belongs to another one)."""


class StorageBusyError(StarverseError):
    """The tenant's storage lock was not free within the wait (another upload of the tenant takes that long)."""


LOCK_FILE = ".storage.lock"
LOCK_WAIT_S = 60.0
"""Longest an upload or delete waits for the tenant's other storage changes (each holds the lock for one disk
write of at most ``max_upload_bytes`` and its check)."""


@contextmanager
def tenant_storage_lock(settings: ServiceSettings, tenant_id: str, wait_s: float = LOCK_WAIT_S) -> Iterator[None]:
    """Hold the tenant's exclusive storage lock (see the module docstring); StorageBusyError after ``wait_s``."""
    base = settings.tenant_dir(tenant_id)
    base.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + wait_s
    while (fd := try_flock(base / LOCK_FILE)) is None:
        if time.monotonic() > deadline:
            raise StorageBusyError(f"another upload of this tenant has held its storage for over {wait_s:g} "
                                   "s. To fix: retry when it is done")
        time.sleep(0.005)
    try:
        yield
    finally:
        os.close(fd)  # releases the lock


def check_name(name: str, what: str = "name") -> str:
    """``name`` if it is one safe path component; ConfigError otherwise."""
    if not _NAME.match(name) or ".." in name:
        raise ConfigError(f"{what} {name!r}: use letters, digits, '.', '_' or '-' (no '/', no '..'), at most "
                          "128 characters")
    return name


def _files(path: Path) -> Iterable[Path]:
    if path.is_file():
        yield path
    elif path.is_dir():
        yield from (p for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def used_bytes(settings: ServiceSettings, tenant_id: str) -> int:
    """Bytes of the tenant's datasets and models."""
    base = settings.tenant_dir(tenant_id)
    return sum(p.stat().st_size for k in KINDS if (base / k).is_dir() for item in (base / k).iterdir()
               if not item.name.startswith(".") for p in _files(item))


def list_items(settings: ServiceSettings, tenant_id: str, kind: Kind) -> list[dict[str, object]]:
    """The tenant's stored items of ``kind`` and the platform's registered ones (``owner`` tells which)."""
    out: list[dict[str, object]] = []
    for owner, base in (("tenant", settings.tenant_dir(tenant_id) / kind), ("platform", settings.platform_dir / kind)):
        if base.is_dir():
            for p in sorted(base.iterdir()):
                if p.name.startswith("."):  # an upload being written (or cut short by a crash)
                    continue
                out.append({"name": p.name, "owner": owner, "bytes": sum(f.stat().st_size for f in _files(p))})
    return out


def store(settings: ServiceSettings, tenant_id: str, kind: Kind, name: str, chunks: Iterable[bytes],
          quota_bytes: int) -> int:
    """Write an upload as the tenant's item ``name`` (replacing one of that name); returns its size. Stops
    with QuotaExceededError as soon as the tenant's total would pass ``quota_bytes`` (nothing is kept)."""
    check_name(name)
    with tenant_storage_lock(settings, tenant_id):  # the quota check and the write are one step
        return _store_locked(settings, tenant_id, kind, name, chunks, quota_bytes)


def _store_locked(settings: ServiceSettings, tenant_id: str, kind: Kind, name: str, chunks: Iterable[bytes],
                  quota_bytes: int) -> int:
    dest = settings.tenant_dir(tenant_id) / kind / name
    dest.parent.mkdir(parents=True, exist_ok=True)
    budget = quota_bytes - used_bytes(settings, tenant_id) + (sum(f.stat().st_size for f in _files(dest)))
    tmp = dest.with_name(f".{secrets.token_hex(6)}.part-{name}")  # its own per upload; the name's suffix kept
    size = 0
    try:
        with tmp.open("wb") as fh:
            for chunk in chunks:
                size += len(chunk)
                if size > budget:
                    raise QuotaExceededError(
                        f"{kind}/{name}: the upload passes the storage quota of {quota_bytes} bytes "
                        f"({max(0, budget)} bytes left). To fix: delete datasets or models you no longer need")
                fh.write(chunk)
        check_upload(kind, name, tmp)
        if dest.is_dir():
            shutil.rmtree(dest)
        tmp.replace(dest)
    finally:
        tmp.unlink(missing_ok=True)
    return size


def check_upload(kind: Kind, name: str, path: Path) -> None:
    """The upload at ``path`` is what a job naming ``kind/name`` reads (see the module docstring); ConfigError
    naming ``kind/name`` and the fix otherwise."""
    what = f"{kind}/{name}"
    if path.stat().st_size == 0:
        raise ConfigError(f"{what}: the upload is empty. To fix: send the file's bytes as the request body")
    if kind == "models":
        from starverse.models import load_model

        try:
            load_model(path)
        except ConfigError as e:
            raise ConfigError(f"{what}: not a model config the service can train: "
                              f"{str(e).replace(str(path), 'config.json')}. To fix: upload a Hugging Face "
                              "config.json (model_type, hidden_size, num_hidden_layers, ...)") from None
        return
    data = path.read_bytes()
    if (problem := not_text_at(data)) is not None:
        bad, why = problem
        raise ConfigError(f"{what}: not a text file (byte {data[bad]:#04x} at offset {bad} is {why}). To fix: upload "
                          "UTF-8 text, or a .jsonl file of {\"text\": ...} lines")
    if Path(name).suffix.lower() == ".jsonl":  # read line by line as the trainer reads it (``path`` ends in it too)
        from starverse.runtime.data import _read_documents

        try:
            _read_documents([path], None)
        except ConfigError as e:
            raise ConfigError(f"{what}{str(e).replace(str(path), '').rstrip('.')}. To fix: make each line a JSON "
                              "object with 'text' (or 'prompt' and 'response', or 'messages')") from None


def delete(settings: ServiceSettings, tenant_id: str, kind: Kind, name: str) -> None:
    """Remove the tenant's item (never a platform one)."""
    p = settings.tenant_dir(tenant_id) / kind / check_name(name)
    with tenant_storage_lock(settings, tenant_id):  # not while an upload of it is being checked and renamed
        if not p.exists():
            raise NotFoundError(f"{kind}/{name}: not found")
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()


def resolve(settings: ServiceSettings, tenant_id: str, kind: Kind, name: str) -> Path | None:
    """The tenant's item ``name``, else the platform's registered one; None if neither exists."""
    check_name(name, f"{kind[:-1]}")
    for base in (settings.tenant_dir(tenant_id) / kind, settings.platform_dir / kind):
        p = base / name
        if p.exists():
            return p.resolve()
    return None


def register_platform(settings: ServiceSettings, kind: Kind, name: str, source: Path) -> Path:
    """Copy a local file or folder into the platform's registry as ``name`` (an admin command)."""
    check_name(name)
    if not source.exists():
        raise ConfigError(f"{source}: no such file or folder")
    if not (source.is_dir() or source.is_file()):  # a FIFO would be read forever, a device has no end
        raise ConfigError(f"{source}: not a regular file or folder (a device, FIFO or socket). To fix: give a file "
                          "or folder")
    if kind == "models" and source.is_file():
        check_upload(kind, name, source)  # as a tenant's upload is: a config.json the model registry loads
    dest = settings.platform_dir / kind / name
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{secrets.token_hex(6)}.part-{name}")
    try:  # copied beside, then renamed: a copy that fails leaves the registered item as it was
        if source.is_dir():
            shutil.copytree(source, tmp)
        else:
            shutil.copy2(source, tmp)
    except (OSError, shutil.Error) as e:  # a FIFO inside the folder, a file it may not read, a full disk
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
        first = e.args[0][0][2] if isinstance(e, shutil.Error) and e.args and e.args[0] else e
        raise ConfigError(f"{source}: cannot be copied into the platform registry ({first}). To fix: give a folder of "
                          "regular files this user may read") from None
    if dest.is_dir():
        shutil.rmtree(dest)
    elif dest.exists():
        dest.unlink()
    tmp.replace(dest)
    return dest
