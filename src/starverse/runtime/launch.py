"""What every launcher shares: the rank description, the rank's set-up, and the :class:`Launcher` protocol.

A launcher runs ``fn(rank_env, *args)`` once per rank, each rank in its own process joined into
``torch.distributed``, and fails fast together: when one rank dies or raises, the others are stopped and a
typed :class:`~starverse.errors.RankFailedError` names it (:class:`~starverse.errors.LostRankError` for a lost
process or device, :class:`~starverse.errors.RankCodeError` for an exception in the rank's code), or
:class:`~starverse.errors.JobTimeoutError` for a job past its time. Every collective has a timeout
(``collective_timeout_s``), so a rank blocked on a dead peer cannot hang.

The launchers themselves are providers (``starverse.providers.local.LocalLauncher``: spawned processes on
this machine; ``starverse.providers.ray.RayLauncher``: Ray actors). The runtime never imports them: a name
(``"local"``, ``"ray"``) is resolved through :data:`LAUNCHERS`, a table of ``module:class`` plugins.
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

from starverse.errors import ConfigError, DistributedError, StarverseError

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
_LOOPBACK_IFNAME = "lo" if sys.platform.startswith("linux") else "lo0"


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


def world_backend(ranks: Sequence[RankSpec]) -> str:
    """The default group's backend: NCCL (plus gloo for CPU tensors) when every rank is CUDA, else gloo.

    A mixed job's default group is gloo over host memory; native groups per device kind are created by
    :func:`starverse.runtime.mesh.MixedMesh.build`.
    """
    backends = {r.backend for r in ranks}
    if backends == {"nccl"}:
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def rank_environ(env: RankEnv, master_addr: str, port: int) -> None:
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
            # gloo listens on the address its interface resolves to: the loopback one for a one-machine job
            **({"GLOO_SOCKET_IFNAME": _LOOPBACK_IFNAME} if master_addr.startswith("127.") else {}),
            **dict(spec.env),
        }
    )
    logging.basicConfig(level=os.environ.get("STARVERSE_LOG_LEVEL", "WARNING"))


def set_rank_device(env: RankEnv) -> None:
    """In a rank's process: its intra-op threads (the cores divided by the local CPU ranks) and its CUDA device."""
    import torch

    spec = env.spec
    num_cpu = sum(1 for r in env.ranks if r.device == "cpu") or 1
    threads = spec.num_threads or max(1, (os.cpu_count() or 1) // num_cpu)
    torch.set_num_threads(threads)
    if spec.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(spec.device))


def join_world(env: RankEnv, master_addr: str, port: int) -> None:
    """In a rank's process: set its threads and device, join the store at ``master_addr:port``, init the group."""
    import torch.distributed as dist

    spec = env.spec
    set_rank_device(env)
    timeout = timedelta(seconds=env.collective_timeout_s)
    store = dist.TCPStore(master_addr, port, env.world_size, is_master=False, timeout=timeout)
    dist.init_process_group(
        world_backend(env.ranks), store=store, rank=spec.rank, world_size=env.world_size, timeout=timeout
    )


def store_server(host: str, world_size: int, timeout_s: float) -> Any:
    """A job's rendezvous ``TCPStore`` server listening on ``host`` only (127.0.0.1 for one machine; a node's
    address under multi-node Ray), on a port the OS picks. The store's own server would listen on every
    interface, so the socket is made here and handed over (``master_listen_fd``)."""
    import torch.distributed as dist

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        sock.listen(128)
        port = sock.getsockname()[1]
        return dist.TCPStore(host, port, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                             wait_for_workers=False, master_listen_fd=sock.detach())
    finally:
        sock.close()


def error_report(e: BaseException) -> tuple[str, str, BaseException | None]:
    """What a rank reports for an exception it is handling: one line, the traceback, the user error or None."""
    text = "".join(traceback.format_exception_only(type(e), e)).strip()
    return text, traceback.format_exc(), e if isinstance(e, StarverseError) else None


