"""Bad command lines found by the hardening pass (docs/service.md, tests/e2e/test_bad_input_cli.py has the
earlier ones): each is one ``error:`` line naming the file, option or field and the fix, exit code 2, no
traceback, no hang, and nothing half-written is left in the service's registry."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from starverse.cli import main

JOB = "model: llama-2-7b\ntrain: {seq_len: 4096, global_batch: 128, tokens: 2.0e9}\n"
POOL = "currency: USD\noffers:\n  - {accelerator: rtx-4090, count: 16, price_per_hour: 0.69}\n"
LONG = "x" * 5000

CASES: list[tuple[str, tuple[str, ...], dict[str, str], str]] = [
    # (id, argv, environment, a part of the one error line)
    ("profile-a-fifo", ("catalog", "--profile", "fifo"), {},  # read forever before
     "fifo: cannot read (not a regular file: a device, FIFO or socket). To fix: give the path of a probe profile"),
    ("profile-env-a-folder", ("plan", "job.yaml", "--pool", "pool.yaml"), {"STARVERSE_PROFILE": "."},
     ".: cannot read (IsADirectoryError: a folder, not a file). To fix: give the path of a probe profile JSON"),
    ("profile-binary", ("catalog", "--profile", "bin.json"), {},
     "bin.json: cannot read (UnicodeDecodeError: byte 0xff at offset 0 is not UTF-8"),
    ("database-not-a-database", ("serve", "--database", "sqlite:///job.yaml", "tenant", "create", "a", "--root", "svc"),
     {}, "--database: cannot open the database (file is not a database). To fix:"),
    ("register-a-fifo", ("serve", "dataset", "register", "d", "fifo", "--root", "svc"), {},
     "fifo: not a regular file or folder (a device, FIFO or socket). To fix: give a file or folder"),
    ("register-a-folder-holding-a-fifo", ("serve", "dataset", "register", "d", "corpus", "--root", "svc"), {},
     "corpus: cannot be copied into the platform registry (`corpus/pipe` is a named pipe). To fix:"),
    ("register-a-binary-model", ("serve", "model", "register", "m", "bin.json", "--root", "svc"), {},
     "models/m: not a model config the service can train"),
    ("register-a-model-that-is-not-json", ("serve", "model", "register", "m", "job.yaml", "--root", "svc"), {},
     "models/m: not a model config the service can train: config.json:1: malformed JSON"),
    ("serve-host-not-an-address", ("serve", "--host", "999.1.1.1", "--slots", "0", "--root", "svc"), {},
     "--host '999.1.1.1': not an address (Name or service not known). To fix: give 127.0.0.1"),
    ("serve-host-of-another-machine", ("serve", "--host", "192.0.2.1", "--slots", "0", "--root", "svc"), {},
     "--host 192.0.2.1 --port 8000: cannot listen there (Cannot assign requested address). To fix:"),
    ("serve-port-in-use", ("serve", "--port", "{busy}", "--slots", "0", "--root", "svc"), {},
     "--port {busy}: cannot listen there (Address already in use). To fix: another --port"),
]

LONG_CASES: list[tuple[str, tuple[str, ...], str]] = [
    # (id, argv, the start of the error line): a 5000-character argument is not echoed whole
    ("currency-5000-chars", ("catalog", "--currency", LONG), "error: unknown currency 'XXX"),
    ("tenant-name-5000-chars", ("serve", "tenant", "create", LONG, "--root", "svc"), "error: tenant name 'xxx"),
]


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A user's folder: a job, a pool, a FIFO, a binary file and a corpus folder holding a FIFO."""
    (tmp_path / "job.yaml").write_text(JOB)
    (tmp_path / "pool.yaml").write_text(POOL)
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("hello\n")
    os.mkfifo(tmp_path / "corpus" / "pipe")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("STARVERSE_PROFILE", "")
    monkeypatch.setenv("COLUMNS", "400")
    return tmp_path


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port something already listens on, on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("argv", "env", "expect"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_clean_line(argv: tuple[str, ...], env: dict[str, str], expect: str, folder: Path,
                                     busy_port: int, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    code = main([a.replace("{busy}", str(busy_port)) for a in argv])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert "Traceback" not in err and "\n" not in err, err
    assert err.startswith("error: ") and expect.replace("{busy}", str(busy_port)) in err, err
    registry = folder / "svc" / "platform"
    if registry.is_dir():  # a refused registration leaves no copy, not even a part of one
        assert [p for p in registry.rglob("*") if p.is_file()] == []


@pytest.mark.parametrize(("argv", "start"), [c[1:] for c in LONG_CASES], ids=[c[0] for c in LONG_CASES])
def test_a_huge_argument_is_not_echoed_whole(argv: tuple[str, ...], start: str, folder: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(start) and len(err) < 400 and "\n" not in err, err[:500]
