"""Training data: read a corpus, tokenise it, pack it into fixed-length sequences, sample deterministically.

``dataset=`` may be a path (a text file, a folder of text files, a ``.jsonl`` file with a ``text`` field),
a Hugging Face ``datasets.Dataset`` (duck-typed: anything with ``column_names`` and a ``text`` column),
or an iterable of token tensors / integer sequences (already tokenised). Text is tokenised with a model's own
tokenizer (a Hugging Face folder with ``tokenizer.json`` / ``tokenizer_config.json``, read with
``AutoTokenizer`` from local files only), a byte-level BPE trained on the corpus itself (for from-scratch runs;
cached under ``~/.cache/starverse/tokenizers``) or raw UTF-8 bytes; nothing is downloaded.

Chat / instruction data: a ``.jsonl`` whose lines hold ``prompt`` and ``response`` (optionally ``system``), or
``messages`` (``[{"role", "content"}, ...]``), is rendered with the tokenizer's chat template when it has one
(else as ``role: content`` lines) and trained with the loss on the assistant's tokens only: the other tokens
get the label -100 (:attr:`PackedDataset.labels`), which the loss ignores.

Packing concatenates documents separated by an end-of-text token and cuts ``seq_len``-token sequences,
so every sequence has the same number of loss tokens: the mean loss of a batch is then the mean over
its sequences, which is what makes sample-weighted heterogeneous data parallelism exact. With masked labels
(chat data) the sequences hold different numbers of loss tokens; the trainer then divides each rank's summed
token loss by the global batch's count of loss tokens (every rank knows it: all draw the same global batch),
which is exact again.
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


Chat = tuple[tuple[str, str], ...]
"""A chat example: ``(role, content)`` turns; the ``assistant`` turns are trained, the others are context."""

Document = str | Chat
"""A plain text document (trained on every token) or a chat example."""


def _chat_of(row: dict[str, Any], where: str) -> Chat | None:
    """The chat turns of a .jsonl row with ``prompt``/``response`` or ``messages``; None for a ``text`` row."""
    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs
        ):
            raise ConfigError(f"{where}: 'messages' must be a list of {{\"role\": ..., \"content\": ...}} objects.")
        if not any(m["role"] == "assistant" for m in msgs):
            raise ConfigError(f"{where}: 'messages' has no assistant turn, so nothing would be trained. "
                              "To fix: add the assistant's reply.")
        return tuple((m["role"], m["content"]) for m in msgs)
    if "prompt" in row or "response" in row:
        if not isinstance(row.get("prompt"), str) or not isinstance(row.get("response"), str):
            raise ConfigError(f"{where}: an instruction line needs string 'prompt' and 'response' fields.")
        system = (("system", str(row["system"])),) if row.get("system") else ()
        return (*system, ("user", row["prompt"]), ("assistant", row["response"]))
    return None


def _read_documents(files: list[Path], max_bytes: int | None) -> list[Document]:
    """The documents of the corpus (a .jsonl line's ``text`` or chat, or a whole text file), up to ``max_bytes``."""
    docs: list[Document] = []
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
                    chat = _chat_of(row, f"{f}:{lineno}") if isinstance(row, dict) else None
                    if chat is None and (not isinstance(row, dict) or "text" not in row):
                        raise ConfigError(f"{f}:{lineno}: each .jsonl line needs a 'text' field, 'prompt' and "
                                          "'response', or 'messages'.")
                    doc: Document = chat if chat is not None else str(row["text"])
                    docs.append(doc)
                    total += len(doc) if isinstance(doc, str) else sum(len(c) for _, c in doc)
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
    """``bytes``, ``bpe:<path to tokenizer.json>``, ``hf:<model folder>`` or ``pretokenized``."""
    loss_mask: np.ndarray | None = None
    """Per token: 1 where the token is a training target, 0 for context (chat prompts); None: every token."""


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


class TextTokenizer:
    """Text -> token ids for one tokenizer kind; ``chat_text`` renders a chat as (text, trained) segments."""

    name: str = ""
    """How the corpus was tokenised (``TokenizedCorpus.tokenizer``)."""
    vocab_size: int = 0
    """Ids the tokenizer can produce."""
    eot_id: int = 0
    """The document separator."""

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        raise NotImplementedError

    def chat_text(self, chat: Chat) -> list[tuple[str, bool]]:
        """Plain rendering: a ``role: `` header (context) and the content, trained for the assistant."""
        out: list[tuple[str, bool]] = []
        for role, content in chat:
            out.append((f"{role}: ", False))
            out.append((content + "\n", role == "assistant"))
        return out


class _Bytes(TextTokenizer):
    name, vocab_size, eot_id = "bytes", 257, 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class _Bpe(TextTokenizer):
    def __init__(self, tok: Any, path: Path):
        eot = tok.token_to_id(EOT)
        if eot is None:
            raise ConfigError(f"tokenizer {path} has no {EOT!r} token. To fix: delete it; it is rebuilt from the corpus.")
        self.tok, self.name = tok, f"bpe:{path}"
        self.vocab_size, self.eot_id = int(tok.get_vocab_size()), int(eot)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text).ids)


