"""The driver's side of the Ray actors' heartbeats (``providers/heartbeat.py``): counters, not timestamps."""

from __future__ import annotations

from starverse.providers.heartbeat import BEAT_KEY, BeatWatch, driver_host


class _Counters:
    """A store's ``add`` as the driver uses it (no server needed)."""

    port = 1234

    def __init__(self) -> None:
        self.values: dict[str, int] = {}

    def add(self, key: str, n: int) -> int:
        self.values[key] = self.values.get(key, 0) + n
        return self.values[key]


def test_a_counter_that_stands_still_past_the_timeout_is_silent_and_one_that_moves_is_not():
    store = _Counters()
    watch = BeatWatch(store, "127.0.0.1", period_s=0.5, timeout_s=3.0)
    a, b = watch.new_beat(), watch.new_beat()
    assert (a.key, b.key, a.host, a.port, a.period_s) == (f"{BEAT_KEY}0", f"{BEAT_KEY}1", "127.0.0.1", 1234, 0.5)
    assert watch.silent_s(a.key, 0.0) is None  # no beat yet: not watched (an actor still starting)
    assert watch.silent_s(a.key, 100.0) is None
    store.add(a.key, 1)
    store.add(b.key, 1)
    assert watch.silent_s(a.key, 100.0) is None and watch.silent_s(b.key, 100.0) is None  # first beats seen
    store.add(b.key, 1)  # b beats again, a does not
    assert watch.silent_s(a.key, 102.9) is None  # not yet past the timeout
    assert watch.silent_s(b.key, 102.9) is None
    assert watch.silent_s(a.key, 103.5) == 3.5
    assert watch.silent_s(b.key, 103.5) is None  # silent only 0.6 s since its count moved at 102.9
    # a driver held up for a long while sees counters that moved, not stale times: no false loss
    store.add(a.key, 5)
    assert watch.silent_s(a.key, 500.0) is None
    watch.forget(a.key)
    assert watch.silent_s(a.key, 1000.0) is None  # forgotten: watched again from its next look


def test_the_driver_store_binds_the_loopback_on_a_one_machine_cluster_else_the_drivers_ip():
    assert driver_host("auto", ["127.0.0.1", "127.0.0.1"], "127.0.0.1") is None
    assert driver_host("auto", ["127.0.0.1", "10.0.0.2"], "10.0.0.1") == "10.0.0.1"
