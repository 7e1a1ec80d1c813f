"""The local provider: the devices of this machine, one rank each, and the launcher that runs them.

Devices: CUDA GPUs when present (one rank per GPU, the accelerator id derived from the device name), otherwise
CPU ranks (``num_cpu_ranks``, else ``$STARVERSE_CPU_RANKS``, else 2), each with its share of the cores.

:class:`LocalLauncher` starts one process per rank from :func:`rank_context` (never a plain fork of the
launcher: CUDA and thread pools do not survive a fork); they rendezvous through a ``TCPStore`` the launcher
owns, listening on 127.0.0.1 only, and run ``fn(rank_env, *args)``. The launcher watches every process and
fails fast with a typed error (:mod:`starverse.providers.failures`).

Start-up: on Linux the ranks are forked from a *fork server* (``multiprocessing``'s ``forkserver``), a clean
process started once per launcher process that has imported torch and the rank modules and never touches CUDA
or a thread pool of torch's; a rank then starts in milliseconds instead of importing torch again (seconds of
CPU each). A job's server (:func:`rank_server`) is forked from the launcher itself once the launcher has imported
those modules (:mod:`starverse.providers.forkserver_zygote`: they are imported once, not twice), else -- the
launcher runs threads, or ``STARVERSE_START_METHOD=forkserver-exec`` -- and for launches outside a job it is a
freshly exec'd interpreter that imports them. ``STARVERSE_START_METHOD=spawn`` (and other platforms) start every
rank as a fresh interpreter. A forked rank runs with the launcher's environment *at the rank's start* (the
server's own is frozen when it starts), applied before the rank's function and arguments are loaded.

A rank never outlives its launcher. Its parent is the launcher (spawn) or the fork server, whose parent is the
launcher and which exits once the launcher is gone (the ranks close their copy of the server's "alive" pipe,
so the launcher holds its last write end). The rank asks the kernel for SIGKILL when its parent dies
(``PR_SET_PDEATHSIG``) and its heartbeat thread exits it when its parent changes or (a server) is no longer the
launcher's child, which is at once when the launcher dies; the launcher, in turn,
declares a rank whose heartbeat stops (a stopped or hung process) lost.
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import logging
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

from starverse.errors import ConfigError, DistributedError
from starverse.providers import forkserver_zygote
from starverse.providers.failures import code_error, lost_heartbeat, lost_process, overrun, user_error
from starverse.runtime.devices import DEFAULT_CPU_RANKS, accelerator_id, cpu_rank_count, local_ranks  # noqa: F401
from starverse.runtime.launch import (
    LOOPBACK,
    RankEnv,
    RankError,
    RankSpec,
    error_report,
    join_world,
    ordered_ranks,
    rank_environ,
    set_rank_device,
    store_server,
)

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_PR_SET_NAME = 15
RANK_PROCESS_NAME = "sv-rank{rank}"
"""A rank process's name (``/proc/PID/comm``, what ``ps`` and ``top`` show) on Linux: ``sv-rank0``, ..."""

START_METHOD_ENV = "STARVERSE_START_METHOD"
"""How rank processes start: ``forkserver`` (the default on Linux: a job's server forked from the launcher when it
can be, see :func:`rank_server`), ``forkserver-exec`` (the server always a fresh interpreter) or ``spawn`` (the
default elsewhere)."""
_START_METHODS = ("forkserver", "forkserver-exec", "spawn")

_PRELOAD = ("starverse.providers.forkserver_exit", "torch", "torch.distributed", "starverse.providers.local",
            "starverse.runtime.rank_loop")
"""What the fork server imports before it forks the first rank."""
_PRELOAD_LAST = "starverse.providers.forkserver_ready"
"""The fork server's last preload (its garbage collector back on, the preload frozen)."""
_PRELOAD_IF_LOADED = ("starverse.", "torch.distributed.checkpoint", "transformers")
"""Prefixes of modules the fork server also imports when the launcher has them loaded when it starts the server
(the launcher has built the model, its checkpoint and billing callbacks: its ranks load them too)."""
_NEVER_PRELOAD = ("starverse.cli", "starverse.service", "starverse.providers.ray", "starverse.elastic.inplace",
                  "starverse.runtime.ft")
"""Never in the fork server: Ray, torchft and the web stack may start threads when imported."""


_RANK_MODULES: list[str] = []
"""Modules this process's ranks will need that it may not have loaded when it starts the fork server (the model's
``transformers`` classes, see :func:`start_rank_server`); preloaded after :data:`_PRELOAD`."""


