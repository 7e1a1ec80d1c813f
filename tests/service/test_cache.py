"""The server's caches: one computation however many ask at once, nothing remembered from a failure or from a
computation overtaken by a change, and plan keys that depend on the canonical request and the catalog."""

from __future__ import annotations

import asyncio
import math

import pytest

from starverse.service.cache import Memo, TTLCache, plan_key


def test_memo_shares_one_computation_and_forgets_failures_and_dropped_keys() -> None:
    async def scenario() -> None:
        memo: Memo[dict[str, int]] = Memo(math.inf, 8)
        calls = 0
        release = asyncio.Event()

        async def compute() -> dict[str, int]:
            nonlocal calls
            calls += 1
            await release.wait()
            return {"n": calls}

        waiters = [asyncio.ensure_future(memo.get("k", compute)) for _ in range(5)]
        await asyncio.sleep(0)
        release.set()
        assert [w["n"] for w in await asyncio.gather(*waiters)] == [1] * 5 and calls == 1
        assert (await memo.get("k", compute))["n"] == 1 and calls == 1  # remembered

        async def boom() -> dict[str, int]:
            raise ValueError("bad job")

        for _ in range(2):  # a failure reaches the caller and is not remembered
            with pytest.raises(ValueError, match="bad job"):
                await memo.get("bad", boom)

        # a change while the computation runs: its (stale) answer is returned to its callers, not remembered
        release.clear()
        running = asyncio.ensure_future(memo.get("job", compute))
        await asyncio.sleep(0)
        memo.drop(lambda k: k == "job")
        release.set()
        assert (await running)["n"] == 2
        assert (await memo.get("job", compute))["n"] == 3

    asyncio.run(scenario())


def test_memo_refreshes_an_ageing_answer_in_the_background() -> None:
    async def scenario() -> None:
        memo: Memo[int] = Memo(math.inf, 8, refresh_after_s=0)  # every answer is due for a refresh at once
        calls = 0

        async def compute() -> int:
            nonlocal calls
            calls += 1
            return calls

        assert await memo.get("s", compute) == 1  # computed while the caller waits
        assert await memo.get("s", compute) == 1  # answered at once; a refresh is started behind it
        assert await memo.get("s", compute) == 1  # answered at once; that refresh is already under way
        for _ in range(3):
            await asyncio.sleep(0)
        assert calls == 2  # one refresh, however many asked while it was due
        assert await memo.get("s", compute) == 2  # the refreshed answer

    asyncio.run(scenario())


def test_ttl_cache_of_zero_keeps_nothing_and_drop_forgets() -> None:
    off: TTLCache[int] = TTLCache(0)
    off.put("a", 1)
    assert off.get("a") is None
    on: TTLCache[int] = TTLCache(math.inf, max_entries=2)
    for i, k in enumerate("abc"):
        on.put(k, i)
    assert (on.get("a"), on.get("b"), on.get("c")) == (None, 1, 2)  # the oldest went when full
    on.drop(lambda k: k == "b")
    assert on.get("b") is None and on.get("c") == 2


def test_plan_key_is_the_canonical_request_and_the_catalog_version() -> None:
    as_yaml = {"job": None, "job_yaml": "model: m\ntrain: {seq_len: 8, global_batch: 2}\n",
               "pool": None, "pool_yaml": "currency: USD\noffers: []\n", "top": 5}
    as_objects = {"job": {"train": {"global_batch": 2, "seq_len": 8}, "model": "m"}, "job_yaml": None,
                  "pool": {"offers": [], "currency": "USD"}, "pool_yaml": None, "top": 5}
    assert plan_key(as_yaml, "v1") == plan_key(as_objects, "v1")
    assert plan_key(as_yaml, "v1") != plan_key(as_yaml, "v2")
    assert plan_key(as_yaml, "v1") != plan_key({**as_yaml, "top": 3}, "v1")
    assert plan_key(as_yaml, "v1") != plan_key({**as_yaml, "job_yaml": "model: m2\n"}, "v1")
