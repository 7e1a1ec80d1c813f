"""The rank fork server as a fork of the launcher itself (a "zygote"), instead of a freshly exec'd interpreter.

``multiprocessing``'s fork server is a new interpreter that imports torch, the rank modules and the model's
``transformers`` classes (~5-8 s of CPU) while the launcher -- a job's supervisor, which builds the model --
imports the same modules itself. :func:`fork_server` imports them here once and forks the server from this
process, then runs ``multiprocessing.forkserver.main`` in the child and points this process's fork server client
(``multiprocessing.forkserver._forkserver``: address, "alive" pipe, pid -- the state ``ensure_running`` sets) at
it; the ranks fork from it exactly as from the exec'd one.

A fork copies the whole process, so the child is made to look like the exec'd server before it serves:

- it forks only while this process runs one thread (no Python thread, no native one: a pool of OpenBLAS threads
  is shut down first, as its own ``atfork`` handler would; an OpenMP pool or any other thread refuses) and has
  not loaded the CUDA driver (a process forked after ``cuInit`` cannot use CUDA); else :func:`fork_refusal`
  says why and the caller starts the exec'd server;
- every inherited descriptor but stdio, the listener and the alive pipe's read end is pointed at ``/dev/null``
  (``dup2``, not ``close``: Python objects copied with the process -- a run lock, a SQLite connection, a socket
  -- still hold those numbers, and a closed number would be reused by a rank's own socket and written to by a
  stale object; pointing them at ``/dev/null`` releases the files, locks and sockets behind them);
- signal handlers set from Python are reset (SIGINT to Python's default, the rest to ``SIG_DFL``), the signal
  mask cleared and the wakeup fd unset; ``atexit`` handlers dropped and the child always ends in ``os._exit``
  (never the parent's ``finally`` blocks, exit handlers or buffered output: this process flushes its stdio
  before the fork); the root logger is reset (the ranks configure it, :func:`starverse.runtime.launch.rank_environ`)
  and handlers writing anywhere but stdout/stderr dropped; ``sys.stdout``/``sys.stderr`` are the process's own;
- what the process holds is frozen (``gc.freeze``) with the collector on, like the exec'd server's preload
  (:mod:`starverse.providers.forkserver_ready`): a rank never walks the copied objects.

The server exits when this process does (the alive pipe), as the exec'd one does. Its state is this process's
at the fork: :func:`starverse.providers.local.rank_server` stops a zygote at the end of the job it was forked for,
so a process running several jobs (tests, a notebook) never hands one job's state to the next job's ranks.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import importlib
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from multiprocessing import connection, forkserver, process, resource_tracker, util
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SERVER_PROCESS_NAME = "sv-forkserver"
"""The zygote server's name (``/proc/PID/comm``); the exec'd server is a plain ``python``."""

_PR_SET_NAME = 15  # linux/prctl.h


def _client() -> Any:
    """This process's fork server client (what ``Process.start`` of the forkserver context connects through)."""
    return forkserver._forkserver  # type: ignore[attr-defined]


def _maps() -> list[str]:
    """The paths of the files mapped into this process (Linux ``/proc/self/maps``)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    return sorted({parts[5] for line in lines if len(parts := line.split(maxsplit=5)) == 6})


def _stop_blas_threads() -> int:
    """Shut down the worker threads of every OpenBLAS loaded here (numpy's, scipy's): what OpenBLAS's own
    ``pthread_atfork`` handler does at every fork; the pool restarts at the next BLAS call. Returns how many
    libraries it asked."""
    asked = 0
    for path in _maps():
        if "openblas" not in Path(path).name.lower():
            continue
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)  # loaded already: never loads anything
        except OSError:
            continue
        shutdown = getattr(lib, "blas_thread_shutdown_", None)
        if shutdown is not None:
            shutdown()
            asked += 1
    return asked


def _native_threads() -> int:
    """Threads of this process as the kernel counts them (native ones included); 0 when unknown."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def fork_refusal() -> str | None:
    """Why this process must not fork a server now, None when it may (see the module docstring)."""
    if not sys.platform.startswith("linux"):
        return "not Linux"
    if threading.current_thread() is not threading.main_thread() or threading.active_count() != 1:
        return f"{threading.active_count()} Python threads run"
    if any(Path(p).name.startswith("libcuda.so") for p in _maps()):
        return "the CUDA driver is loaded (a forked child could not use CUDA)"
    _stop_blas_threads()
    threads = _native_threads()
    if threads != 1:
        return f"{threads} threads run (native ones: a thread pool or a library's own thread)"
    return None


