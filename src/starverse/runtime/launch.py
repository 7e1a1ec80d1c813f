"""Start one real process per rank, wire them into ``torch.distributed``, and fail fast together.

Ranks are spawned (never forked: CUDA and thread pools do not survive a fork), rendezvous through a
``TCPStore`` the launcher owns on 127.0.0.1, and run ``fn(rank_env, *args)``. The launcher watches every
process: when one dies (exception, non-zero exit, signal) it stops the others at once and raises a
:class:`~starverse.errors.DistributedError` naming the rank, its exit code or signal, and its last error.
Every collective has a timeout (``collective_timeout_s``), so a rank blocked on a dead peer cannot hang.
"""

from __future__ import annotations

import ast
import contextlib
import logging
import multiprocessing as mp
import os
import queue
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

from starverse.errors import ConfigError, DistributedError, StarverseError

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class RankSpec:
    """One rank to start: which device it drives and what it is."""

    rank: int
    """Rank in the job (0..world_size-1)."""
    device_kind: str
    """Accelerator id (catalog key) of the device: ``cpu``, ``h100-80gb-sxm``, ..."""
    device: str = "cpu"
    """torch device string: ``cpu``, ``cuda:0``, ..."""
    num_threads: int | None = None
    """Intra-op CPU threads for this rank (None: the machine's cores divided by the local CPU ranks)."""
    env: tuple[tuple[str, str], ...] = ()
    """Extra environment variables for the rank process."""

    @property
    def backend(self) -> str:
        """The native collective backend of this device (gloo for CPU)."""
        return native_backend(self.device)


def native_backend(device: str) -> str:
    """Collective backend for a torch device string: nccl (CUDA/ROCm), xla, hccl (Ascend), else gloo."""
    kind = device.split(":", 1)[0]
    return {"cuda": "nccl", "xla": "xla", "npu": "hccl", "mlu": "cncl"}.get(kind, "gloo")


@dataclass(frozen=True)
class RankEnv:
    """What a rank function receives: who it is and the job around it (picklable)."""

    spec: RankSpec
    """This rank."""
    ranks: tuple[RankSpec, ...]
    """All ranks of the job, indexed by rank."""
    collective_timeout_s: float
    """Timeout of every collective (and of the rendezvous)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Launcher-specific values (unused by the local launcher)."""

    @property
    def rank(self) -> int:
        """This rank."""
        return self.spec.rank

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return len(self.ranks)


def _world_backend(ranks: Sequence[RankSpec]) -> str:
    """The default group's backend: NCCL (plus gloo for CPU tensors) when every rank is CUDA, else gloo.

    A mixed job's default group is gloo over host memory; native groups per device kind are created by
    :func:`starverse.runtime.mesh.MixedMesh.build`.
    """
    backends = {r.backend for r in ranks}
    if backends == {"nccl"}:
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def _rank_environ(env: RankEnv, master_addr: str, port: int) -> None:
    """Set a rank's ``torch.distributed`` environment variables (and its logging) in its own process."""
    spec = env.spec
    os.environ.update(
        {
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(port),
            "RANK": str(spec.rank),
            "WORLD_SIZE": str(env.world_size),
            "LOCAL_RANK": str(env.extra.get("local_rank", spec.rank)),
            "STARVERSE_DEVICE_KIND": spec.device_kind,
            **dict(spec.env),
        }
    )
    logging.basicConfig(level=os.environ.get("STARVERSE_LOG_LEVEL", "WARNING"))


def _join_world(env: RankEnv, master_addr: str, port: int) -> None:
    """In a rank's process: set its threads and device, join the store at ``master_addr:port``, init the group."""
    import torch
    import torch.distributed as dist

    spec = env.spec
    num_cpu = sum(1 for r in env.ranks if r.device == "cpu") or 1
    threads = spec.num_threads or max(1, (os.cpu_count() or 1) // num_cpu)
    torch.set_num_threads(threads)
    if spec.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(spec.device))
    timeout = timedelta(seconds=env.collective_timeout_s)
    store = dist.TCPStore(master_addr, port, env.world_size, is_master=False, timeout=timeout)
    dist.init_process_group(
        _world_backend(env.ranks), store=store, rank=spec.rank, world_size=env.world_size, timeout=timeout
    )


