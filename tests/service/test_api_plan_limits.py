"""``POST /api/plan`` is bounded: a pool past ``max_plan_offers`` offers or ``max_plan_devices`` devices is one
422 line before any search runs, and a search past ``plan_time_limit_s`` is stopped with a 422 line while
the planner process stays usable."""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from service_fixtures import Service

from starverse.errors import SearchTimeLimitError
from starverse.service.api_plan import plan_document, time_limit

SQLITE = pytest.mark.parametrize("db_url", [""], ids=["sqlite"])  # the database only authenticates here

JOB = {"model": "llama-2-7b", "train": {"seq_len": 4096, "global_batch": 128, "tokens": 2.0e9}}


def _offers(n: int, count: int) -> list[dict[str, object]]:
    return [{"accelerator": "rtx-4090", "count": count, "price_per_hour": 0.69, "name": f"o{i}"} for i in range(n)]


@SQLITE
@pytest.mark.parametrize(("pool", "words"), [
    ({"offers": _offers(1, 1_000_000)}, "pool.offers: 1,000,000 devices in all; the service plans at most 65,536 at "
                                        "once. To fix: give fewer devices (count), or run `starverse plan`"),
    ({"offers": _offers(2, 40_000)}, "pool.offers: 80,000 devices in all"),
    ("pool_yaml", "pool.offers: 17 offers; the service plans pools of at most 16. To fix: keep the offers"),
])
def test_a_pool_past_the_service_bounds_is_refused_before_any_search(service: Service, pool: object,
                                                                     words: str) -> None:
    h = service.tenant("alice")
    body = ({"job": JOB, "pool_yaml": yaml.safe_dump({"offers": _offers(17, 1)})} if pool == "pool_yaml"
            else {"job": JOB, "pool": pool})
    r = service.client.post("/api/plan", headers=h, json=body)
    assert r.status_code == 422 and r.json()["detail"].startswith(words), r.text
    plans = service.client.app.state.ctx.plans  # type: ignore[attr-defined]
    assert plans.misses == 0  # no search was started, not even queued


@SQLITE
def test_a_search_past_the_time_limit_is_one_422_line(
        make_service: Callable[..., Service]) -> None:
    service = make_service(plan_time_limit_s=0.001)
    r = service.client.post("/api/plan", headers=service.tenant("alice"),
                            json={"job": JOB, "pool": {"offers": _offers(1, 16)}})
    assert r.status_code == 422, r.text
    assert r.json() == {"detail": "the plan search ran past the service's limit of 0.001 s. To fix: fewer offers or "
                                  "devices in the pool, a smaller train.global_batch, or run `starverse plan` on "
                                  "your own machine (no limit)", "error": "SearchTimeLimitError"}


def test_the_time_limit_stops_a_search_and_leaves_the_process_able_to_plan(tmp_path: Path) -> None:
    body = {"job": JOB, "pool": {"offers": _offers(2, 1000)}, "top": 5}
    handler = signal.getsignal(signal.SIGALRM)
    with pytest.raises(SearchTimeLimitError):
        plan_document(str(tmp_path), body, time_limit_s=0.01)
    doc = plan_document(str(tmp_path), body, time_limit_s=60)
    assert doc["feasible"] and doc["plans"][0]["rank"] == 1
    assert list(tmp_path.iterdir()) == []  # the stopped search's scratch folder is gone too
    assert signal.getsignal(signal.SIGALRM) is handler  # pytest-timeout's handler is back


def test_an_alarm_inside_a_finalizer_still_stops_the_search() -> None:
    """The limit's alarm can fire while a finalizer or a gc weakref callback runs (seen: SQLAlchemy's, during a
    search), where Python drops what it raises ("Exception ignored in"): the search is stopped all the same, and
    nothing reaches the unraisable hook."""

    class SlowFinalizer:
        def __del__(self) -> None:
            end = time.monotonic() + 0.2  # runs past the limit
            while time.monotonic() < end:
                pass

    seen: list[object] = []
    hook = sys.unraisablehook
    sys.unraisablehook = seen.append
    try:
        with pytest.raises(SearchTimeLimitError), time_limit(0.05):
            SlowFinalizer()  # finalized at once
            end = time.monotonic() + 5.0  # the search's own work, which the limit stops
            while time.monotonic() < end:
                pass
        assert time.monotonic() < end
    finally:
        sys.unraisablehook = hook
    assert seen == []