def _import(modules: Sequence[str]) -> None:
    """Import ``modules`` here, the collector off meanwhile (torch and transformers make hundreds of thousands of
    objects: walking them again and again cost ~1.5 s of CPU of ~10); a missing one is skipped, as the fork
    server's preload skips it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        for name in modules:
            try:
                importlib.import_module(name)
            except ImportError:
                log.debug("fork server preload: %s not importable", name)
    finally:
        if enabled:
            gc.enable()


def running() -> bool:
    """Whether this process's fork server client points at a live server (reaping a dead one's state)."""
    server = _client()
    pid = server._forkserver_pid
    if pid is None:
        return False
    if os.waitpid(pid, os.WNOHANG)[0] == 0:
        return True
    os.close(server._forkserver_alive_fd)
    server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None
    return False


def fork_server(modules: Sequence[str]) -> int | None:
    """Import ``modules`` and fork this process's fork server from it; the server's pid, or None when no server
    was forked -- one runs already, or :func:`fork_refusal` refused (logged at debug) -- and the caller starts the
    exec'd one (``multiprocessing.forkserver.ensure_running``)."""
    server = _client()
    with server._lock:
        if running():
            log.debug("fork server: one runs already (pid %d)", server._forkserver_pid)
            return None
        _import(modules)
        resource_tracker.ensure_running()  # what ensure_running does first; its process is exec'd, no thread here
        why = fork_refusal()
        if why is not None:
            log.debug("fork server: not forked from this process (%s); starting a fresh interpreter", why)
            return None
        address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(address)
            if not util.is_abstract_socket_namespace(address):  # type: ignore[attr-defined]
                os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()
            try:
                util._flush_std_streams()  # type: ignore[attr-defined]  # or the child's copies print them again
                pid = os.fork()
                if pid == 0:
                    _serve(listener.detach(), alive_r, alive_w)  # never returns
            except BaseException:
                os.close(alive_w)
                raise
            finally:
                os.close(alive_r)
        server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
    log.debug("fork server: forked from this process (pid %d)", pid)
    return pid


def stop(pid: int, grace_s: float = 5.0) -> None:
    """Stop the server ``pid`` if it is still this process's, as ``ForkServer._stop`` does (its alive pipe closed,
    its exit waited for, its socket removed), but SIGKILLed after ``grace_s``: a process this one forked meanwhile
    (a ``fork`` pool) holds a copy of the pipe and would keep it serving."""
    server = _client()
    with server._lock:
        if server._forkserver_pid != pid:
            return
        os.close(server._forkserver_alive_fd)
        deadline = time.monotonic() + grace_s
        while os.waitpid(pid, os.WNOHANG)[0] == 0:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.01)
        if not util.is_abstract_socket_namespace(server._forkserver_address):  # type: ignore[attr-defined]
            with contextlib.suppress(OSError):
                os.unlink(server._forkserver_address)
        server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None


def _serve(listener_fd: int, alive_r: int, alive_w: int) -> None:
    """The forked child: become a clean fork server and serve until the launcher is gone; always ``os._exit``."""
    code = 1
    try:
        os.close(alive_w)
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None).prctl(_PR_SET_NAME, SERVER_PROCESS_NAME.encode(), 0, 0, 0)
        _reset_signals()
        _neutralise_fds(keep={0, 1, 2, listener_fd, alive_r})
        _reset_state()
        gc.freeze()
        gc.enable()
        forkserver.main(listener_fd, alive_r, [])  # type: ignore[attr-defined]
    except SystemExit:  # the alive pipe's end: the launcher is gone
        code = 0
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _reset_signals() -> None:
    """Signals as a fresh interpreter has them: handlers set from Python back to the default (SIGINT: Python's
    ``KeyboardInterrupt``), ignored ones left ignored (an exec keeps those too), nothing blocked, no wakeup fd."""
    signal.set_wakeup_fd(-1)
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)


def _neutralise_fds(keep: set[int]) -> None:
    """Point every open descriptor but ``keep`` at ``/dev/null`` (see the module docstring: why not ``close``)."""
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    for fd in sorted(int(name) for name in os.listdir("/proc/self/fd")):
        if fd in keep or fd == null:
            continue
        try:
            os.fstat(fd)  # the listing's own descriptor is closed by now: never create one there
        except OSError:
            continue
        os.dup2(null, fd, inheritable=False)
    os.close(null)


def _writes_to_stdio(handler: logging.Handler) -> bool:
    stream = getattr(handler, "stream", None)
    try:
        return stream is not None and stream.fileno() in (1, 2)
    except (OSError, ValueError, AttributeError):
        return False


def _reset_state() -> None:
    """Python-level state of the launcher the server and its ranks must not keep (see the module docstring)."""
    atexit._clear()
    server = _client()
    server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None
    server._lock = threading.Lock()  # held by the parent at the fork
    process._children = set()  # type: ignore[attr-defined]
    if sys.__stdout__ is not None:
        sys.stdout = sys.__stdout__
    if sys.__stderr__ is not None:
        sys.stderr = sys.__stderr__
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.setLevel(logging.WARNING)
    for logger in list(logging.Logger.manager.loggerDict.values()):
        if isinstance(logger, logging.Logger):
            for h in [h for h in logger.handlers if not _writes_to_stdio(h)]:
                logger.removeHandler(h)
