"""The Ray session a job's actors run in: the caller's, a cluster joined as a driver, or a private single-node
session on 127.0.0.1 (see :mod:`starverse.providers.ray`); and how Ray's errors are read.

``ray`` is an optional dependency; this module imports it lazily (:func:`import_ray`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import signal
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from starverse.errors import ConfigError, DistributedError
from starverse.providers.reaper import start_reaper, stop_reaper
from starverse.runtime.launch import LOOPBACK, RankSpec

log = logging.getLogger(__name__)

# Ray maps a node IP of 127.0.0.1 to the machine's outward address and binds its servers on every
# interface unless it believes clustering is off; this switch (Ray's own) keeps a private session on the
# loopback interface. It is only set for a session this module starts, never for a cluster it joins.
_RAY_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def import_ray() -> Any:
    """Import Ray, or raise a ConfigError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "launcher='ray' needs Ray, which is not installed. To fix: pip install 'starverse[ray]' "
            "(or launcher='local' to run the ranks on this machine without Ray)."
        ) from None
    return ray


@contextlib.contextmanager
def loopback_only(ray: Any) -> Iterator[None]:
    """While a private session runs, make Ray keep it on 127.0.0.1; restore the caller's setting after.

    Ray reads the switch at import (driver) and from the environment (its daemons and workers, which
    inherit ours), so both are set.
    """
    constants = getattr(getattr(ray, "_private", None), "ray_constants", None)
    old_env = os.environ.get(_RAY_LOOPBACK_ENV)
    old_const = getattr(constants, "ENABLE_RAY_CLUSTER", None)
    os.environ[_RAY_LOOPBACK_ENV] = "0"
    if old_const is not None:
        constants.ENABLE_RAY_CLUSTER = False  # type: ignore[union-attr]
    try:
        yield
    finally:
        if old_env is None:
            os.environ.pop(_RAY_LOOPBACK_ENV, None)
        else:
            os.environ[_RAY_LOOPBACK_ENV] = old_env
        if old_const is not None:
            constants.ENABLE_RAY_CLUSTER = old_const  # type: ignore[union-attr]


class SessionOptions(Protocol):
    """What a session needs of its launcher (:class:`~starverse.providers.ray.RayLauncher`'s fields)."""

    address: str | None
    num_cpus_per_rank: float
    local_num_cpus: int | None
    object_store_memory_mb: int
    runtime_env: dict[str, Any] | None


@contextlib.contextmanager
def ray_session(ray: Any, opts: SessionOptions, ranks: Sequence[RankSpec]) -> Iterator[None]:
    """A Ray session for one job: the caller's if it already initialised one (left running), else the cluster at
    ``opts.address`` / ``$RAY_ADDRESS`` (this driver disconnects after), else a private one on 127.0.0.1 (shut
    down after)."""
    if ray.is_initialized():  # the caller's session: use it, leave it running
        yield
        return
    address = opts.address or os.environ.get("RAY_ADDRESS") or None
    if address is not None:
        # A cluster on this machine's loopback (a local `ray start --head --node-ip-address=127.0.0.1`)
        # must be joined as one: Ray would otherwise rewrite 127.0.0.1 to the outward address.
        loopback = is_loopback(address)
        with loopback_only(ray) if loopback else contextlib.nullcontext():
            join_cluster(ray, opts, address)
            try:
                yield
            finally:
                ray.shutdown()  # disconnects this driver; the cluster keeps running
        return
    with loopback_only(ray):
        # the session's daemons must not outlive this process, even when it is SIGKILLed
        reaper = start_reaper()
        try:
            _start_private(ray, opts, ranks)
            try:
                yield
            finally:
                ray.shutdown()  # stops the private session's daemons and workers
        finally:
            stop_reaper(reaper)


def is_loopback(address: str) -> bool:
    """True for ``127.x.x.x:port``, ``localhost:port`` (optionally ``ray://``)."""
    host = address.split("://", 1)[-1].rsplit(":", 1)[0]
    return host == "localhost" or host.startswith("127.")


@contextlib.contextmanager
def _keep_sigterm_handler() -> Iterator[None]:
    """Keep this process's SIGTERM handler across ``ray.init``: Ray's core worker installs its own (it dumps a
    stack and aborts), which would turn the supervisor's SIGTERM -> emergency checkpoint -> exit 3 into a crash."""
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if in_main else None
    try:
        yield
    finally:
        if in_main and previous is not None:
            signal.signal(signal.SIGTERM, previous)


def join_cluster(ray: Any, opts: SessionOptions, address: str) -> None:
    """Connect this process to the Ray cluster at ``address`` as a driver."""
    log.info("joining the Ray cluster at %s", address)
    try:
        with _keep_sigterm_handler():
            ray.init(address=address, logging_level=logging.WARNING, runtime_env=opts.runtime_env)
    except Exception as e:
        raise DistributedError(
            f"cannot join the Ray cluster at {address}: {_root_cause(e)}. To fix: start it with `ray start --head` "
            "and pass its address (RAY_ADDRESS or RayLauncher(address=...)); if the cluster uses token "
            "authentication (Ray's default once a token exists), set RAY_AUTH_MODE=token with its token in "
            "~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN; or unset RAY_ADDRESS to run on this machine "
            "only."
        ) from e


def _start_private(ray: Any, opts: SessionOptions, ranks: Sequence[RankSpec]) -> None:
    """Start a single-node session on 127.0.0.1 big enough for ``ranks``."""
    want_cpus = math.ceil(opts.num_cpus_per_rank * len(ranks))
    num_cpus = opts.local_num_cpus or max(os.cpu_count() or 1, want_cpus)
    num_gpus = sum(1 for r in ranks if r.device.startswith("cuda"))
    log.info("starting a private Ray session on %s (%d CPUs, %d GPUs)", LOOPBACK, num_cpus, num_gpus)
    with _keep_sigterm_handler():
        _init_private(ray, opts, num_cpus, num_gpus)


def _init_private(ray: Any, opts: SessionOptions, num_cpus: int, num_gpus: int) -> None:
    ray.init(
        # "local": start a new session even where Ray would auto-join one (a `ray start` on this machine,
        # or a stale record of one in /tmp/ray); joining is only ever asked for with an address.
        address="local",
        _node_ip_address=LOOPBACK,
        include_dashboard=False,
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        object_store_memory=opts.object_store_memory_mb * 1024 * 1024,
        logging_level=logging.WARNING,
        runtime_env=opts.runtime_env,
    )


def first_line(e: BaseException) -> str:
    """The first non-empty line of an error (Ray's messages run to many lines of advice)."""
    for line in str(e).splitlines():
        if line.strip():
            return line.strip()[:300]
    return type(e).__name__


def _root_cause(e: BaseException) -> str:
    """The most specific error line of a chain: Ray wraps the useful one (say an ``AuthenticationError``) in
    generic ones, sometimes only as text inside their message."""
    chain = [e]
    while (inner := chain[-1].__cause__ or chain[-1].__context__) is not None and inner not in chain:
        chain.append(inner)
    for err in reversed(chain):
        named = [m.group(0) for m in ERROR_LINE.finditer(str(err))]
        if named:
            return named[-1].strip()[:300]
    return f"{type(chain[-1]).__name__}: {first_line(chain[-1])}"


ERROR_LINE = re.compile(r"^\s*[\w.]+(?:Error|Exception): .+$", re.MULTILINE)
"""A line of an error's text that names an exception (``ValueError: ...``)."""
