"""A damaged ledger is checked before it is used (issue 15): ``bill`` and ``bill --check`` say so in one line
(exit 2), a training run never writes to it, and no file is changed or removed, an invalid ``-wal`` included.

The ledger is a real one (jobs, leases with price changes, events, charge rows over ~30 pages); each case
overwrites 512 bytes (one disk sector) of it at a different place.
"""

from __future__ import annotations

import hashlib
import random
import shutil
import sqlite3
from decimal import Decimal
from pathlib import Path

import pytest

from starverse.billing import SCHEMA_VERSION, EventKind, LeasePricing, Ledger, PricingMode
from starverse.cli import main
from starverse.errors import BillingError

T0 = 1_700_000_000
PAGE = 4096


def _fill(led: Ledger, n: int = 300) -> None:
    job = led.start_job("llama", at_s=T0)
    for i in range(n):
        lease = led.open_lease(job, f"n{i % 7}/gpu{i}", "rtx-4090", LeasePricing(PricingMode.SPOT, Decimal("0.36")),
                               at_s=T0 + i * 10)
        led.set_price(lease, "0.72", at_s=T0 + i * 10 + 5)
        led.close_lease(lease, T0 + i * 10 + 3000 + i * 100)
        led.record_event(job, EventKind.CHECKPOINT, at_s=T0 + i * 10 + 1, step=i)


@pytest.fixture(scope="module")
def healthy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ledger") / "ledger.sqlite"
    with Ledger.open(path) as led:
        _fill(led)
    return path


def _snapshot(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}


