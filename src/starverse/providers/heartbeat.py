"""Heartbeats of Ray actors: a rank that lives but stopped stepping (SIGSTOPped, its host hung) is found and lost.

Ray reports an actor that *died*; an actor whose process is stopped or stuck keeps its sockets and its Ray
connection, so only a heartbeat shows it. Each rank's actor runs a thread (:func:`start_beating`) that adds 1
to its own key of a ``TCPStore`` in the driver every ``period_s``; the driver (:class:`BeatWatch`) reads the
counters and declares a key silent when its count has not changed for ``timeout_s`` of the driver's own clock
(a counter, not a timestamp: the nodes' clocks never meet, and a driver that was itself held up for a while
sees moved counters, not stale times). A thread in a stopped process stops too, which is what is wanted; an
actor before its first beat (still starting, waiting for a node) is not watched, as the local launcher's
heartbeat does not count before the first stamp.

The store is the driver's: the in-place launcher's own store (start barrier, spare activation), or one the
restart launcher opens for the job, on 127.0.0.1 or the driver's node IP (:func:`driver_host`).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

log = logging.getLogger(__name__)

BEAT_KEY = "beat/"
"""Store key prefix of a heartbeat counter: ``beat/<n>``, one per actor started."""


@dataclass(frozen=True)
class Beat:
    """Where one actor stamps its heartbeat (picklable: sent with the actor's call)."""

    host: str
    """The driver's store address."""
    port: int
    """Its port."""
    key: str
    """This actor's counter (``beat/<n>``)."""
    period_s: float
    """How often it adds 1."""


def start_beating(beat: Beat, timeout_s: float = 60.0) -> threading.Thread:
    """In an actor: beat once now (so the actor is watched from here on, even if it stops at once), then a daemon
    thread adds 1 to ``beat.key`` every ``beat.period_s`` (it stops with the process, and ends quietly if the
    driver's store goes away: the job is over then)."""
    import torch.distributed as dist

    store = dist.TCPStore(beat.host, beat.port, is_master=False, timeout=timedelta(seconds=timeout_s))
    store.add(beat.key, 1)

    def run() -> None:
        try:
            while True:
                time.sleep(beat.period_s)
                store.add(beat.key, 1)
        except Exception as e:  # the driver ended the job (its store is gone)
            log.debug("heartbeat %s ended: %s", beat.key, e)

    t = threading.Thread(target=run, name="heartbeat", daemon=True)
    t.start()
    return t


@dataclass
class BeatWatch:
    """The driver's side: which actors' counters stood still for ``timeout_s``."""

    store: Any
    """A client of the store the actors beat into (the driver's server object itself)."""
    host: str
    """Where the actors reach it."""
    period_s: float
    """The actors' beat period."""
    timeout_s: float
    """Silent this long: lost."""
    next_key: int = 0
    _seen: dict[str, tuple[int, float]] = field(default_factory=dict)
    """Key -> (last count, driver time it last changed)."""

    def new_beat(self) -> Beat:
        """A key for an actor about to start."""
        key, self.next_key = f"{BEAT_KEY}{self.next_key}", self.next_key + 1
        return Beat(self.host, int(self.store.port), key, self.period_s)

    def silent_s(self, key: str, now: float) -> float | None:
        """How long ``key``'s count has stood still when that is longer than ``timeout_s``; None while it beats (or
        before its first beat)."""
        count = int(self.store.add(key, 0))
        last = self._seen.get(key)
        if count == 0:
            return None
        if last is None or last[0] != count:
            self._seen[key] = (count, now)
            return None
        quiet = now - last[1]
        return quiet if quiet > self.timeout_s else None

    def forget(self, key: str) -> None:
        """Stop watching ``key`` (its actor is gone)."""
        self._seen.pop(key, None)


def driver_host(bind: str, node_ips: list[str], driver_ip: str) -> str | None:
    """Where the driver's servers (Lighthouse, stores) listen: 127.0.0.1 (``loopback``, or ``auto`` on a cluster
    whose live nodes are all on 127.x), else the driver's node IP (``node``, or ``auto`` with a node elsewhere);
    None for the loopback, where the replicas bind 127.0.0.1 too (else each binds its node's IP)."""
    if bind == "loopback" or (bind == "auto" and all(ip.startswith("127.") for ip in node_ips)):
        return None
    return driver_ip
