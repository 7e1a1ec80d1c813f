"""Per-rank save and load on ``torch.distributed.checkpoint`` (DCP): asynchronous, atomic, reshardable.

Asynchronous save, and why training barely blocks: ``save()`` captures the small state (step, LR schedule,
sampler, RNG) at once and returns; a background thread clones the large state (weights, optimizer moments)
to a CPU snapshot, then writes it with DCP. Weights and moments only change inside ``optimizer.step()``, so
the clone overlaps the next forward/backward; an optimizer step pre-hook waits for the clone to finish
before the first update that would change what is being copied. The time training waits is recorded in
``stats.blocked_s`` (``benchmarks/bench_recovery.py`` compares it with a synchronous save).

Atomic: every rank writes into the same partial folder; DCP's coordinator (rank 0) writes the DCP
``.metadata`` once all ranks finished; rank 0 then checksums, writes our manifest last, and renames the
folder to ``step-N`` (see ``store.py``). Collectives of a background save run on their own gloo group
(``group``), never on the training group, so they cannot interleave with training collectives.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import warnings
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from starverse.checkpoint.state import (
    apply_train_state,
    capture_rng,
    clone_tree,
    fingerprint,
    plain,
    restore_rng,
    train_state,
)
from starverse.checkpoint.store import CheckpointInfo, CheckpointStore
from starverse.errors import CheckpointError

log = logging.getLogger(__name__)

# DCP warns on every single-process save/load that it "assumes" one process: that is our intent (no_dist).
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


@dataclass
class SaveStats:
    """What checkpointing cost this rank so far."""

    num_saves: int = 0
    """Saves started."""
    blocked_s: float = 0.0
    """Seconds the training thread waited for checkpointing (capture, staging, previous save)."""
    last_write_s: float = 0.0
    """Seconds the last save took from start to commit (in the background when asynchronous)."""
    last_bytes: int = 0
    """Bytes of the last committed checkpoint (rank 0 only)."""
    write_s_history: list[float] = field(default_factory=list)
    """Start-to-commit seconds of every save (to estimate the save cost C for the interval)."""


@dataclass(frozen=True)
class LoadedState:
    """What a load returns besides the model and optimizer it filled in."""

    info: CheckpointInfo
    """The checkpoint loaded."""
    extras: Mapping[str, Any]
    """The global state saved with it (step, LR schedule, sampler, shares, ...)."""
    resharded: bool
    """True when it was written by a different number of ranks."""


class Checkpointer:
    """Saves and loads this rank's part of a checkpoint. One per rank process; all ranks call in step."""

    def __init__(
        self,
        store: CheckpointStore,
        *,
        rank: int = 0,
        world_size: int = 1,
        group: dist.ProcessGroup | None = None,
        device_kind: str = "cpu",
        async_save: bool = True,
        io_threads: int = 1,
        writer_factory: Any = None,
    ):
        """``group`` is a gloo group reserved for checkpoint collectives (None when ``world_size`` is 1);
        ``writer_factory(path) -> StorageWriter`` replaces DCP's FileSystemWriter (tests inject faults)."""
        if world_size > 1 and group is None:
            raise CheckpointError("a multi-rank Checkpointer needs a gloo process group for its collectives")
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.device_kind = device_kind
        self.async_save = async_save
        self.io_threads = io_threads
        self.writer_factory = writer_factory
        self.stats = SaveStats()
        self.attempt = self._agree_attempt()
        self.device_kinds = self._gather_kinds()
        self._thread: threading.Thread | None = None
        self._staged = threading.Event()
        self._staged.set()
        self._error: BaseException | None = None
        self._last_info: CheckpointInfo | None = None
        self._hooked: set[int] = set()
        self._hooks: list[Any] = []
        self._crcs: dict[str, tuple[int, int]] = {}
        self._purge_lock = threading.Lock()
        self._purge_thread: threading.Thread | None = None

    def _agree_attempt(self) -> str:
        # One id per launch, shared by all ranks: names the partial folders this attempt writes.
        token = [f"{time.time_ns():x}"]
        if self.world_size > 1:
            dist.broadcast_object_list(token, src=0, group=self.group)
        return token[0]

    # ---- save ------------------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        extras: Mapping[str, Any] | None = None,
        manifest: Mapping[str, Any] | None = None,
        reason: str = "interval",
        blocking: bool | None = None,
    ) -> CheckpointInfo | None:
        """Checkpoint ``step``. Asynchronous unless ``blocking`` (or the Checkpointer is synchronous); a
        blocking save returns the committed checkpoint on rank 0 (None on other ranks)."""
        t0 = time.perf_counter()
        self._join()  # one save in flight at a time; raises if the previous one failed
        sync = (not self.async_save) if blocking is None else blocking
        fp, num_params = fingerprint(model)
        small = {
            "extras": plain(dict(extras or {}, step=step)),
            "rng": capture_rng(),
        }
        full_manifest = dict(manifest or {})
        full_manifest.update(
            reason=reason,
            world_size=self.world_size,
            model={**dict(full_manifest.get("model") or {}), "fingerprint": fp, "num_params": num_params},
        )
        refs = train_state(model, optimizer)
        self._hook(optimizer)
        self._staged.clear()
        self._error = None
        self.stats.num_saves += 1
        args = (step, refs, small, full_manifest, t0, sync)
        if sync:
            self._run(*args)
            self.stats.blocked_s += time.perf_counter() - t0
            if self._error is not None:
                raise self._wrap(self._error, step)
            return self._last_info
        self._thread = threading.Thread(target=self._run, args=args, name=f"ckpt-step-{step}", daemon=True)
        self._thread.start()
        self.stats.blocked_s += time.perf_counter() - t0
        return None

    def _run(self, step: int, refs: dict, small: dict, manifest: dict, t0: float, sync: bool) -> None:
        try:
            try:
                # a synchronous save writes the live tensors directly: nothing changes them meanwhile
                staged = refs if sync else clone_tree(refs)
            finally:
                self._staged.set()
            partial = self.store.partial_dir(step, self.attempt)
            partial.mkdir(parents=True, exist_ok=True)
            torch.save(small["rng"], partial / f"rng-{self.rank}.pt")
            if self.rank == 0:
                torch.save(small["extras"], partial / "extras.pt")
            self._crcs.clear()
            writer = (self.writer_factory or self._fs_writer)(partial)
            import torch.distributed.checkpoint as dcp

            dcp.save(staged, storage_writer=writer, process_group=self.group, no_dist=self.world_size == 1)
            crcs = self._gather_crcs()
            if self.rank == 0:
                manifest["device_kinds"] = self.device_kinds
                info = self.store.commit(partial, step, manifest, known=crcs)
                self.stats.last_bytes = info.size_bytes
                self._last_info = info
                # Retention is housekeeping, not part of making this checkpoint durable: off the save path.
                self._purge_thread = threading.Thread(target=self._purge, name="ckpt-purge", daemon=True)
                self._purge_thread.start()
                log.info("checkpoint step-%d committed (%.1f MB, %.2f s, %s)", step, info.size_bytes / 1e6,
                         time.perf_counter() - t0, manifest.get("reason"))
            write_s = time.perf_counter() - t0
            self.stats.last_write_s = write_s
            self.stats.write_s_history.append(write_s)
        except BaseException as e:  # surfaced to the training thread at the next save/wait
            self._error = e
            log.error("checkpoint of step %d failed on rank %d: %s", step, self.rank, e)

    def _purge(self) -> None:
        with self._purge_lock:
            try:
                self.store.purge()
            except OSError as e:  # a failed deletion never fails training; the next purge retries
                log.warning("checkpoint retention failed: %s", e)

    def _gather_crcs(self) -> dict[str, tuple[int, int]]:
        """(bytes, CRC-32) of the data files every rank wrote, computed while writing (no re-read)."""
        mine = dict(self._crcs)
        if self.world_size == 1:
            return mine
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.group)
        return {k: v for d in everyone for k, v in (d or {}).items()}

    def _gather_kinds(self) -> list[str]:
        if self.world_size == 1:
            return [self.device_kind]
        kinds: list[Any] = [None] * self.world_size
        dist.all_gather_object(kinds, self.device_kind, group=self.group)
        return [str(k) for k in kinds]

    def _fs_writer(self, path: Path) -> Any:
        return crc_writer(path, self._crcs, thread_count=self.io_threads)

    def _hook(self, optimizer: torch.optim.Optimizer | None) -> None:
        if optimizer is None or id(optimizer) in self._hooked:
            return
        self._hooked.add(id(optimizer))
        self._hooks.append(optimizer.register_step_pre_hook(lambda *_: self.wait_staged()))

    @property
    def last_committed(self) -> CheckpointInfo | None:
        """The last checkpoint this rank committed (rank 0 only; None elsewhere or before the first)."""
        return self._last_info

    @property
    def in_flight(self) -> bool:
        """True while a background save is still running."""
        return self._thread is not None and self._thread.is_alive()

    def wait_staged(self) -> None:
        """Block until the snapshot of the last save is taken (call before changing weights by hand)."""
        if self._staged.is_set():
            return
        t0 = time.perf_counter()
        self._staged.wait()
        self.stats.blocked_s += time.perf_counter() - t0

    def _join(self) -> None:
        if self._thread is not None:
            t0 = time.perf_counter()
            self._thread.join()
            self.stats.blocked_s += time.perf_counter() - t0
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise self._wrap(err, None)

    @staticmethod
    def _wrap(err: BaseException, step: int | None) -> CheckpointError:
        if isinstance(err, CheckpointError):
            return err
        what = f"of step {step} " if step is not None else ""
        return CheckpointError(
            f"checkpoint {what}failed: {err.__class__.__name__}: {err}. The previous complete checkpoint is "
            "untouched. To fix: check free disk space and permissions of the checkpoint directory."
        )

    def wait(self) -> CheckpointInfo | None:
        """Wait for the save in flight (and its retention pass); return the committed checkpoint on rank 0."""
        self._join()
        if self._purge_thread is not None:
            self._purge_thread.join()
        return self._last_info if self.rank == 0 else None

    def close(self) -> None:
        """Finish the save in flight and remove the optimizer hooks."""
        try:
            self.wait()
        finally:
            for h in self._hooks:
                h.remove()
            self._hooks.clear()
            self._hooked.clear()

    # ---- load ------------------------------------------------------------------------------------------
    def load(
        self, info: CheckpointInfo, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> LoadedState:
        """Verify ``info`` (manifest, sizes, checksums, model fingerprint) and load it into model and
        optimizer on this rank; restore this rank's RNG. Reads only: nothing in the store is changed."""
        fp, num_params = fingerprint(model)
        want = info.model_fingerprint
        if want != fp:
            raise CheckpointError(
                f"{info.path}: written for a different model ({info.num_params:,} parameters, fingerprint "
                f"{want}; this run's model has {num_params:,}, fingerprint {fp}). To fix: resume with the "
                "model it was written for, or use a new run directory."
            )
        self.store.verify(info)
        self.wait_staged()
        sd = train_state(model, optimizer)
        try:
            import torch.distributed.checkpoint as dcp

            dcp.load(sd, storage_reader=dcp.FileSystemReader(info.path), no_dist=True)
            apply_train_state(model, optimizer, sd)
            extras = torch.load(info.path / "extras.pt", weights_only=True)
            src_rank = self.rank if self.rank < info.world_size else self.rank % max(info.world_size, 1)
            rng = torch.load(info.path / f"rng-{src_rank}.pt", weights_only=True)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(
                f"{info.path}: cannot be loaded ({e.__class__.__name__}: {str(e).splitlines()[0][:200]}). "
                "To fix: resume from another step (`starverse checkpoints list RUN_DIR`)."
            ) from None
        restore_rng(rng)
        return LoadedState(info=info, extras=extras, resharded=info.world_size != self.world_size)


class _CrcStream:
    """A write stream that computes the CRC-32 of what passes through it (DCP only appends)."""

    def __init__(self, f: Any, name: str, out: dict[str, tuple[int, int]]):
        self.f, self.name, self.out = f, name, out
        self.crc = 0
        self.nbytes = 0

    def write(self, b: Any) -> int:
        n = self.f.write(b)
        self.crc = zlib.crc32(b, self.crc)
        self.nbytes += memoryview(b).nbytes
        return n

    def tell(self) -> int:
        return self.f.tell()

    def flush(self) -> None:
        self.f.flush()

    def fileno(self) -> int:
        return self.f.fileno()

    def close(self) -> None:
        if not self.f.closed:
            self.f.close()
            if self.nbytes == self.f_size():
                self.out[self.name] = (self.nbytes, self.crc)

    def f_size(self) -> int:
        return os.stat(self.f.name).st_size

    def __enter__(self) -> _CrcStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def crc_writer(path: Path, out: dict[str, tuple[int, int]], thread_count: int = 1) -> Any:
    """DCP's FileSystemWriter whose data files record (bytes, CRC-32) into ``out`` as they are written,
    so the manifest's checksums cost no second read of the checkpoint."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    class _CrcFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path: Any, mode: str) -> Any:
            p = Path(path)
            if mode != "wb" or p.suffix != ".distcp":
                with super().create_stream(path, mode) as s:
                    yield s
                return
            with _CrcStream(open(p, "wb"), p.name, out) as s:
                yield s

    writer = FileSystemWriter(path, thread_count=thread_count, sync_files=True, overwrite=False)
    writer.fs = _CrcFileSystem()
    return writer