def _bill(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["bill", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


EMPTY = hashlib.sha256(b"").hexdigest()


def _assert_untouched(before: dict[str, str], folder: Path) -> None:
    """Every file is still there, byte for byte; the only new files are what a read-only SQLite reader of a
    WAL-mode database opens beside it: the shared-memory index and an empty log."""
    after = _snapshot(folder)
    assert {k: after.get(k) for k in before} == before
    for name in set(after) - set(before):
        assert name.endswith("-shm") or (name.endswith("-wal") and after[name] == EMPTY), name


# (page, offset in the page): b-tree page headers, cell pointer arrays and cell contents of table and index
# pages, and the schema page itself
DAMAGE = [(1, 0), (1, 3584), (2, 0), (3, 3584), (5, 3584), (10, 1024), (14, 1024), (18, 0), (21, 3584), (27, 0),
          (31, 3584)]


@pytest.mark.parametrize(("page", "offset"), DAMAGE, ids=[f"page{p}+{o}" for p, o in DAMAGE])
def test_damaged_pages_are_one_error_and_never_written(healthy: Path, tmp_path: Path, page: int, offset: int,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "ledger.sqlite"
    shutil.copy(healthy, path)
    with path.open("r+b") as f:
        f.seek((page - 1) * PAGE + offset)
        f.write(random.Random(page * 4096 + offset).randbytes(512))
    before = _snapshot(tmp_path)
    for args in ([str(tmp_path)], ["--db", str(path), "--check"], ["--db", str(path), "--json"]):
        code, out, err = _bill(args, capsys)
        assert code == 2, (args, out, err)
        assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err
        # the file header (page 1, offset 0) is checked before SQLite reads the file
        what = "not a Starverse ledger (not an SQLite database, or corrupted)" if (page, offset) == (1, 0) \
            else "ledger is damaged ("
        assert f"{path}: {what}" in err and "left untouched" in err
    # what a training run does first (billing callback, pre-launch budget check): refused before any write
    for create in (True, False):
        with pytest.raises(BillingError, match=r"ledger is damaged|not a Starverse ledger"):
            Ledger.open(path, create=create)
    _assert_untouched(before, tmp_path)


def test_damage_in_unused_space_changes_nothing(healthy: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The free middle of a page holds no data: the bill is the healthy one, and --check passes."""
    path = tmp_path / "ledger.sqlite"
    shutil.copy(healthy, path)
    with sqlite3.connect(f"{healthy.as_uri()}?mode=ro", uri=True) as c:
        rows = dict(c.execute("SELECT name, rootpage FROM sqlite_master WHERE name = 'jobs'").fetchall())
    with path.open("r+b") as f:  # the one-row jobs table: its page is nearly empty
        f.seek((rows["jobs"] - 1) * PAGE + 1024)
        f.write(b"\xff" * 512)
    code, out, err = _bill(["--db", str(path), "--json"], capsys)
    assert code == 0, err
    assert out == _bill(["--db", str(healthy), "--json"], capsys)[1].replace(str(healthy), str(path))
    assert _bill(["--db", str(path), "--check"], capsys)[0] == 0


def _with_wal(tmp_path: Path) -> Path:
    """A ledger whose last transactions are still in its -wal (copied while the writer had it open)."""
    src = tmp_path / "src"
    src.mkdir()
    dst = tmp_path / "run"
    dst.mkdir()
    with Ledger.open(src / "ledger.sqlite") as led:
        _fill(led, 20)
        led._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        job = led.start_job("second", at_s=T0)
        lease = led.open_lease(job, "n9/gpu0", "rtx-4090", LeasePricing(PricingMode.ON_DEMAND, Decimal("3.6")),
                               at_s=T0)
        led.close_lease(lease, T0 + 3600)
        for name in ("ledger.sqlite", "ledger.sqlite-wal"):
            shutil.copy(src / name, dst / name)
    assert (dst / "ledger.sqlite-wal").stat().st_size > 32
    return dst


def test_a_valid_wal_is_read_and_kept(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _with_wal(tmp_path)
    before = _snapshot(run)
    code, out, err = _bill([str(run), "--by", "job"], capsys)
    assert code == 0, err
    assert "second" in out and "3.600000" in out  # the job that is only in the log
    _assert_untouched(before, run)


@pytest.mark.parametrize("where", [0, 8, 16], ids=["magic", "page-size", "salt"])
def test_an_invalid_wal_is_one_error_and_never_deleted(tmp_path: Path, where: int,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    run = _with_wal(tmp_path)
    wal = run / "ledger.sqlite-wal"
    with wal.open("r+b") as f:
        f.seek(where)
        f.write(b"\xde\xad\xbe\xef")
    before = _snapshot(run)
    for args in ([str(run)], [str(run), "--check"]):
        code, _, err = _bill(args, capsys)
        assert code == 2 and err.count("\n") == 1, err
        assert f"{wal}: the ledger's write-ahead log is damaged (invalid header)" in err
    with pytest.raises(BillingError, match="write-ahead log is damaged"):
        Ledger.open(run / "ledger.sqlite")
    _assert_untouched(before, run)
    assert wal.exists()


def test_a_missing_table_is_schema_damage(healthy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "ledger.sqlite"
    shutil.copy(healthy, path)
    with sqlite3.connect(path) as c:
        c.execute("DROP TABLE charges")
    code, _, err = _bill(["--db", str(path)], capsys)
    assert code == 2
    assert f"ledger is damaged (schema version {SCHEMA_VERSION} but no table charges)" in err


def test_check_still_lists_inconsistent_rows_of_a_healthy_file(healthy: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """SQLite-sound but tampered data (a charge row's amount) is a problem --check lists (exit 1)."""
    path = tmp_path / "ledger.sqlite"
    shutil.copy(healthy, path)
    with sqlite3.connect(path) as c:
        c.execute("UPDATE charges SET ticks = ticks + 1 WHERE lease_id = 7 AND seq = 0")
    code, _, err = _bill(["--db", str(path), "--check"], capsys)
    assert code == 1
    assert "lease 7: charge row 0 has ticks" in err


def test_train_refuses_a_damaged_ledger_before_launching(healthy: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from helpers import TINY

    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(healthy, run / "ledger.sqlite")
    with (run / "ledger.sqlite").open("r+b") as f:
        f.seek(17 * PAGE)
        f.write(b"\x00" * 512)
    (tmp_path / "tiny.json").write_text(json.dumps(TINY))
    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 50)
    (tmp_path / "train.yaml").write_text("model: tiny.json\ndataset: a.txt\nrun_dir: run\ndevices: {cpu_ranks: 1}\n"
                                         "train: {steps: 3, seq_len: 16, global_batch: 4, micro_batch: 2}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("STARVERSE_PROFILE", "")
    before = _snapshot(run)
    code = main(["train", "train.yaml"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "ledger.sqlite: ledger is damaged" in err
    _assert_untouched(before, run)
    assert not (run / "checkpoints").exists()