def _preload_modules() -> list[str]:
    """The fork server's preload: :data:`_PRELOAD` and :data:`_RANK_MODULES`, then loaded modules under
    :data:`_PRELOAD_IF_LOADED`."""
    loaded = [m for m in list(sys.modules) if m.startswith(_PRELOAD_IF_LOADED) and not m.startswith(_NEVER_PRELOAD)
              and "._" not in m and (not m.startswith("transformers.") or ".modeling_" in m)]
    first = [*_PRELOAD, *(m for m in _RANK_MODULES if m not in _PRELOAD)]
    return [*first, *sorted(m for m in loaded if m not in first and m != _PRELOAD_LAST), _PRELOAD_LAST]


def _zygote_preload() -> list[str]:
    """What the launcher imports before it forks the server: the server's preload without the two modules that
    only act inside an exec'd server (its fast exit, its collector switched back on)."""
    return [m for m in _preload_modules() if m not in (_PRELOAD[0], _PRELOAD_LAST)]


@contextlib.contextmanager
def rank_server(modules: Sequence[str] = ()) -> Iterator[int | None]:
    """Run one job's ranks from a fork server that has ``modules`` (and torch, the rank modules) imported.

    With ``forkserver`` (the default on Linux) the server is forked from this process after it imported them
    (:func:`starverse.providers.forkserver_zygote.fork_server`) -- this process needs them anyway to build the
    model -- and stopped when the block ends, so the next job in this process never gets this one's state. When
    a server runs already, or this process cannot fork one (threads run: said in a debug log), or with
    ``forkserver-exec``, it is :func:`start_rank_server`'s exec'd server, kept for later launches. Yields the
    forked server's pid, None otherwise (``spawn``: no server).

    A forked server does not import the main script again: what a rank gets by reference from ``__main__`` must
    be defined there before the block starts (a job's rank function and callbacks live in starverse's modules)."""
    pid = None
    if start_method() == "forkserver":
        _RANK_MODULES.extend(m for m in modules if m not in _RANK_MODULES)
        rank_context()  # sets the preload of a server started later
        try:
            pid = forkserver_zygote.fork_server(_zygote_preload())
        except OSError as e:  # fork itself failed (no memory, a process limit)
            log.debug("fork server: fork failed (%s); starting a fresh interpreter", e)
    if pid is None:
        start_rank_server(modules)
    try:
        yield pid
    finally:
        if pid is not None:
            forkserver_zygote.stop(pid)


def start_rank_server(modules: Sequence[str] = ()) -> bool:
    """Start this process's fork server now (where ranks start from one), also preloading ``modules``.

    The server imports torch and the rank modules (seconds of CPU) in its own process: started early -- once a job
    is checked, before its supervisor builds the model -- that runs alongside this process's own work instead of
    after it, when the first rank starts. Later launches use the same server (ranks then need only what this
    process had loaded by now, plus ``modules``: what is missing a rank imports itself). Returns whether a server
    runs; a no-op with ``spawn``."""
    if start_method() == "spawn":
        return False
    _RANK_MODULES.extend(m for m in modules if m not in _RANK_MODULES)
    rank_context()  # sets the preload
    with _main_reimport_guard():
        forkserver.ensure_running()
    return True


def start_method() -> str:
    """How rank processes start here: ``$STARVERSE_START_METHOD``, else ``forkserver`` on Linux, else ``spawn``."""
    method = os.environ.get(START_METHOD_ENV) or ("forkserver" if sys.platform.startswith("linux") else "spawn")
    if method not in _START_METHODS:
        raise ConfigError(f"{START_METHOD_ENV}={method!r}: not a start method; to fix: set it to one of "
                          f"{', '.join(_START_METHODS)} or unset it.")
    return method


def _apply_environ(environ: dict[str, str]) -> bool:
    """In a rank forked from the server: replace the server's environment with the launcher's (at unpickling)."""
    os.environ.clear()
    os.environ.update(environ)
    return True


class _LauncherEnviron:
    """Pickled first with a rank's process object: unpickled (in the rank), it installs the launcher's
    environment before the process's target and arguments (and the modules they come from) are loaded."""

    def __init__(self) -> None:
        self.environ = dict(os.environ)

    def __reduce__(self) -> tuple[Any, tuple[dict[str, str]]]:
        return _apply_environ, (self.environ,)


class _ForkedRank(mp.context.ForkServerProcess):  # type: ignore[name-defined,misc]
    """A rank process forked from the fork server, started with the launcher's current environment."""

    def __getstate__(self) -> dict[str, Any]:
        # dict items unpickle in order: the environment first
        return {"_launcher_environ": _LauncherEnviron(), **self.__dict__}


class _RankForkServer(mp.context.ForkServerContext):  # type: ignore[name-defined,misc]
    Process = _ForkedRank


