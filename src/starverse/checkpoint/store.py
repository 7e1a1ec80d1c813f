"""The on-disk checkpoint store: atomic ``step-N`` folders, manifests, keep-last-k, snapshots, rollback.

Layout of a checkpoint root (``RUN_DIR/checkpoints``)::

    step-40/                      complete: renamed into place only after every byte is on disk
        .metadata                 DCP metadata (written by DCP's coordinator)
        __0_0.distcp ...          DCP data, one file per writing rank
        extras.pt                 LR schedule, sampler position, step, shares (rank 0)
        rng-0.pt rng-1.pt ...     per-rank RNG states
        starverse.json            our manifest, written LAST: format, step, model fingerprint, plan,
                                  billing cursor, size and CRC-32 of every file
    .partial-step-48-<attempt>/   a write in progress or torn by a crash: never listed, never loaded
    rolled-back-<time>/step-44/   checkpoints newer than a rollback target, moved aside (never deleted)

A ``step-N`` folder exists only once it is complete (write into a partial folder, fsync, manifest last,
rename, fsync the parent), the same rule as torchtitan's "a step folder counts once its metadata is
complete". This module is pure file handling (no torch), so ``starverse checkpoints list`` starts fast.
"""

from __future__ import annotations

import builtins
import json
import logging
import os
import re
import shutil
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from starverse.errors import CheckpointError

log = logging.getLogger(__name__)

MANIFEST_NAME = "starverse.json"
FORMAT = "starverse-checkpoint"
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step-(\d+)$")
_PARTIAL_PREFIX = ".partial-step-"
_CRC_CHUNK = 16 * 1024 * 1024


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint as its manifest describes it."""

    step: int
    """Optimizer steps completed when it was taken."""
    path: Path
    """The ``step-N`` folder."""
    created_at: str
    """ISO-8601 UTC time the checkpoint was committed."""
    reason: str
    """Why it was taken: ``interval``, ``notice`` (preemption), ``final`` or ``manual``."""
    world_size: int
    """Ranks that wrote it (it can be loaded on any number of ranks)."""
    device_kinds: tuple[str, ...]
    """Accelerator id of each writing rank."""
    size_bytes: int
    """Bytes on disk (all files)."""
    model_fingerprint: str
    """Hash of the model's parameter names, shapes and dtypes; a resume must match it."""
    num_params: int
    """Model parameters (for humans)."""
    model_name: str | None
    """The plan's model reference, when known."""
    manifest: Mapping[str, Any] = field(repr=False, compare=False)
    """The full manifest (plan, billing cursor, metrics, save timings)."""

    @property
    def billing_cursor(self) -> Mapping[str, Any]:
        """The opaque billing cursor saved with this checkpoint (filled by the billing engineer's code)."""
        return self.manifest.get("billing_cursor") or {}

    @property
    def plan_yaml(self) -> str | None:
        """The plan that was running when it was written (YAML text)."""
        return self.manifest.get("plan")