def _error_report(e: BaseException) -> tuple[str, str, BaseException | None]:
    """What a rank reports for an exception it is handling: one line, the traceback, the user error or None."""
    text = "".join(traceback.format_exception_only(type(e), e)).strip()
    return text, traceback.format_exc(), e if isinstance(e, StarverseError) else None


def _ordered_ranks(ranks: Sequence[RankSpec]) -> list[RankSpec]:
    """``ranks`` sorted by rank; DistributedError if empty or not exactly 0..n-1."""
    ranks = sorted(ranks, key=lambda r: r.rank)
    if not ranks:
        raise DistributedError("no ranks to launch; the provider found no devices. To fix: check `starverse probe`.")
    if [r.rank for r in ranks] != list(range(len(ranks))):
        raise DistributedError(f"ranks must be 0..{len(ranks) - 1}, got {[r.rank for r in ranks]}")
    return ranks


def _overrun(timeout_s: float, done: int, world: int) -> DistributedError:
    """The error for a job past its ``timeout_s`` with ``done`` of ``world`` ranks finished."""
    return DistributedError(
        f"job did not finish within {timeout_s:g} s ({done}/{world} ranks done); all ranks "
        "were stopped. To fix: raise the timeout or lower max_steps."
    )


def _rank_entry(
    fn: Callable[..., Any],
    env: RankEnv,
    args: tuple[Any, ...],
    store_port: int,
    results: Any,
) -> None:
    """Body of a rank process: set up the environment and process group, run ``fn``, report."""
    import torch.distributed as dist

    spec = env.spec
    _rank_environ(env, LOOPBACK, store_port)
    try:
        _join_world(env, LOOPBACK, store_port)
        try:
            value = fn(env, *args)
        finally:
            # Skip the barrier inside destroy when a peer is gone; it would only wait for the timeout.
            dist.destroy_process_group()
        results.put((spec.rank, "ok", value))
    except BaseException as e:
        text, tb, user = _error_report(e)
        try:
            results.put((spec.rank, "error", (text, tb, user)))
        except Exception:
            results.put((spec.rank, "error", (text, tb, None)))
        # Let the queue's feeder thread flush before exiting.
        results.close()
        results.join_thread()
        os._exit(1)


def _main_is_guarded(path: str) -> bool:
    """True if the script has a top-level ``if __name__ == "__main__":`` block."""
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError, UnicodeDecodeError):
        return False
    for node in tree.body:
        if isinstance(node, ast.If) and "__name__" in ast.unparse(node.test) and "__main__" in ast.unparse(node.test):
            return True
    return False


@contextlib.contextmanager
def _main_reimport_guard() -> Iterator[None]:
    """Keep spawned ranks from re-running an unguarded user script.

    ``spawn`` re-imports the parent's main script in every child (to find classes defined there). A
    script written without ``if __name__ == "__main__":`` -- like the product brief's five lines --
    would then start training again inside each rank. For such scripts the main module is hidden while
    the ranks start; classes defined in them are then not importable in the ranks (define them in a
    module, or guard the script).
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or path is None or getattr(main, "__spec__", None) is not None or _main_is_guarded(path):
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


LAUNCHERS = ("local", "ray")
"""Launchers known by name (``Trainer(launcher=...)``, ``launch(launcher=...)``)."""


class Launcher(Protocol):
    """Something that runs ``fn`` once per rank with :func:`launch`'s contract (e.g. ``RayLauncher``)."""

    def launch(
        self,
        fn: Callable[..., Any],
        ranks: Sequence[RankSpec],
        *,
        timeout_s: float,
        args: tuple[Any, ...] = (),
        collective_timeout_s: float = 120.0,
        grace_s: float = 3.0,
    ) -> list[Any]:
        """Run ``fn(rank_env, *args)`` on every rank; the results in rank order."""
        ...