def rank_context() -> Any:
    """The ``multiprocessing`` context rank processes start from (its ``Process``, ``Queue``, ``Array``).

    :func:`start_method` picks it. The fork server's preload is set when this process first starts it."""
    if start_method() == "spawn":
        return mp.get_context("spawn")
    ctx = _RankForkServer()
    ctx.set_forkserver_preload(_preload_modules())
    return ctx


def _parent_of(pid: int) -> int | None:
    """The parent pid of ``pid`` (Linux ``/proc``), None when unknown."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
        return int(raw[raw.rindex(")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _started_by(server: int, launcher_pid: int) -> bool:
    """Whether process ``server`` (a rank's parent) is a child of the launcher; without ``/proc`` (not Linux):
    whether it is a parent at all (not init, which adopted the rank of a launcher that died)."""
    parent = _parent_of(server)
    return parent == launcher_pid if parent is not None else server != 1


def _drop_server_pipe() -> None:
    """In a rank forked from the server: close its copy of the server's "alive" pipe, so that the server sees
    the end of the pipe -- and exits, taking the ranks with it -- once the launcher is gone."""
    from multiprocessing import forkserver

    server: Any = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None and getattr(server, "_forkserver_pid", None) is None:  # not a server this rank started
        with contextlib.suppress(OSError):
            os.close(fd)
        server._forkserver_alive_fd = None


def _name_process(name: str) -> None:
    """Name this process (Linux, up to 15 bytes): forked ranks would otherwise all show the fork server's name."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def die_with_parent(launcher_pid: int) -> int:
    """In a rank process: be SIGKILLed by the kernel when the parent dies (Linux), and exit now if the launcher
    is already gone; returns the parent to watch (the launcher, or the fork server the launcher started)."""
    parent = os.getppid()
    if parent != launcher_pid:
        _drop_server_pipe()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d); the heartbeat still ends this rank",
                        ctypes.get_errno())
    if not _parent_alive(parent, launcher_pid):  # it died between the fork and the prctl, or the launcher did
        os._exit(1)
    return parent


def _parent_alive(parent: int, launcher_pid: int) -> bool:
    """Whether this rank's ``parent`` is still its parent and, if it is a fork server, still the launcher's child
    (a dead launcher's server is adopted at once, while its own exit may take a while on a loaded machine)."""
    return os.getppid() == parent and (parent == launcher_pid or _started_by(parent, launcher_pid))


def _heartbeat(beats: Any, rank: int, parent: int, launcher_pid: int, period_s: float) -> None:
    """Rank side: stamp ``beats[rank]`` every ``period_s``; exit the process once the launcher is gone."""
    while True:
        beats[rank] = time.monotonic()
        if not _parent_alive(parent, launcher_pid):
            os._exit(1)
        time.sleep(period_s)


