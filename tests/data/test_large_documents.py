"""Huge documents cost bounded memory: the build works on them a part or a window at a time,
and every such shortcut gives the result of the whole-text computation (tested here on small
texts with small parts), so nothing about ordinary documents changes.

The memory itself is measured by a command, not a test: a 50 MB one-line file through
``megacpp data build`` under ``/usr/bin/time -v`` (docs/data.md gives the numbers)."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest

from megacpp.data import dedup, tokenizer
from megacpp.data.build import BuildConfig, build_dataset
from megacpp.data.shards import ShardedDataset
from megacpp.data.structure import MAX_PARSE_BYTES, PARSE_TOO_LARGE
from megacpp.data.tokenizer import CppTokenizer, split_at_piece_ends, train_tokenizer
from tests.data.packed_fixtures import SYNTHETIC

# text pieces that meet every alternative of the pre-tokenizer pattern and every kind of cut
ATOMS = ["int", " ", "  ", "\n", "\t", "x1", "(", ")", "::", "é", "\r\n", "42", "->", "_a",
         "\u2028", "\x00", "    ", "\r", "\n\n  ", "✓✓", "<|eos|>"]


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(ATOMS) for _ in range(n))


@pytest.fixture(scope="module")
def tok() -> CppTokenizer:
    return CppTokenizer.from_hf(train_tokenizer(list(SYNTHETIC.values()) * 4, 300))


def test_parts_cut_where_pieces_end_so_ids_are_those_of_the_whole(tok):
    rng = random.Random(0)
    for _ in range(300):
        text, size = random_text(rng, rng.randint(0, 300)), rng.randint(1, 40)
        parts = split_at_piece_ends(text, size)
        assert "".join(parts) == text and all(parts[:-1])
        if any(len(p) >= 4 * size for p in parts[:-1]):
            continue  # cut hard: no piece ended within 4 x size characters
        whole = tok.encode(text).tolist()  # one pass (equal to HF's, tests/data/test_tokenizer)
        assert np.concatenate([tok.encode(p) for p in parts]).tolist() == whole


def test_a_large_batch_is_encoded_a_part_at_a_time_with_the_same_ids(tok, monkeypatch):
    rng = random.Random(1)
    texts = [random_text(rng, rng.randint(0, 400)) for _ in range(20)]
    expected = [tok.encode(t).tolist() for t in texts]  # one pass each
    monkeypatch.setattr(tokenizer, "_BATCH_CHARS", 50)
    monkeypatch.setattr(tokenizer, "PART_CHARS", 16)
    assert [ids.tolist() for ids in tok.encode_batch(texts)] == expected


def test_training_on_parts_learns_the_same_tokenizer(monkeypatch):
    texts = ["\n".join(SYNTHETIC.values()) * 3, *SYNTHETIC.values()]
    whole = train_tokenizer(texts, 320).to_str()
    monkeypatch.setattr(tokenizer, "PART_CHARS", 97)
    assert train_tokenizer(texts, 320).to_str() == whole


def test_the_streamed_normalized_digest_equals_the_whole_text_one(monkeypatch):
    def whole(text: str) -> bytes:
        return hashlib.sha256(b" ".join(text.encode("utf-8", "surrogatepass").split())).digest()

    monkeypatch.setattr(dedup, "_DIGEST_CHUNK", 7)
    rng = random.Random(2)
    alphabet = " \t\n\r\x0b\x0cab\xe9\u2028\x1c\x85"
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        assert dedup.normalized_text_digest(text) == whole(text), repr(text)


def test_windowed_shingles_equal_the_whole_source_ones(monkeypatch):
    rng = random.Random(3)
    lines = ["int x = 1;", "for (int i = 0; i < n; ++i) { s += v[i]; }", "return y;",
             "// comment", "std::vector<int> v;", "", "  a->b = c::d(e, f);"]
    for _ in range(100):
        source = "\n".join(rng.choice(lines) for _ in range(rng.randint(1, 200))).encode()
        size = rng.randint(1, 7)
        expected = dedup.shingle_hashes(source, size)
        monkeypatch.setattr(dedup, "WINDOW_BYTES", rng.randint(50, 400))  # > the longest line
        hashes, offsets = dedup.shingle_hashes_batch([b"int a; int b;", source], size)
        monkeypatch.undo()
        assert np.array_equal(hashes[offsets[1]:offsets[2]], expected)


def test_a_large_one_line_document_builds(tmp_path, tok):
    """A ~5 MB file on one line, let through by the filters, goes through every stage of a
    real build: it is too large to parse (structure all OTHER), near-dedup hashes it a
    window at a time, the tokenizer encodes it a part at a time."""
    rng = random.Random(4)
    words = ["int", "x", "=", "value", "(", ")", "{", "}", ";", "std::vector<int>", "+", "42"]
    line = " ".join(rng.choice(words) for _ in range(MAX_PARSE_BYTES // 3))
    assert len(line) > MAX_PARSE_BYTES and len(line) > dedup.WINDOW_BYTES
    src = tmp_path / "src"
    src.mkdir()
    (src / "huge.cpp").write_text(line + "\n")
    for name, text in SYNTHETIC.items():
        (src / name.replace("/", "_")).write_text(text)
    cfg = BuildConfig.from_dict({
        "corpus": {"max_bytes": 8 << 20, "max_line_length": 8 << 20,
                   "max_mean_line_length": 8 << 20},
        "packing": {"seq_len": 256, "val_permille": 0, "rows_per_shard": 4096},
    })
    tok_file = tok.save(tmp_path / "tokenizer.json")
    build_dataset([src], tmp_path / "ds", cfg, tokenizer_path=tok_file, workers=1)
    ds = ShardedDataset.open(tmp_path / "ds", verify=True)
    structure = next(s for s in ds.manifest["stages"] if s["name"] == "structure")
    assert structure["notes"][PARSE_TOO_LARGE] == 1
    docs = ds.documents(["rel_path", "num_tokens"]).to_pylist()
    huge = next(d for d in docs if d["rel_path"] == "huge.cpp")
    assert huge["num_tokens"] == len(tok.encode(line + "\n"))