def ordered_ranks(ranks: Sequence[RankSpec]) -> list[RankSpec]:
    """``ranks`` sorted by rank; DistributedError if empty or not exactly 0..n-1."""
    ranks = sorted(ranks, key=lambda r: r.rank)
    if not ranks:
        raise DistributedError("no ranks to launch; the provider found no devices. To fix: check `starverse probe`.")
    if [r.rank for r in ranks] != list(range(len(ranks))):
        raise DistributedError(f"ranks must be 0..{len(ranks) - 1}, got {[r.rank for r in ranks]}")
    return ranks



RankError = tuple[str, str | None, BaseException | None]
"""What a rank reports for an exception: (one-line error, traceback or None, the user error to re-raise or None)."""


class Launcher(Protocol):
    """Something that runs ``fn`` once per rank with :func:`launch`'s contract (``LocalLauncher``, ``RayLauncher``)."""

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

    def notify(self, signum: int) -> int:
        """Forward ``signum`` to every rank this launcher is running now (a job-wide preemption notice);
        returns how many ranks it reached."""
        ...


@runtime_checkable
class RecoveringLauncher(Protocol):
    """A launcher whose recovery runs only some plans (in-place recovery: ``InplaceLauncher``, ``RayInplaceLauncher``).

    A plan it does not run (``Trainer.fit`` logs why) runs as one job with checkpoint-restart on the launcher that
    :meth:`restart_launcher` names, which must also receive this launcher's ``notify`` (a preemption notice)."""

    def launch(self, fn: Callable[..., Any], ranks: Sequence[RankSpec], *, timeout_s: float,
               args: tuple[Any, ...] = (), collective_timeout_s: float = 120.0, grace_s: float = 3.0) -> list[Any]:
        """See :class:`Launcher`."""
        ...

    def restart_launcher(self) -> Launcher:
        """The plain launcher (one ``torch.distributed`` world over all ranks) for a plan it does not recover."""
        ...


LAUNCHERS: dict[str, str] = {
    "local": "starverse.providers.local:LocalLauncher",
    "ray": "starverse.providers.ray:RayLauncher",
}
"""Launchers known by name (``Trainer(launcher=...)``, ``launch(launcher=...)``): ``module:class`` of a class
whose no-argument instance is the launcher with every default."""


def resolve_launcher(launcher: str | Launcher) -> Launcher:
    """The launcher object for a name or object.

    Raises ConfigError for an unknown name, and (from the Ray provider) when ``"ray"`` is asked for
    without Ray installed, so a wrong choice fails before any data is prepared.
    """
    if isinstance(launcher, str):
        target = LAUNCHERS.get(launcher)
        if target is None:
            from starverse.config import did_you_mean

            raise ConfigError(
                f"unknown launcher {launcher!r}: expected one of {', '.join(map(repr, LAUNCHERS))} or an object "
                f"with a launch() method.{did_you_mean(launcher, list(LAUNCHERS))}"
            )
        module, _, name = target.partition(":")
        made: Launcher = getattr(importlib.import_module(module), name)()
        return made
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
    """Run ``fn(rank_env, *args)`` once per rank, each in its own process; return the results in rank order.

    ``fn`` and ``args`` must be picklable (a module-level function). Each process has the default
    process group initialised (gloo, or NCCL+gloo when all ranks are CUDA) with ``collective_timeout_s``.

    Raises :class:`~starverse.errors.LostRankError` when a rank's process dies without reporting (killed,
    exited, silent, its actor or node gone), :class:`~starverse.errors.RankCodeError` when a rank raises (the
    other ranks are stopped either way), :class:`~starverse.errors.JobTimeoutError` past ``timeout_s``. A
    :class:`StarverseError` raised inside a rank (bad input found there) is re-raised as itself.

    ``launcher``: ``"local"`` (spawned processes on this machine), ``"ray"`` (one Ray actor per rank) or any
    :class:`Launcher`; all keep the contract above.
    """
    return resolve_launcher(launcher).launch(
        fn, ranks, timeout_s=timeout_s, args=args, collective_timeout_s=collective_timeout_s, grace_s=grace_s
    )