def resolve_launcher(launcher: str | Launcher) -> Launcher | None:
    """The launcher object for a name or object; None for ``"local"`` (the spawn path of :func:`launch`).

    Raises ConfigError for an unknown name, and (from the Ray provider) when ``"ray"`` is asked for
    without Ray installed, so a wrong choice fails before any data is prepared.
    """
    if isinstance(launcher, str):
        if launcher == "local":
            return None
        if launcher == "ray":
            from starverse.providers.ray import RayLauncher, import_ray

            import_ray()
            return RayLauncher()
        from starverse.config import did_you_mean

        raise ConfigError(
            f"unknown launcher {launcher!r}: expected one of {', '.join(map(repr, LAUNCHERS))} or an object with "
            f"a launch() method.{did_you_mean(launcher, LAUNCHERS)}"
        )
    if not callable(getattr(launcher, "launch", None)):
        raise ConfigError(
            f"launcher {type(launcher).__name__} has no launch() method: expected one of "
            f"{', '.join(map(repr, LAUNCHERS))} or an object like starverse.providers.ray.RayLauncher."
        )
    return launcher


def launch(
    fn: Callable[..., Any],
    ranks: Sequence[RankSpec],
    *,
    timeout_s: float,
    args: tuple[Any, ...] = (),
    collective_timeout_s: float = 120.0,
    grace_s: float = 3.0,
    launcher: str | Launcher = "local",
) -> list[Any]:
    """Run ``fn(rank_env, *args)`` in one spawned process per rank; return the results in rank order.

    ``fn`` and ``args`` must be picklable (a module-level function). Each process has the default
    process group initialised (gloo, or NCCL+gloo when all ranks are CUDA) with ``collective_timeout_s``.

    Raises :class:`DistributedError` when a rank raises, exits non-zero or is killed (naming the rank
    and exit code/signal; the other ranks are terminated), or when the job exceeds ``timeout_s``. A
    :class:`StarverseError` raised inside a rank (bad input found there) is re-raised as itself.

    ``launcher``: ``"local"`` (this function's spawned processes), ``"ray"`` (one Ray actor per rank, see
    :mod:`starverse.providers.ray`) or any :class:`Launcher`; all keep the contract above.
    """
    other = resolve_launcher(launcher)
    if other is not None:
        return other.launch(
            fn, ranks, timeout_s=timeout_s, args=args, collective_timeout_s=collective_timeout_s, grace_s=grace_s
        )
    import torch.distributed as dist

    ranks = _ordered_ranks(ranks)
    world = len(ranks)
    # The launcher owns the rendezvous store: port 0 lets the OS pick a free port, no race with other jobs.
    store = dist.TCPStore(
        LOOPBACK, 0, world, is_master=True, timeout=timedelta(seconds=collective_timeout_s), wait_for_workers=False
    )
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs: list[Any] = []
    with _main_reimport_guard():
        for spec in ranks:
            env = RankEnv(spec=spec, ranks=tuple(ranks), collective_timeout_s=collective_timeout_s)
            p = ctx.Process(
                target=_rank_entry, args=(fn, env, args, store.port, results), name=f"starverse-rank{spec.rank}"
            )
            p.start()
            procs.append(p)
    log.info("launched %d ranks (store 127.0.0.1:%d)", world, store.port)

    values: dict[int, Any] = {}
    errors: dict[int, tuple[str, str | None, BaseException | None]] = {}
    deadline = time.monotonic() + timeout_s
    failed_at: float | None = None
    try:
        while len(values) < world:
            try:
                rank, status, payload = results.get(timeout=0.1)
                if status == "ok":
                    values[rank] = payload
                else:
                    errors[rank] = payload
            except queue.Empty:
                pass
            now = time.monotonic()
            dead = [s.rank for s, p in zip(ranks, procs, strict=True) if p.exitcode not in (None, 0)]
            silent = [
                s.rank for s, p in zip(ranks, procs, strict=True)
                if p.exitcode == 0 and s.rank not in values
            ]
            if (errors or dead) and failed_at is None:
                failed_at = now
            if silent and failed_at is None:
                failed_at = now
            # After the first failure, wait briefly so the root cause (the rank that died first, whose
            # peers then fail on a closed connection) can report too.
            if failed_at is not None and now - failed_at > 1.0:
                break
            if now > deadline:
                raise _overrun(timeout_s, len(values), world)
    finally:
        if len(values) < world:
            _stop_all(procs, grace_s)
        else:
            for p in procs:
                p.join(timeout=grace_s)
            _stop_all(procs, 0.0)
        results.close()
    if len(values) < world:
        raise _failure(ranks, procs, values, errors)
    return [values[r] for r in range(world)]


