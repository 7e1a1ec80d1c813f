"""A tenant's storage quota holds when its uploads race: the check and the write are one step under the tenant's
storage lock, so of four concurrent uploads that each fit alone, only those that fit together are stored."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from starverse.service.settings import ServiceSettings
from starverse.service.storage import (
    QuotaExceededError,
    StorageBusyError,
    store,
    tenant_storage_lock,
    used_bytes,
)

QUOTA = 1000
BODY = b"hello world\n" * 33  # 396 bytes: two fit the quota, three do not


def _slow(chunks: list[bytes], started: threading.Event) -> Iterator[bytes]:
    """The body, after a pause: without the lock every upload has counted the free bytes by then."""
    started.set()
    time.sleep(0.15)
    yield from chunks


def test_concurrent_uploads_of_one_tenant_never_pass_its_quota(tmp_path: Path) -> None:
    settings = ServiceSettings(root=tmp_path)

    def upload(i: int) -> int | str:
        try:
            return store(settings, "t1", "datasets", f"d{i}.txt", _slow([BODY], threading.Event()), QUOTA)
        except QuotaExceededError as e:
            return str(e)

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(upload, range(4)))
    stored = [r for r in results if isinstance(r, int)]
    refused = [r for r in results if isinstance(r, str)]
    assert stored == [len(BODY)] * 2, results
    assert len(refused) == 2 and all("passes the storage quota of 1000 bytes (208 bytes left)" in r for r in refused)
    assert used_bytes(settings, "t1") == 2 * len(BODY) <= QUOTA
    # nothing of a refused upload is left behind, not even its part file
    assert sorted(p.name for p in (tmp_path / "tenants" / "t1" / "datasets").iterdir()) == sorted(
        f"d{i}.txt" for i, r in enumerate(results) if isinstance(r, int))


def test_another_tenants_upload_does_not_wait(tmp_path: Path) -> None:
    settings = ServiceSettings(root=tmp_path)
    with tenant_storage_lock(settings, "t1"):
        t0 = time.monotonic()
        assert store(settings, "t2", "datasets", "d.txt", [BODY], QUOTA) == len(BODY)
        assert time.monotonic() - t0 < 1.0


def test_a_lock_held_past_the_wait_is_a_typed_error(tmp_path: Path) -> None:
    settings = ServiceSettings(root=tmp_path)

    def take() -> None:
        with tenant_storage_lock(settings, "t1", wait_s=0.05):
            pass

    with tenant_storage_lock(settings, "t1"), pytest.raises(StorageBusyError, match="retry when it is done"):
        take()
    take()  # released on exit
