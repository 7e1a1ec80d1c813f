"""How a replica process joins an in-place job: the start barrier of the initial replicas, a warm spare's wait
for its activation, and a replacement's "joined" signal to the launcher (over the launcher's store: 127.0.0.1, or
the driver's address a multi-host launcher names, ``ft_host``).

The live state itself is transferred by torchft when the joiner's first quorum heals it
(:meth:`starverse.runtime.ft.ReplicaTrainer.load_live_state`).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import torch

from starverse.runtime.ft_group import (
    EXTRA_BARRIER_PORT,
    EXTRA_JOINER,
    EXTRA_SPARE,
    JOINED_KEY,
    SPARE_KEY,
    ft_host,
    quiet_torchft,
)
from starverse.runtime.launch import RankEnv
from starverse.runtime.rank_loop import FitJob


def start_barrier(env: RankEnv) -> None:
    """Initial replicas wait for each other before the first quorum (so it holds all of them); a joiner does not."""
    port = env.extra.get(EXTRA_BARRIER_PORT)
    if port is None or env.extra.get(EXTRA_JOINER):
        return
    import torch.distributed as dist

    store = dist.TCPStore(ft_host(env.extra), int(port), is_master=False,
                          timeout=timedelta(seconds=env.collective_timeout_s))
    store.add("ready", 1)
    deadline = time.monotonic() + env.collective_timeout_s
    while store.add("ready", 0) < env.world_size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"replica {env.rank}: the other replicas did not start within "
                               f"{env.collective_timeout_s:.0f} s")
        time.sleep(0.02)


def _launcher_store(env: RankEnv) -> Any:
    import torch.distributed as dist

    return dist.TCPStore(ft_host(env.extra), int(env.extra[EXTRA_BARRIER_PORT]), is_master=False,
                         timeout=timedelta(seconds=env.collective_timeout_s))


def announce_joined(env: RankEnv) -> None:
    """A replacement tells the launcher it trained its first step (``joined/<rank>``)."""
    if env.extra.get(EXTRA_BARRIER_PORT) is not None:
        _launcher_store(env).set(f"{JOINED_KEY}{env.rank}", "1")


def load_model(job: FitJob) -> torch.nn.Module:
    """The job's initial model, on the CPU."""
    model: torch.nn.Module = torch.load(job.model_path, map_location="cpu", weights_only=False)
    return model


def wait_for_activation(env: RankEnv, job: FitJob, poll_s: float = 0.005) -> tuple[RankEnv, torch.nn.Module]:
    """A warm spare: do what a replacement's start costs (imports, the model loaded) now, then wait outside the
    quorum until the launcher sets ``activate/<slot>`` on its store; returns the env of the rank it replaces.

    torchft's own spares (``WorldSizeMode.FIXED_WITH_SPARES``) are *hot*: in every quorum, healed every step,
    contributing zero gradients, so their device is in use (and billed) the whole run. This one is *warm*: it
    holds no Manager and no device work until activated, then joins like any replacement (healed at a step
    boundary from a peer), so its lease starts at activation."""
    quiet_torchft()
    from torchft import Manager, ProcessGroupGloo  # noqa: F401  (imported now: part of the start-up paid early)
    from torchft.checkpointing.pg_transport import PGTransport  # noqa: F401

    model = load_model(job)
    store = _launcher_store(env)
    key = f"{SPARE_KEY}{env.rank}"
    while not store.check([key]):
        time.sleep(poll_s)
    rank = int(store.get(key))
    active = RankEnv(spec=env.ranks[rank], ranks=env.ranks, collective_timeout_s=env.collective_timeout_s,
                     extra={**env.extra, EXTRA_SPARE: False, EXTRA_JOINER: True})
    os.environ.update({"RANK": str(rank), "STARVERSE_DEVICE_KIND": active.spec.device_kind, **dict(active.spec.env)})
    if active.spec.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(active.spec.device))
    return active, model