RankErrors = dict[int, tuple[str, str | None, BaseException | None]]
"""rank -> (one-line error, traceback or None, the user error to re-raise as itself or None)."""


def _failure(
    ranks: Sequence[RankSpec],
    procs: list[Any],
    values: dict[int, Any],
    errors: RankErrors,
) -> BaseException:
    """The error to raise for a failed job: the root-cause rank first.

    Priority: a user error (bad input found inside a rank) is re-raised as itself; then a rank killed by
    a signal or one that exited without reporting (its peers' errors are only consequences); then the
    first rank that reported an exception.
    """
    user = user_error(errors)
    if user is not None:
        return user
    for spec, p in zip(ranks, procs, strict=True):
        if getattr(p, "_starverse_killed_by_us", False) or spec.rank in errors or spec.rank in values:
            continue
        if p.exitcode is not None:
            return _rank_error(
                f"rank {spec.rank} ({spec.device_kind}, {spec.device}) {_describe_exit(p.exitcode)} without "
                "reporting a result; the other ranks were stopped. To fix: check that rank's log and memory "
                "(an out-of-memory kill shows as SIGKILL).",
                spec.rank, p.exitcode,
            )
    if errors:
        rank = min(errors)
        return reported_failure(ranks, errors, exitcode=procs[rank].exitcode)
    return DistributedError("a rank exited without a result; the other ranks were stopped.")


def user_error(errors: RankErrors) -> BaseException | None:
    """Bad input found inside a rank (the lowest such rank): re-raised as itself, whatever the launcher."""
    for rank in sorted(errors):
        user = errors[rank][2]
        if user is not None:
            return user
    return None


def reported_failure(ranks: Sequence[RankSpec], errors: RankErrors, *, where: str = "",
                     exitcode: int | None = None) -> DistributedError:
    """The error for the lowest rank that reported an exception (``where``: e.g. " on node 10.0.0.2")."""
    rank = min(errors)
    text, tb, _ = errors[rank]
    if tb:
        log.error("rank %d traceback:\n%s", rank, tb)
    spec = ranks[rank]
    hint = ""
    if "timed out" in text.lower() or "timeout" in text.lower():
        hint = (
            " A peer did not join a collective within collective_timeout_s: it hung or is far slower. "
            "To fix: look at the other ranks' logs, or raise collective_timeout_s."
        )
    return _rank_error(
        f"rank {rank} ({spec.device_kind}, {spec.device}) failed{where}: {text}; the other ranks were stopped.{hint}",
        rank, exitcode,
    )


def _rank_error(message: str, rank: int, exitcode: int | None) -> DistributedError:
    """A DistributedError carrying ``failed_rank`` and ``rank_exitcode`` (negative: killed by that signal)."""
    err = DistributedError(message)
    err.failed_rank = rank  # type: ignore[attr-defined]
    err.rank_exitcode = exitcode  # type: ignore[attr-defined]
    return err


def _stop_all(procs: list[Any], grace_s: float) -> None:
    """Terminate what still runs (SIGTERM, then SIGKILL after ``grace_s``) and reap everything."""
    for p in procs:
        if p.exitcode is None:
            p._starverse_killed_by_us = True
            p.terminate()
    end = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            p.join(timeout=5.0)
