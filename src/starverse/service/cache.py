"""Short-lived caches that keep hot reads off the database and repeated plans off the planner.

- :class:`TTLCache`: answers remembered for a few seconds, dropped at once when this process changes what
  they describe (the routes that change a job call :meth:`TTLCache.drop`). What another process changes
  (the worker updating a running job) is seen within the TTL.
- :class:`Memo`: a :class:`TTLCache` of answers that are computed once however many requests ask for them
  at the same time (the others wait for the first): job statuses (a short TTL) and planner searches. A
  search is a deterministic function of the job, the pool, ``top`` and the catalog, so its key
  (:func:`plan_key`) is a hash of their canonical form (mappings with sorted keys, YAML parsed) and
  :func:`~starverse.catalog.loader.catalog_version`.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, Generic, TypeVar

import yaml

V = TypeVar("V")


class TTLCache(Generic[V]):
    """A bounded map whose entries live ``ttl_s`` seconds (0: nothing is kept); safe across threads."""

    def __init__(self, ttl_s: float, max_entries: int = 10_000):
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._items: OrderedDict[Hashable, tuple[float, V]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> V | None:
        """The live value of ``key``, or None."""
        hit = self.get_aged(key)
        return None if hit is None else hit[0]

    def get_aged(self, key: Hashable) -> tuple[V, float] | None:
        """The live value of ``key`` and its age in seconds, or None."""
        with self._lock:
            hit = self._items.get(key)
            if hit is None:
                return None
            age = time.monotonic() - hit[0]
            if age >= self.ttl_s:
                del self._items[key]
                return None
            return hit[1], age

    def put(self, key: Hashable, value: V) -> None:
        """Remember ``value`` for the TTL (the oldest entry goes when full)."""
        if self.ttl_s <= 0:
            return
        with self._lock:
            self._items[key] = (time.monotonic(), value)
            self._items.move_to_end(key)
            while len(self._items) > self.max_entries:
                self._items.popitem(last=False)

    def drop(self, match: Callable[[Hashable], bool]) -> None:
        """Forget every entry whose key ``match``es (this process changed what it describes)."""
        with self._lock:
            for key in [k for k in self._items if match(k)]:
                del self._items[key]


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Done-callback of a background refresh: take its exception (the next request computes again)."""
    if not task.cancelled():
        task.exception()


def _canonical(obj: dict[str, Any] | None, text: str | None) -> Any:
    if text is not None:
        try:
            return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        except yaml.YAMLError:
            return {"unparsed": text}  # the search reports it; the key only has to be deterministic
    return obj


def plan_key(body: dict[str, Any], catalog_version: str) -> tuple[str, str]:
    """The cache key of a ``/api/plan`` body (a :class:`~starverse.service.api_plan.PlanRequest` dump)."""
    return _canonical_hash(json.dumps(body, sort_keys=True, default=str)), catalog_version


@functools.lru_cache(maxsize=1024)
def _canonical_hash(raw: str) -> str:
    """Hash of the canonical job, pool and ``top`` of a request (memoised by its raw form: YAML is parsed
    once per distinct text)."""
    body = json.loads(raw)
    doc = {"job": _canonical(body.get("job"), body.get("job_yaml")),
           "pool": _canonical(body.get("pool"), body.get("pool_yaml")), "top": body.get("top")}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


class Memo(Generic[V]):
    """Answers by key for ``ttl_s`` (``math.inf``: until pushed out by newer ones), computed once however
    many requests ask at the same time: the first starts the computation, the others wait for it. Used from
    the server's event loop only (the store itself is thread-safe)."""

    def __init__(self, ttl_s: float, max_entries: int, refresh_after_s: float | None = None):
        self.store: TTLCache[V] = TTLCache(ttl_s if max_entries > 0 else 0, max(1, max_entries))
        self.refresh_after_s = refresh_after_s
        self._running: dict[Hashable, asyncio.Future[V]] = {}
        self.hits = self.misses = 0

    async def get(self, key: Hashable, compute: Callable[[], Awaitable[V]]) -> V:
        """The answer under ``key``: remembered, awaited from the same computation in flight, or computed (an
        exception reaches every waiter and nothing is remembered). An answer older than ``refresh_after_s``
        is still returned while one computation replaces it in the background, so under steady traffic no
        request waits for a recomputation; none is ever older than the TTL."""
        hit = self.store.get_aged(key)
        if hit is not None:
            self.hits += 1
            value, age = hit
            if self.refresh_after_s is not None and age >= self.refresh_after_s and key not in self._running:
                self._start(key, compute).add_done_callback(_retrieve)
            return value
        running = self._running.get(key)
        if running is None:
            self.misses += 1
            running = self._start(key, compute)
        else:
            self.hits += 1
        return await asyncio.shield(running)

    def _start(self, key: Hashable, compute: Callable[[], Awaitable[V]]) -> asyncio.Future[V]:
        # a task of its own: a client that disconnects does not cancel what the others wait for
        task = asyncio.ensure_future(self._compute(key, compute))
        self._running[key] = task
        return task

    async def _compute(self, key: Hashable, compute: Callable[[], Awaitable[V]]) -> V:
        me = asyncio.current_task()
        try:
            value = await compute()
        finally:
            current = self._running.get(key)
            if current is me:
                del self._running[key]
        if current is me:  # not dropped while it ran
            self.store.put(key, value)
        return value

    def drop(self, match: Callable[[Hashable], bool]) -> None:
        """Forget the answers whose key ``match``es, and let no computation already running store its own."""
        self.store.drop(match)
        for key in [k for k in self._running if match(k)]:
            del self._running[key]
