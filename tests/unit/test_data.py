"""Data: reading corpora, tokenising (bytes, BPE cached), packing, and the deterministic, resumable sampler."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from starverse.errors import ConfigError
from starverse.runtime.data import DeterministicSampler, PackedDataset, pack, tokenize_corpus


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("STARVERSE_CACHE", str(tmp_path / "cache"))


def test_bytes_tokenizer_reads_a_folder_in_order_with_separators(tmp_path):
    d = tmp_path / "texts"
    d.mkdir()
    (d / "b.txt").write_text("hé")
    (d / "a.md").write_text("ab")
    (d / "skip.bin").write_bytes(b"\x00\x01")
    c = tokenize_corpus(d, tokenizer="bytes")
    assert c.tokens.tolist() == [97, 98, 256, 104, 0xC3, 0xA9, 256]
    assert (c.vocab_size, c.eot_id, c.tokenizer) == (257, 256, "bytes")


def test_jsonl_text_field_and_its_errors(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"text": "xy"}) + "\n\n" + json.dumps({"text": "z", "id": 3}) + "\n")
    assert tokenize_corpus(f, tokenizer="bytes").tokens.tolist() == [120, 121, 256, 122, 256]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl:1: each .jsonl line needs a 'text' field"):
        tokenize_corpus(bad, tokenizer="bytes")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "a"}\n{oops\n')
    with pytest.raises(ConfigError, match=r"broken.jsonl:2: malformed JSON line"):
        tokenize_corpus(broken, tokenizer="bytes")


def test_missing_and_empty_datasets_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"dataset '.*nope' does not exist\. To fix: pass a text file"):
        tokenize_corpus(tmp_path / "nope")
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(ConfigError, match=r"holds no text files"):
        tokenize_corpus(empty_dir)
    blank = tmp_path / "blank.txt"
    blank.write_text("  \n\n")
    with pytest.raises(ConfigError, match=r"dataset .*blank.txt is empty \(no text\)"):
        tokenize_corpus(blank)
    with pytest.raises(ConfigError, match=r"no dataset given"):
        tokenize_corpus(None)
    with pytest.raises(ConfigError, match=r"dataset is empty \(the iterable gave no tokens\)"):
        tokenize_corpus([])
    with pytest.raises(ConfigError, match=r"dataset item 0 has dtype float32"):
        tokenize_corpus([torch.zeros(3)])


def test_pretokenized_iterable_is_concatenated():
    c = tokenize_corpus([torch.tensor([3, 4]), [5], np.array([[1, 2]])])
    assert c.tokens.tolist() == [3, 4, 5, 1, 2]
    assert c.vocab_size == 6 and c.tokenizer == "pretokenized"


def test_bpe_is_trained_on_the_corpus_cached_and_decodes_back(tmp_path):
    from tokenizers import Tokenizer

    f = tmp_path / "code.py"
    text = "def add(a, b):\n    return a + b\n" * 200
    f.write_text(text)
    c = tokenize_corpus(f, tokenizer="bpe", vocab_size=300)
    assert c.tokenizer.startswith("bpe:") and c.vocab_size <= 300
    tok = Tokenizer.from_file(c.tokenizer[4:])
    ids = c.tokens.tolist()
    assert ids[-1] == c.eot_id
    assert tok.decode(ids[:-1]) == text
    assert len(ids) < len(text) / 2  # merges learned from this corpus compress it (bytes would be 1:1)
    again = tokenize_corpus(f, tokenizer="bpe", vocab_size=300)  # from the cache
    assert np.array_equal(again.tokens, c.tokens)
    assert len(list((tmp_path / "cache" / "corpora").glob("*.npz"))) == 1


def test_pack_cuts_equal_sequences_and_needs_one_step(tmp_path):
    c = tokenize_corpus([torch.arange(25)])
    ds = pack(c, seq_len=4, min_sequences=6)
    assert len(ds) == 6
    assert ds.batch([5, 0]).tolist() == [[20, 21, 22, 23], [0, 1, 2, 3]]
    with pytest.raises(ConfigError, match=r"25 tokens: 3 sequences of 8, fewer than the 4 one step needs"):
        pack(c, seq_len=8, min_sequences=4)
    with pytest.raises(ConfigError, match=r"seq_len must be > 0"):
        PackedDataset(c.tokens, 0)


def test_sampler_is_deterministic_covers_each_epoch_and_resumes_exactly():
    a = DeterministicSampler(10, seed=3)
    first = a.next_indices(7)
    second = a.next_indices(7)  # crosses into epoch 1
    assert sorted(first.tolist() + second[:3].tolist()) == list(range(10))
    assert a.state_dict() == {"seed": 3, "epoch": 1, "position": 4, "num_sequences": 10}
    b = DeterministicSampler(10, seed=3)
    assert b.next_indices(14).tolist() == first.tolist() + second.tolist()
    saved = a.state_dict()
    cont = a.next_indices(9).tolist()
    c = DeterministicSampler(10, seed=0)
    c.load_state_dict(saved)
    assert c.next_indices(9).tolist() == cont
    assert DeterministicSampler(10, seed=4).next_indices(10).tolist() != DeterministicSampler(10, seed=3).next_indices(10).tolist()
    with pytest.raises(ConfigError, match=r"saved data position is for 10 sequences, this dataset has 12"):
        DeterministicSampler(12).load_state_dict(saved)


class _FakeDataset:
    """Duck-typed like datasets.Dataset: column_names and column access."""

    def __init__(self, rows):
        self.rows = rows
        self.column_names = list(rows[0])

    def __getitem__(self, key):
        return [r[key] for r in self.rows]


def test_hf_style_dataset_text_column():
    c = tokenize_corpus(_FakeDataset([{"text": "ab", "n": 1}, {"text": "c", "n": 2}]), tokenizer="bytes")
    assert c.tokens.tolist() == [97, 98, 256, 99, 256]
    with pytest.raises(ConfigError, match=r"the Dataset has no 'text' column \(columns: body\)"):
        tokenize_corpus(_FakeDataset([{"body": "x"}]))
