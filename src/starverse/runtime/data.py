"""Training data: read a corpus, tokenise it, pack it into fixed-length sequences, sample deterministically.

``dataset=`` may be a path (a text file, a folder of text files, a ``.jsonl`` file with a ``text`` field),
a Hugging Face ``datasets.Dataset`` (duck-typed: anything with ``column_names`` and a ``text`` column),
or an iterable of token tensors / integer sequences (already tokenised). Text is tokenised with a
byte-level BPE trained on the corpus itself (cached under ``~/.cache/starverse/tokenizers``) or as raw
UTF-8 bytes; nothing is downloaded.

Packing concatenates documents separated by an end-of-text token and cuts ``seq_len``-token sequences,
so every sequence has the same number of loss tokens: the mean loss of a batch is then the mean over
its sequences, which is what makes sample-weighted heterogeneous data parallelism exact.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from starverse.errors import ConfigError

log = logging.getLogger(__name__)

TEXT_SUFFIXES = frozenset({".txt", ".md", ".rst", ".py", ".jsonl", ".json", ".csv", ".tex", ".html", ".c", ".h"})
"""File suffixes read when ``dataset`` is a folder."""

EOT = "<|endoftext|>"
"""The document separator token of trained tokenizers."""


def cache_dir() -> Path:
    """Where tokenizers and tokenised corpora are cached (``$STARVERSE_CACHE`` or ``~/.cache/starverse``)."""
    return Path(os.environ.get("STARVERSE_CACHE") or Path.home() / ".cache" / "starverse")


def _corpus_files(path: Path) -> list[Path]:
    if not path.exists():
        raise ConfigError(f"dataset '{path}' does not exist. To fix: pass a text file, a folder of text files or a .jsonl file.")
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    if not files:
        raise ConfigError(
            f"dataset '{path}' holds no text files ({', '.join(sorted(TEXT_SUFFIXES))}). "
            "To fix: point it at a folder with text in it."
        )
    return files


def _read_documents(files: list[Path], max_bytes: int | None) -> list[str]:
    """The documents of the corpus (a .jsonl line's ``text``, or a whole text file), up to ``max_bytes``."""
    docs: list[str] = []
    total = 0
    for f in files:
        if f.suffix.lower() == ".jsonl":
            with f.open(encoding="utf-8", errors="replace") as fh:
                for lineno, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ConfigError(f"{f}:{lineno}: malformed JSON line ({e.msg}).") from None
                    if not isinstance(row, dict) or "text" not in row:
                        raise ConfigError(f"{f}:{lineno}: each .jsonl line needs a 'text' field.")
                    docs.append(str(row["text"]))
                    total += len(docs[-1])
                    if max_bytes is not None and total >= max_bytes:
                        return docs
        else:
            docs.append(f.read_text(encoding="utf-8", errors="replace"))
            total += len(docs[-1])
        if max_bytes is not None and total >= max_bytes:
            break
    return docs


def _fingerprint(files: list[Path], extra: str) -> str:
    h = hashlib.sha256(extra.encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class TokenizedCorpus:
    """A corpus as one flat token array plus what produced it."""

    tokens: np.ndarray
    """All tokens, documents separated by ``eot_id`` (int32)."""
    vocab_size: int
    """Number of token ids the tokenizer can produce (the model's vocabulary must be at least this)."""
    eot_id: int
    """Id of the document separator."""
    tokenizer: str
    """``bytes``, ``bpe:<path to tokenizer.json>`` or ``pretokenized``."""


def _train_bpe(docs: list[str], vocab_size: int, path: Path) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tok.save(str(tmp))
    tmp.replace(path)
    return tok


def tokenize_corpus(
    dataset: Any,
    *,
    tokenizer: str = "bpe",
    vocab_size: int = 4096,
    max_bytes: int | None = None,
) -> TokenizedCorpus:
    """Read and tokenise ``dataset`` (see the module docstring); results are cached by content fingerprint.

    ``tokenizer``: ``bpe`` (byte-level BPE trained on this corpus, ``vocab_size`` ids) or ``bytes``
    (UTF-8 bytes, 257 ids with the separator). ``max_bytes`` caps how much text is read.
    Raises :class:`ConfigError` for a missing or empty dataset.
    """
    if tokenizer not in ("bpe", "bytes"):
        raise ConfigError(f"tokenizer must be 'bpe' or 'bytes' (got {tokenizer!r}).")
    if dataset is None:
        raise ConfigError("no dataset given. To fix: pass dataset= a text file, folder, .jsonl file or token tensors.")
    if isinstance(dataset, (str, os.PathLike)):
        files = _corpus_files(Path(dataset))
        key = _fingerprint(files, f"{tokenizer}:{vocab_size}:{max_bytes}")
        cached = cache_dir() / "corpora" / f"{key}.npz"
        if cached.is_file():
            with np.load(cached) as z:
                return TokenizedCorpus(
                    tokens=z["tokens"], vocab_size=int(z["vocab_size"]), eot_id=int(z["eot_id"]),
                    tokenizer=str(z["tokenizer"]),
                )
        docs = _read_documents(files, max_bytes)
        corpus = _tokenize_docs(docs, tokenizer, vocab_size, key, source=str(dataset))
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(cached.stem + ".tmp.npz")
        np.savez(tmp, tokens=corpus.tokens, vocab_size=corpus.vocab_size, eot_id=corpus.eot_id,
                 tokenizer=corpus.tokenizer)
        tmp.replace(cached)
        return corpus
    if hasattr(dataset, "column_names"):
        if "text" not in dataset.column_names:
            raise ConfigError(
                f"the Dataset has no 'text' column (columns: {', '.join(dataset.column_names)}). "
                "To fix: rename the text column to 'text'."
            )
        docs = [str(t) for t in dataset["text"]]
        key = hashlib.sha256("\x00".join(docs).encode()).hexdigest()[:16] + f"-{tokenizer}-{vocab_size}"
        return _tokenize_docs(docs, tokenizer, vocab_size, key, source="the Dataset")
    if isinstance(dataset, Iterable):
        return _pretokenized(dataset)
    raise ConfigError(
        f"dataset of type {type(dataset).__name__} is not supported. To fix: pass a path, a datasets.Dataset "
        "or an iterable of token tensors."
    )


def _tokenize_docs(docs: list[str], tokenizer: str, vocab_size: int, key: str, source: str) -> TokenizedCorpus:
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise ConfigError(f"dataset {source} is empty (no text). To fix: point it at files with text in them.")
    if tokenizer == "bytes":
        eot = 256
        parts: list[np.ndarray] = []
        for d in docs:
            parts.append(np.frombuffer(d.encode("utf-8"), dtype=np.uint8).astype(np.int32))
            parts.append(np.array([eot], dtype=np.int32))
        return TokenizedCorpus(np.concatenate(parts), 257, eot, "bytes")
    path = cache_dir() / "tokenizers" / f"{key}.json"
    if path.is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path))
    else:
        log.info("training a byte-level BPE tokenizer (%d ids) on %s", vocab_size, source)
        tok = _train_bpe(docs, vocab_size, path)
    eot_id = tok.token_to_id(EOT)
    if eot_id is None:
        raise ConfigError(f"tokenizer {path} has no {EOT!r} token. To fix: delete it; it is rebuilt from the corpus.")
    eot = eot_id
    encoded = tok.encode_batch(docs)
    parts = []
    for enc in encoded:
        parts.append(np.asarray(enc.ids, dtype=np.int32))
        parts.append(np.array([eot], dtype=np.int32))
    return TokenizedCorpus(np.concatenate(parts), tok.get_vocab_size(), int(eot), f"bpe:{path}")