class HFTokenizer(TextTokenizer):
    """A model's own tokenizer (``transformers.AutoTokenizer``, local files only); its chat template if any."""

    def __init__(self, tok: Any, source: str):
        self.tok, self.source, self.name = tok, source, f"hf:{source}"
        self.vocab_size = len(tok)
        eot = tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id
        if eot is None:
            raise ConfigError(f"{source}: the tokenizer has no eos_token, needed to separate documents. To fix: "
                              "set eos_token in its tokenizer_config.json.")
        self.eot_id = int(eot)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def chat_text(self, chat: Chat) -> list[tuple[str, bool]]:
        """The chat template's rendering, turn by turn: each turn adds the text it appends to the previous
        rendering; an assistant turn's content (and what follows it in its turn) is trained, its header not.
        Falls back to the plain rendering when there is no template or it is not prefix-stable."""
        if not getattr(self.tok, "chat_template", None):
            return super().chat_text(chat)
        out: list[tuple[str, bool]] = []
        prev = ""
        for i, (role, content) in enumerate(chat):
            text = self.tok.apply_chat_template([{"role": r, "content": c} for r, c in chat[: i + 1]], tokenize=False)
            at = text.find(content, len(prev))
            if not text.startswith(prev) or at < 0:
                return super().chat_text(chat)
            if role == "assistant":
                out += [(text[len(prev) : at], False), (text[at:], True)]
            else:
                out.append((text[len(prev) :], False))
            prev = text
        return out


def model_tokenizer(model: Any) -> str | None:
    """The folder of the model's own tokenizer (``config._name_or_path`` when it is a folder with tokenizer files)."""
    from starverse.models.folder import TOKENIZER_FILES

    path = getattr(getattr(model, "config", None), "_name_or_path", None)
    if not path or not Path(path).is_dir():
        return None
    return str(path) if any((Path(path) / f).is_file() for f in TOKENIZER_FILES) else None


def load_tokenizer(ref: str | Path | Any) -> HFTokenizer:
    """A model folder's tokenizer (or a ``tokenizer.json`` file, or a transformers tokenizer object)."""
    if not isinstance(ref, str | Path):
        if not callable(getattr(ref, "encode", None)) or not hasattr(ref, "eos_token_id"):
            raise ConfigError(f"tokenizer of type {type(ref).__name__} is not a transformers tokenizer.")
        return HFTokenizer(ref, str(getattr(ref, "name_or_path", "") or type(ref).__name__))
    path = Path(ref).expanduser().resolve()
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok: Any
    try:
        if path.is_file() and path.suffix == ".json":
            tok = PreTrainedTokenizerFast(tokenizer_file=str(path))
            if tok.eos_token is None and EOT in tok.get_vocab():
                tok.eos_token = EOT
        elif path.is_dir():
            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        else:
            raise ConfigError(f"tokenizer '{path}' does not exist. To fix: pass a model folder or a tokenizer.json.")
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{path}: no usable tokenizer ({' '.join(str(e).split())[:160]}). To fix: save the tokenizer with "
            "tokenizer.save_pretrained into the model folder, or use tokenizer: bpe."
        ) from None
    return HFTokenizer(tok, str(path))


