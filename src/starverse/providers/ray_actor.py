"""What runs inside a rank's Ray actor (:mod:`starverse.providers.ray`): the actor class, the rank's set-up
and the spec it sees there.

Importing this module imports neither Ray nor torch (``starverse.providers`` stays light): the actor's methods
import them in the actor's process.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Any

from starverse.providers.heartbeat import Beat, start_beating
from starverse.runtime.launch import (
    LOOPBACK,
    RankEnv,
    RankSpec,
    error_report,
    join_world,
    rank_environ,
    set_rank_device,
    store_server,
)


class _RankActor:
    """One rank's process. Methods run one at a time, in call order."""

    def __init__(self, sys_path: list[str]) -> None:
        # Like multiprocessing's spawn: let the rank import what the caller's process could (a test module
        # or script directory holding the model class), before any argument is unpickled.
        for p in reversed(sys_path):
            if p not in sys.path and os.path.isdir(p):
                sys.path.insert(0, p)
        self._store: Any = None

    def node_ip(self) -> str:
        """The IP of the node this actor runs on (how the other ranks reach it)."""
        import ray

        return str(ray.util.get_node_ip_address())

    def open_store(self, host: str, world: int, timeout_s: float) -> int:
        """Rank 0 only: own the rendezvous store for the job, listening on ``host`` only; returns its port."""
        self._store = store_server(host, world, timeout_s)
        return int(self._store.port)

    def where(self) -> tuple[str, int]:
        """(Ray node id, process id) of this rank."""
        import ray

        return str(ray.get_runtime_context().get_node_id()), os.getpid()

    def run(
        self, fn: Callable[..., Any], env: RankEnv, args: tuple[Any, ...], master_addr: str, port: int,
        beat: Beat | None = None,
    ) -> tuple[str, Any]:
        """Start the heartbeat (``beat``), set up the environment and process group, run ``fn``; report
        ``("ok", value)`` or ``("error", ...)``.

        Exceptions are caught and reported as data (text, traceback, the error itself if a StarverseError),
        the same triple the local launcher sends, so the driver applies the same rules to both.
        """
        try:
            if beat is not None:
                start_beating(beat, env.collective_timeout_s)
            return ("ok", _run_rank(fn, env, args, master_addr, port))
        except BaseException as e:
            return ("error", error_report(e))

    def run_replica(self, fn: Callable[..., Any], env: RankEnv, args: tuple[Any, ...],
                    bind_node: bool = False, beat: Beat | None = None) -> tuple[str, Any]:
        """Run ``fn`` without a ``torch.distributed`` world (an in-place replica forms its own torchft groups);
        report as :meth:`run`. ``bind_node``: the replica binds and advertises this node's IP (``bind_host``, replicas
        on several hosts), not 127.0.0.1. ``beat``: its heartbeat, as :meth:`run`."""
        try:
            if beat is not None:
                start_beating(beat, env.collective_timeout_s)
            host = LOOPBACK
            if bind_node:
                from starverse.runtime.ft_group import EXTRA_BIND_HOST

                host = self.node_ip()
                env = dataclasses.replace(env, extra={**env.extra, EXTRA_BIND_HOST: host})
            rank_environ(env, host, 0)
            set_rank_device(env)
            return ("ok", fn(env, *args))
        except BaseException as e:
            return ("error", error_report(e))


def _run_rank(fn: Callable[..., Any], env: RankEnv, args: tuple[Any, ...], master_addr: str, port: int) -> Any:
    """Body of a rank inside its actor: the same set-up as the local launcher's ``_rank_entry``."""
    import torch.distributed as dist

    rank_environ(env, master_addr, port)
    join_world(env, master_addr, port)
    try:
        return fn(env, *args)
    finally:
        dist.destroy_process_group()


def rank_actor_class(ray: Any) -> Any:
    """The Ray actor class of a rank: never restarted by Ray (a lost rank is the launcher's to handle)."""
    return ray.remote(max_restarts=0, max_concurrency=1)(_RankActor)


def actor_spec(spec: RankSpec) -> RankSpec:
    """The spec as seen inside the actor: Ray shows a CUDA rank only its own GPU, as ``cuda:0``."""
    if spec.device.startswith("cuda"):
        return dataclasses.replace(spec, device="cuda:0")
    return spec