def _pretokenized(items: Iterable[Any]) -> TokenizedCorpus:
    parts: list[np.ndarray] = []
    for i, item in enumerate(items):
        arr = item.detach().cpu().numpy() if hasattr(item, "detach") else np.asarray(item)
        if arr.dtype.kind not in "iu":
            raise ConfigError(f"dataset item {i} has dtype {arr.dtype}; token ids must be integers.")
        parts.append(arr.reshape(-1).astype(np.int32))
    if not parts or sum(p.size for p in parts) == 0:
        raise ConfigError("dataset is empty (the iterable gave no tokens). To fix: pass non-empty token tensors.")
    tokens = np.concatenate(parts)
    if tokens.min() < 0:
        raise ConfigError("dataset holds negative token ids.")
    return TokenizedCorpus(tokens, int(tokens.max()) + 1, -1, "pretokenized")


@dataclass(frozen=True)
class PackedDataset:
    """Fixed-length sequences cut from a token array (the remainder that does not fill one is dropped)."""

    tokens: np.ndarray
    """The flat token array."""
    seq_len: int
    """Tokens per sequence."""

    def __post_init__(self) -> None:
        if self.seq_len <= 0:
            raise ConfigError(f"seq_len must be > 0 (got {self.seq_len}).")

    def __len__(self) -> int:
        return int(self.tokens.size // self.seq_len)

    def batch(self, indices: np.ndarray | list[int]) -> np.ndarray:
        """Sequences ``indices`` as an int64 array of shape ``[len(indices), seq_len]``."""
        idx = np.asarray(indices, dtype=np.int64)
        starts = idx[:, None] * self.seq_len + np.arange(self.seq_len)[None, :]
        return self.tokens[starts].astype(np.int64)


def pack(corpus: TokenizedCorpus, seq_len: int, min_sequences: int = 1) -> PackedDataset:
    """Pack a corpus into ``seq_len`` sequences; at least ``min_sequences`` of them (else a ConfigError)."""
    ds = PackedDataset(corpus.tokens, seq_len)
    if len(ds) < min_sequences:
        raise ConfigError(
            f"dataset has {corpus.tokens.size} tokens: {len(ds)} sequences of {seq_len}, fewer than the "
            f"{min_sequences} one step needs. To fix: add text, or lower seq_len or the batch size."
        )
    return ds


class DeterministicSampler:
    """Global-batch sampler over ``num_sequences``: a seeded permutation per epoch, a saveable position.

    Every rank holds the same sampler and draws the same global batch; each rank then takes its slice.
    The whole state is ``(seed, epoch, position)``, so a resume on any number of ranks continues with the
    exact next sequences.
    """

    def __init__(self, num_sequences: int, seed: int = 0):
        if num_sequences <= 0:
            raise ConfigError("sampler needs at least one sequence.")
        self.num_sequences = num_sequences
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_sequences)

    def next_indices(self, n: int) -> np.ndarray:
        """The next ``n`` sequence indices (crossing into the next epoch when needed)."""
        out: list[np.ndarray] = []
        while n > 0:
            take = min(n, self.num_sequences - self.position)
            out.append(self._perm[self.position : self.position + take])
            self.position += take
            n -= take
            if self.position == self.num_sequences:
                self.epoch += 1
                self.position = 0
                self._perm = self._permutation(self.epoch)
        return np.concatenate(out)

    def __iter__(self) -> Iterator[int]:
        while True:
            yield int(self.next_indices(1)[0])

    def state_dict(self) -> dict[str, int]:
        """Where the sampler is: ``{"seed", "epoch", "position", "num_sequences"}``."""
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position, "num_sequences": self.num_sequences}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        """Continue from a saved position (the dataset must have the same number of sequences)."""
        if int(sd["num_sequences"]) != self.num_sequences:
            raise ConfigError(
                f"the saved data position is for {sd['num_sequences']} sequences, this dataset has "
                f"{self.num_sequences}. To fix: resume with the same dataset and seq_len."
            )
        self.seed = int(sd["seed"])
        self.epoch = int(sd["epoch"])
        self.position = int(sd["position"])
        self._perm = self._permutation(self.epoch)
