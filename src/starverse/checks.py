"""Checks of the files and ports a command will use, made before it computes or launches anything.

A command or job that would fail late (a plan written after a minute of search into a folder that does not exist, a
rank that cannot bind its metrics port, a tokenizer fed a binary file) fails here instead, as one line naming
the file, the field and the fix. Each check is cheap: a ``stat``, a read of the first kilobytes, a ``bind``.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from starverse.config import check_path_text, where
from starverse.errors import ConfigError

_SNIFF_BYTES = 64 * 1024
"""How much of a dataset file is read to tell text from binary."""
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")
"""Config keys that bound a model's sequence length (the runtime reads the same ones)."""


def check_output_file(path: Path, option: str) -> None:
    """``path`` can be written as a file: its folder exists and it is not itself a folder."""
    try:
        check_path_text(str(path), "file name")
    except ValueError as e:
        raise ConfigError(f"{option} {path}: {e}") from None
    if path.is_dir() or path.name in ("", ".", ".."):
        raise ConfigError(f"{option} {path}: is a directory; give a file name (e.g. {path / 'plan.yaml'})")
    parent = path.parent
    if not parent.is_dir():
        what = "is a file, not a directory" if parent.exists() else "does not exist"
        raise ConfigError(f"{option} {path}: the folder {parent} {what}. To fix: create it, or write elsewhere")


def not_text_at(data: bytes, cut: bool = False) -> tuple[int, str] | None:
    """Where ``data`` stops being text: the offset and why (a NUL byte, not UTF-8), None if it is UTF-8 text.
    ``cut``: ``data`` is the head of a longer file, so a multi-byte character cut at its end is still text."""
    bad = data.find(b"\x00")
    if bad >= 0:
        return bad, "a NUL byte"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        if not cut or e.start < len(data) - 4:
            return e.start, "not UTF-8"
    return None


def check_dataset(dataset: str, source: str) -> None:
    """A dataset exists, and a dataset *file* holds text (UTF-8, no NUL byte) in its first 64 KiB; folders are
    filtered by suffix. Checked before the job writes anything (its run folder, ledger, checkpoints)."""
    path = Path(dataset)
    if not path.exists():
        raise ConfigError(f"{where(source, ('dataset',))}: dataset: {path} does not exist. To fix: pass a text file, "
                          "a folder of text files or a .jsonl file (a relative path is read from the job file's folder)")
    if not path.is_file():
        return
    try:
        with path.open("rb") as fh:
            head = fh.read(_SNIFF_BYTES)
    except OSError as e:
        raise ConfigError(f"{where(source, ('dataset',))}: dataset: cannot read {path} ({e.strerror})") from None
    if not_text_at(head, cut=True) is not None:  # a character cut by the 64 KiB window is still text
        raise ConfigError(f"{where(source, ('dataset',))}: dataset: {path} is not a text file (binary or not UTF-8). "
                          "To fix: pass a text file, a folder of text files or a .jsonl file")


def check_model(model: str, source: str | Path, base_dir: str | Path | None = None) -> Any:
    """The ``ModelSpec`` of the model a file names in its ``model:`` field (``base_dir``: what a relative path
    is relative to); an unknown or malformed one is an error at that field's line (``job.yaml:1: model: ...``)."""
    from starverse.models import load_model

    try:
        return load_model(model, base_dir=base_dir)
    except ConfigError as e:
        raise type(e)(f"{where(source, ('model',))}: model: {e}", ("model",)) from None


def check_run_dir(run_dir: str | Path, source: str, field: str = "run_dir", *, option: str | None = None) -> None:
    """The run directory is a directory, or does not exist yet (it is created). Given in a file (``source``,
    ``field``) or by a command-line ``option`` (``--run-dir``)."""
    path = Path(run_dir)
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                origin = option or f"{where(source, (field,))}: {field}"
                raise ConfigError(f"{origin}: {p} is a file, not a directory. To fix: point it at a directory "
                                  "(created if missing), or move the file away")
            return


def check_port_free(port: int, origin: str) -> None:
    """A fixed port is free on 127.0.0.1 (0 picks a free one and needs no check); ``origin`` says where it was
    given (``job.yaml:7: metrics.port``, ``--metrics-port``)."""
    if port == 0:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the HTTP server binds it
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            why = "in use by another process" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
            raise ConfigError(f"{origin}: port {port} on 127.0.0.1 is {why}. "
                              "To fix: choose another port, or 0 for a free one") from None


def check_seq_len(seq_len: int, model_config: Mapping[str, Any] | None, model: str, source: str) -> None:
    """``train.seq_len`` fits the positions of the model that will be trained (after any scaling down)."""
    cfg = model_config or {}
    limit = next((cfg[k] for k in _POSITION_KEYS if isinstance(cfg.get(k), int)), None)
    if limit is not None and seq_len > limit:
        raise ConfigError(f"{where(source, ('train', 'seq_len'))}: train.seq_len: {seq_len} exceeds the {limit} "
                          f"positions of model {model}. To fix: set seq_len to at most {limit}")