def fsync_dir(path: Path) -> None:
    """Make a rename or create inside ``path`` durable (POSIX needs the directory itself synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_crc32(path: Path) -> int:
    """CRC-32 of a file, read in chunks (about 3 GB/s here: an order of magnitude above disk writes)."""
    crc = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CRC_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def describe_files(folder: Path, known: Mapping[str, tuple[int, int]] | None = None) -> dict[str, dict[str, int]]:
    """Size and CRC-32 of every file in ``folder`` (the manifest's integrity record); ``known`` holds
    (bytes, CRC-32) computed while the files were written, used when the size on disk agrees."""
    out: dict[str, dict[str, int]] = {}
    for p in sorted(folder.iterdir()):
        if p.is_file() and p.name != MANIFEST_NAME:
            size = p.stat().st_size
            rec = (known or {}).get(p.name)
            crc = rec[1] if rec is not None and rec[0] == size else file_crc32(p)
            out[p.name] = {"bytes": size, "crc32": crc}
    return out


def _utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _info_from_manifest(folder: Path, m: Mapping[str, Any]) -> CheckpointInfo:
    model = m.get("model") or {}
    files = m.get("files") or {}
    return CheckpointInfo(
        step=int(m["step"]),
        path=folder,
        created_at=str(m.get("created_at", "")),
        reason=str(m.get("reason", "")),
        world_size=int(m.get("world_size", 0)),
        device_kinds=tuple(m.get("device_kinds") or ()),
        size_bytes=sum(int(f.get("bytes", 0)) for f in files.values()),
        model_fingerprint=str(model.get("fingerprint", "")),
        num_params=int(model.get("num_params", 0)),
        model_name=model.get("name"),
        manifest=m,
    )


def read_manifest(folder: Path) -> Mapping[str, Any]:
    """Read and check the manifest of a ``step-N`` folder; CheckpointError if it is not ours or unreadable."""
    path = folder / MANIFEST_NAME
    if not path.is_file():
        raise CheckpointError(
            f"{folder}: not a Starverse checkpoint (no {MANIFEST_NAME}); it may be foreign or torn. "
            "To fix: point at a run directory written by `starverse train`, or pick a step from "
            "`starverse checkpoints list RUN_DIR`."
        )
    try:
        m = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"{path}: corrupted manifest ({e.__class__.__name__}); this checkpoint cannot be trusted. "
            "To fix: resume from another step (`starverse checkpoints list RUN_DIR`)."
        ) from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointError(
            f"{path}: foreign manifest (format {m.get('format') if isinstance(m, dict) else None!r}, "
            f"expected {FORMAT!r}). To fix: point at a run directory written by `starverse train`."
        )
    if int(m.get("version", 0)) > FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: written by a newer Starverse (checkpoint format v{m.get('version')}, this one reads "
            f"v{FORMAT_VERSION}). To fix: upgrade Starverse."
        )
    for key in ("step", "files", "model"):
        if key not in m:
            raise CheckpointError(f"{path}: corrupted manifest (no '{key}'). To fix: resume from another step.")
    return m


class CheckpointStore:
    """The checkpoints of one run: listing, atomic commit, verification, retention and rollback.

    Only rank 0 (or the supervisor) mutates the store; every rank may read it.
    """

    def __init__(self, root: str | Path, keep_last: int | None = 3, keep_every: int | None = None):
        """``root`` is the checkpoint folder; keep the newest ``keep_last`` (None: all) plus every
        checkpoint whose step is a multiple of ``keep_every`` (snapshots for rollback)."""
        if keep_last is not None and keep_last < 1:
            raise CheckpointError(f"keep_last must be >= 1 (got {keep_last}); use None to keep all")
        if keep_every is not None and keep_every < 1:
            raise CheckpointError(f"keep_every must be >= 1 (got {keep_every})")
        self.root = Path(root)
        self.keep_last = keep_last
        self.keep_every = keep_every

    # ---- reading -------------------------------------------------------------------------------------
    def list(self) -> list[CheckpointInfo]:
        """Complete checkpoints, oldest first. Folders whose manifest is unreadable are skipped (logged)."""
        if not self.root.is_dir():
            return []
        out = []
        for p in self.root.iterdir():
            mt = _STEP_RE.match(p.name)
            if not (mt and p.is_dir()):
                continue
            try:
                out.append(_info_from_manifest(p, read_manifest(p)))
            except CheckpointError as e:
                log.warning("skipping %s: %s", p, e)
        return sorted(out, key=lambda i: i.step)

    def partials(self) -> builtins.list[Path]:
        """Torn or in-progress writes (never loaded)."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if p.name.startswith(_PARTIAL_PREFIX))

    def latest(self) -> CheckpointInfo | None:
        """The newest complete checkpoint, or None."""
        found = self.list()
        return found[-1] if found else None

    def get(self, step: int) -> CheckpointInfo:
        """The checkpoint of ``step``; CheckpointError listing what exists if there is none."""
        folder = self.root / f"step-{step}"
        if folder.is_dir():
            return _info_from_manifest(folder, read_manifest(folder))
        self.require_any()
        steps = ", ".join(str(i.step) for i in self.list())
        raise CheckpointError(
            f"{self.root}: no checkpoint for step {step}; complete checkpoints: {steps}. "
            "To fix: pass one of those to --resume-from."
        )

    def require_any(self, fix: str = "point at a run directory written by `starverse train`, or start without "
                                      "--resume-from") -> None:
        """Raise a clear CheckpointError when the store has no complete checkpoint at all (``fix``: what to do)."""
        if not self.root.exists():
            raise CheckpointError(
                f"{self.root}: no such checkpoint directory. To fix: pass the run directory of a "
                "`starverse train` job (it holds checkpoints/)."
            )
        if not self.root.is_dir():
            raise CheckpointError(f"{self.root}: is a file, not a checkpoint directory.")
        if self.list():
            return
        torn = len(self.partials())
        other = [p.name for p in self.root.iterdir() if not p.name.startswith(_PARTIAL_PREFIX)][:3]
        if any(_STEP_RE.match(n) for n in other):
            why = "its step folders have no valid Starverse manifest (foreign or corrupted)"
        elif other:
            why = f"it holds no Starverse checkpoint (found {', '.join(other)}: foreign files)"
        else:
            why = "it is empty"
        extra = f"; {torn} torn write(s) ignored" if torn else ""
        raise CheckpointError(
            f"{self.root}: no complete checkpoint to resume from: {why}{extra}. To fix: {fix}."
        )

    def verify(self, info: CheckpointInfo) -> None:
        """Check every file against the manifest's size and CRC-32; CheckpointError on any difference."""
        files: Mapping[str, Mapping[str, int]] = info.manifest.get("files") or {}
        if ".metadata" not in files:
            raise CheckpointError(f"{info.path}: corrupted manifest (no DCP .metadata listed).")
        fix = "To fix: resume from an earlier step (`starverse checkpoints list RUN_DIR`)."
        for name, rec in files.items():
            p = info.path / name
            if not p.is_file():
                raise CheckpointError(f"{p}: missing file listed in the manifest (corrupted checkpoint). {fix}")
            size = p.stat().st_size
            if size != int(rec["bytes"]):
                raise CheckpointError(
                    f"{p}: size {size} B differs from the manifest's {rec['bytes']} B (corrupted checkpoint). {fix}"
                )
            if file_crc32(p) != int(rec["crc32"]):
                raise CheckpointError(f"{p}: checksum mismatch (corrupted checkpoint). {fix}")

    # ---- writing (rank 0 / supervisor) ---------------------------------------------------------------
    def partial_dir(self, step: int, attempt: str) -> Path:
        """Where a checkpoint of ``step`` is written before it is committed."""
        return self.root / f"{_PARTIAL_PREFIX}{step}-{attempt}"

    def commit(
        self, partial: Path, step: int, manifest: Mapping[str, Any], known: Mapping[str, tuple[int, int]] | None = None
    ) -> CheckpointInfo:
        """Record sizes and checksums, write the manifest last, fsync, and rename ``partial`` to ``step-N``.

        A crash before the rename leaves only a partial folder (ignored); after it, a complete checkpoint.
        """
        final = self.root / f"step-{step}"
        if final.exists():
            # Only reachable after a rollback that did not move newer checkpoints aside; refuse to clobber.
            raise CheckpointError(
                f"{final}: already exists; refusing to overwrite a committed checkpoint. "
                "To fix: resume from the latest step or move the newer checkpoints aside."
            )
        full = dict(manifest)
        full.update(format=FORMAT, version=FORMAT_VERSION, step=step, created_at=_utc_now())
        full["files"] = describe_files(partial, known)
        tmp = partial / (MANIFEST_NAME + ".tmp")
        with open(tmp, "w") as f:
            json.dump(full, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        tmp.rename(partial / MANIFEST_NAME)
        fsync_dir(partial)
        partial.rename(final)
        fsync_dir(self.root)
        return _info_from_manifest(final, full)

    def purge(self) -> builtins.list[int]:
        """Apply keep-last-k and keep-every; return the steps removed.

        A folder is renamed out of ``step-N`` before it is deleted, so a crash mid-delete never leaves a
        ``step-N`` with missing files.
        """
        found = self.list()
        if self.keep_last is None or len(found) <= self.keep_last:
            return []
        removed = []
        for info in found[: -self.keep_last]:
            if self.keep_every and info.step % self.keep_every == 0:
                continue
            doomed = self.root / f".deleting-{info.path.name}-{time.time_ns()}"
            try:
                info.path.rename(doomed)
            except FileNotFoundError:  # moved by a concurrent rollback or purge
                continue
            shutil.rmtree(doomed, ignore_errors=True)
            removed.append(info.step)
        if removed:
            log.info("checkpoint retention: removed steps %s (keep_last=%s, keep_every=%s)",
                     removed, self.keep_last, self.keep_every)
        return removed

    def clean_partials(self, keep_attempt: str | None = None) -> int:
        """Remove torn writes and interrupted deletions left by crashed runs; return how many."""
        if not self.root.is_dir():
            return 0
        n = 0
        for p in self.root.iterdir():
            if p.name.startswith((_PARTIAL_PREFIX, ".deleting-")) and not (
                keep_attempt and p.name.endswith(f"-{keep_attempt}")
            ):
                shutil.rmtree(p, ignore_errors=True)
                n += 1
        return n

    def set_aside_after(self, step: int) -> Path | None:
        """Rollback: move complete checkpoints newer than ``step`` into ``rolled-back-<time>/`` (kept, not
        deleted), so the resumed run's new ``step-N`` folders never collide with the abandoned timeline."""
        newer = [i for i in self.list() if i.step > step]
        if not newer:
            return None
        dest = self.root / f"rolled-back-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S')}-{time.time_ns() % 10**6}"
        dest.mkdir(parents=True)
        for info in newer:
            info.path.rename(dest / info.path.name)
        fsync_dir(self.root)
        log.info("rollback to step %d: moved newer checkpoints %s to %s", step, [i.step for i in newer], dest)
        return dest


def resolve_root(run_or_ckpt_dir: str | Path) -> Path:
    """A run directory (with ``checkpoints/`` inside) or a checkpoint folder itself -> the checkpoint root."""
    p = Path(run_or_ckpt_dir)
    return p / "checkpoints" if (p / "checkpoints").is_dir() else p