def _rank_entry(
    fn: Callable[..., Any],
    env: RankEnv,
    args: tuple[Any, ...],
    store_port: int | None,
    results: Any,
    beats: Any,
    parent_pid: int,
    heartbeat_s: float,
) -> None:
    """Body of a rank process: tie it to its parent, start the heartbeat, set up the process group, run ``fn``.

    ``store_port`` None: no ``torch.distributed`` world (a torchft replica forms its own groups)."""
    import torch.distributed as dist

    _name_process(RANK_PROCESS_NAME.format(rank=env.rank))
    parent = die_with_parent(parent_pid)
    threading.Thread(target=_heartbeat, args=(beats, env.rank, parent, parent_pid, heartbeat_s), name="heartbeat",
                     daemon=True).start()
    spec = env.spec
    rank_environ(env, LOOPBACK, store_port or 0)
    try:
        if store_port is None:
            set_rank_device(env)
            value = fn(env, *args)
        else:
            join_world(env, LOOPBACK, store_port)
            try:
                value = fn(env, *args)
            finally:
                # Skip the barrier inside destroy when a peer is gone; it would only wait for the timeout.
                dist.destroy_process_group()
        results.put((spec.rank, "ok", value))
    except BaseException as e:
        text, tb, user = error_report(e)
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
    """Keep ranks from re-running an unguarded user script.

    ``spawn`` and the fork server re-import the parent's main script in every child (to find classes defined there). A
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


@dataclass
class LocalLauncher:
    """Runs ``fn(rank_env, *args)`` in one process per rank on this machine (``launcher="local"``)."""

    heartbeat_s: float = 1.0
    """How often each rank stamps its heartbeat (and checks that its parent is alive)."""
    heartbeat_timeout_s: float = 60.0
    """A rank whose process lives but whose heartbeat is older than this is lost (``LossCause.HEARTBEAT``)."""
    _procs: list[Any] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_s < self.heartbeat_timeout_s:
            raise ConfigError(f"LocalLauncher: need 0 < heartbeat_s < heartbeat_timeout_s (got {self.heartbeat_s}, "
                              f"{self.heartbeat_timeout_s}).")

    def notify(self, signum: int) -> int:
        """Send ``signum`` to every rank process still running (SIGTERM: a job-wide preemption notice)."""
        return signal_processes(self._procs, signum)

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
        """See :func:`starverse.runtime.launch.launch`."""
        ranks = ordered_ranks(ranks)
        world = len(ranks)
        # The launcher owns the rendezvous store: port 0 lets the OS pick a free port, no race with other jobs.
        store = store_server(LOOPBACK, world, collective_timeout_s)
        ctx = rank_context()
        results = ctx.Queue()
        beats = ctx.Array("d", world, lock=False)
        procs: list[Any] = []
        self._procs = procs
        with _main_reimport_guard():
            for spec in ranks:
                env = RankEnv(spec=spec, ranks=tuple(ranks), collective_timeout_s=collective_timeout_s)
                p = ctx.Process(
                    target=_rank_entry,
                    args=(fn, env, args, store.port, results, beats, os.getpid(), self.heartbeat_s),
                    name=f"starverse-rank{spec.rank}",
                )
                p.start()
                procs.append(p)
        log.info("launched %d ranks (store 127.0.0.1:%d)", world, store.port)
        values: dict[int, Any] = {}
        errors: dict[int, RankError] = {}
        silent: dict[int, float] = {}
        try:
            self._watch(ranks, procs, results, beats, values, errors, silent, timeout_s)
        finally:
            if len(values) < world:
                _stop_all(procs, grace_s)
            else:
                for p in procs:
                    p.join(timeout=grace_s)
                _stop_all(procs, 0.0)
            results.close()
            self._procs = []
        if len(values) < world:
            raise _failure(ranks, procs, values, errors, silent)
        return [values[r] for r in range(world)]

    def _watch(self, ranks: list[RankSpec], procs: list[Any], results: Any, beats: Any, values: dict[int, Any],
               errors: dict[int, RankError], silent: dict[int, float], timeout_s: float) -> None:
        """Collect results until every rank reported, or shortly after the first failure."""
        world = len(ranks)
        deadline = time.monotonic() + timeout_s
        failed_at: float | None = None
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
            quiet = [s.rank for s, p in zip(ranks, procs, strict=True) if p.exitcode == 0 and s.rank not in values]
            for s, p in zip(ranks, procs, strict=True):
                last = beats[s.rank]
                if p.exitcode is None and last > 0 and now - last > self.heartbeat_timeout_s:
                    silent[s.rank] = now - last
            if (errors or dead or quiet or silent) and failed_at is None:
                failed_at = now
            # After the first failure, wait briefly so the root cause (the rank that died first, whose
            # peers then fail on a closed connection) can report too.
            if failed_at is not None and (now - failed_at > 1.0 or silent):
                return
            if now > deadline:
                raise overrun(timeout_s, len(values), world)


def _failure(
    ranks: Sequence[RankSpec],
    procs: list[Any],
    values: dict[int, Any],
    errors: dict[int, RankError],
    silent: dict[int, float],
) -> BaseException:
    """The error to raise for a failed job: the root-cause rank first.

    Priority: bad input found inside a rank (a ConfigError) is re-raised as itself; then a rank killed by
    a signal, one that exited without reporting, or one whose heartbeat stopped (its peers' errors are only
    consequences); then another typed error raised in a rank, as itself; then the first rank that reported an
    exception.
    """
    user = user_error(errors, ConfigError)
    if user is not None:
        return user
    if silent:
        rank = min(silent)
        return lost_heartbeat(ranks[rank], silent[rank])
    for spec, p in zip(ranks, procs, strict=True):
        if getattr(p, "_starverse_killed_by_us", False) or spec.rank in errors or spec.rank in values:
            continue
        if p.exitcode is not None:
            return lost_process(spec, p.exitcode)
    raised = user_error(errors)
    if raised is not None:
        return raised
    if errors:
        rank = min(errors)
        return code_error(ranks, errors, exit_status=procs[rank].exitcode)
    return DistributedError("a rank exited without a result; the other ranks were stopped.")


def signal_processes(procs: list[Any], signum: int) -> int:
    """Send ``signum`` to every process of ``procs`` still running; returns how many it reached."""
    n = 0
    for p in list(procs):
        if p.exitcode is None and p.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signum)
                n += 1
    return n


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