def tokenize_corpus(
    dataset: Any,
    *,
    tokenizer: str | Any = "bpe",
    vocab_size: int = 4096,
    max_bytes: int | None = None,
) -> TokenizedCorpus:
    """Read and tokenise ``dataset`` (see the module docstring); results are cached by content fingerprint.

    ``tokenizer``: ``bpe`` (byte-level BPE trained on this corpus, ``vocab_size`` ids), ``bytes`` (UTF-8
    bytes, 257 ids with the separator), a model folder / ``tokenizer.json`` path, or a transformers tokenizer.
    ``max_bytes`` caps how much text is read. Raises :class:`ConfigError` for a missing or empty dataset.
    """
    hf: HFTokenizer | None = None
    if not (isinstance(tokenizer, str) and tokenizer in ("bpe", "bytes")):
        if isinstance(tokenizer, str) and not Path(tokenizer).expanduser().exists():
            raise ConfigError(f"tokenizer must be 'bpe', 'bytes' or a model folder / tokenizer.json (got {tokenizer!r}).")
        hf = tokenizer if isinstance(tokenizer, HFTokenizer) else load_tokenizer(tokenizer)
    kind = hf.name if hf is not None else str(tokenizer)
    if dataset is None:
        raise ConfigError("no dataset given. To fix: pass dataset= a text file, folder, .jsonl file or token tensors.")
    if isinstance(dataset, (str, os.PathLike)):
        files = _corpus_files(Path(dataset))
        key = _fingerprint(files, f"{kind}:{vocab_size}:{max_bytes}:{_tokenizer_stamp(hf)}")
        cached = cache_dir() / "corpora" / f"{key}.npz"
        if cached.is_file():
            with np.load(cached) as z:
                return TokenizedCorpus(
                    tokens=z["tokens"], vocab_size=int(z["vocab_size"]), eot_id=int(z["eot_id"]),
                    tokenizer=str(z["tokenizer"]), loss_mask=z.get("loss_mask"),
                )
        docs = _read_documents(files, max_bytes)
        corpus = _tokenize_docs(docs, hf or str(tokenizer), vocab_size, key, source=str(dataset))
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(cached.stem + ".tmp.npz")
        arrays: dict[str, Any] = {"tokens": corpus.tokens, "vocab_size": corpus.vocab_size,
                                  "eot_id": corpus.eot_id, "tokenizer": corpus.tokenizer}
        if corpus.loss_mask is not None:
            arrays["loss_mask"] = corpus.loss_mask
        np.savez(tmp, **arrays)
        tmp.replace(cached)
        return corpus
    if hasattr(dataset, "column_names"):
        if "text" not in dataset.column_names:
            raise ConfigError(
                f"the Dataset has no 'text' column (columns: {', '.join(dataset.column_names)}). "
                "To fix: rename the text column to 'text'."
            )
        texts = [str(t) for t in dataset["text"]]
        key = hashlib.sha256("\x00".join(texts).encode()).hexdigest()[:16] + f"-{tokenizer}-{vocab_size}"
        return _tokenize_docs(list(texts), hf or str(tokenizer), vocab_size, key, source="the Dataset")
    if isinstance(dataset, Iterable):
        return _pretokenized(dataset)
    raise ConfigError(
        f"dataset of type {type(dataset).__name__} is not supported. To fix: pass a path, a datasets.Dataset "
        "or an iterable of token tensors."
    )


def _tokenizer_stamp(hf: HFTokenizer | None) -> str:
    """What identifies a model tokenizer's files (a re-saved tokenizer invalidates the corpus cache)."""
    if hf is None:
        return ""
    p = Path(hf.source)
    files = [p] if p.is_file() else sorted(f for f in p.glob("*token*") if f.is_file()) if p.is_dir() else []
    return ";".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files) or hf.source


def _plain(doc: Document) -> str:
    return doc if isinstance(doc, str) else "".join(t for t, _ in TextTokenizer().chat_text(doc))


def _tokenize_docs(
    docs: list[Document], tokenizer: str | HFTokenizer, vocab_size: int, key: str, source: str
) -> TokenizedCorpus:
    docs = [d for d in docs if not isinstance(d, str) or d.strip()]
    if not docs:
        raise ConfigError(f"dataset {source} is empty (no text). To fix: point it at files with text in them.")
    tok: TextTokenizer
    if isinstance(tokenizer, HFTokenizer):
        tok = tokenizer
    elif tokenizer == "bytes":
        tok = _Bytes()
    else:
        path = cache_dir() / "tokenizers" / f"{key}.json"
        if path.is_file():
            from tokenizers import Tokenizer

            tok = _Bpe(Tokenizer.from_file(str(path)), path)
        else:
            log.info("training a byte-level BPE tokenizer (%d ids) on %s", vocab_size, source)
            tok = _Bpe(_train_bpe([_plain(d) for d in docs], vocab_size, path), path)
    parts: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    has_chat = any(not isinstance(d, str) for d in docs)
    for d in docs:
        segments = [(d, True)] if isinstance(d, str) else tok.chat_text(d)
        for text, trained in segments:
            ids = np.asarray(tok.encode(text), dtype=np.int32)
            parts.append(ids)
            masks.append(np.full(ids.size, trained, dtype=np.uint8))
        parts.append(np.array([tok.eot_id], dtype=np.int32))
        masks.append(np.ones(1, dtype=np.uint8))  # the end of a document or a reply is a target: stop there
    tokens = np.concatenate(parts)
    mask = np.concatenate(masks) if has_chat else None
    if mask is not None and not mask.any():
        raise ConfigError(f"dataset {source}: no assistant tokens to train on. To fix: add responses.")
    return TokenizedCorpus(tokens, tok.vocab_size, tok.eot_id, tok.name, mask)


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


IGNORE_INDEX = -100
"""The label of a token that is not a training target (the value the loss ignores)."""


@dataclass(frozen=True)
class PackedDataset:
    """Fixed-length sequences cut from a token array (the remainder that does not fill one is dropped)."""

    tokens: np.ndarray
    """The flat token array."""
    seq_len: int
    """Tokens per sequence."""
    labels: np.ndarray | None = None
    """Per token: the token itself where it is a training target, :data:`IGNORE_INDEX` where not (chat context);
    None: every token is a target."""

    def __post_init__(self) -> None:
        if self.seq_len <= 0:
            raise ConfigError(f"seq_len must be > 0 (got {self.seq_len}).")

    def __len__(self) -> int:
        return int(self.tokens.size // self.seq_len)

    def _rows(self, indices: np.ndarray | list[int]) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64)
        return idx[:, None] * self.seq_len + np.arange(self.seq_len)[None, :]

    def batch(self, indices: np.ndarray | list[int]) -> np.ndarray:
        """Sequences ``indices`` as an int64 array of shape ``[len(indices), seq_len]``."""
        return self.tokens[self._rows(indices)].astype(np.int64)

    def batch_labels(self, indices: np.ndarray | list[int]) -> np.ndarray | None:
        """Labels of sequences ``indices`` (``[len, seq_len]``, -100 where not a target); None without masks."""
        return None if self.labels is None else self.labels[self._rows(indices)].astype(np.int64)

    def num_targets(self, indices: np.ndarray | list[int]) -> int:
        """Tokens the loss of these sequences is taken over (a sequence's first token is never predicted)."""
        if self.labels is None:
            return len(indices) * (self.seq_len - 1)
        lab = self.labels[self._rows(indices)]
        return int((lab[:, 1:] != IGNORE_INDEX).sum())

    def split(self, num_eval: int) -> tuple[PackedDataset, PackedDataset]:
        """``(train, held_out)``: the last ``num_eval`` sequences are held out (contiguous text: no overlap)."""
        n = len(self)
        if not 0 < num_eval < n:
            raise ConfigError(f"cannot hold out {num_eval} of {n} sequences. To fix: lower eval_fraction or add data.")
        cut = (n - num_eval) * self.seq_len

        def part(a: int, b: int) -> PackedDataset:
            return PackedDataset(self.tokens[a:b], self.seq_len, None if self.labels is None else self.labels[a:b])

        return part(0, cut), part(cut, n * self.seq_len)


def pack(corpus: TokenizedCorpus, seq_len: int, min_sequences: int = 1) -> PackedDataset:
    """Pack a corpus into ``seq_len`` sequences; at least ``min_sequences`` of them (else a ConfigError)."""
    labels = None
    if corpus.loss_mask is not None:
        labels = np.where(corpus.loss_mask.astype(bool), corpus.tokens, IGNORE_INDEX).astype(np.int32)
    ds = PackedDataset(corpus.tokens, seq_len, labels)
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
