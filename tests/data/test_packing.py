"""Splits by content hash, the seeded shuffle, and packing into rows with boundaries kept."""

from __future__ import annotations

import hashlib

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from megacpp.data.packing import (
    TRAIN,
    VALIDATION,
    PackedDocument,
    RowPacker,
    shuffle_key,
    split_of,
    with_bos_eos,
)

PAD = 0


def sha(i: int) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()


def test_split_by_hash_is_stable_and_proportional():
    hashes = [sha(i) for i in range(20000)]
    splits = [split_of(h, 50) for h in hashes]
    share = splits.count(VALIDATION) / len(splits)
    assert 0.04 < share < 0.06
    # a document's split depends on its own hash only: a bigger corpus keeps old decisions
    assert [split_of(h, 50) for h in hashes[:100]] == splits[:100]
    assert {split_of(h, 0) for h in hashes} == {TRAIN}
    assert {split_of(h, 1000) for h in hashes} == {VALIDATION}


def test_shuffle_is_seeded():
    hashes = [sha(i) for i in range(50)]
    order = sorted(hashes, key=lambda h: shuffle_key(h, 1))
    assert order == sorted(hashes, key=lambda h: shuffle_key(h, 1))
    assert order != sorted(hashes, key=lambda h: shuffle_key(h, 2))
    assert order != hashes and sorted(order) == sorted(hashes)


def test_with_bos_eos():
    tokens, structure = with_bos_eos(np.array([5, 6], np.int32), np.array([2, 7], np.uint8), 1, 2)
    assert tokens.tolist() == [1, 5, 6, 2]
    assert structure.tolist() == [0, 2, 7, 0]


def make_docs(lengths: list[int]) -> list[PackedDocument]:
    docs, next_token = [], 10
    for i, n in enumerate(lengths):
        tokens = np.arange(next_token, next_token + n, dtype=np.int32)
        docs.append(PackedDocument(i, f"d{i}.h", sha(i), tokens, (tokens % 9).astype(np.uint8)))
        next_token += n
    return docs


def pack(docs: list[PackedDocument], row_len: int):
    packer = RowPacker(row_len, PAD)
    rows = [row for d in docs for row in packer.add(d)] + list(packer.finish())
    return packer, rows


def test_long_document_continues_across_rows():
    packer, rows = pack(make_docs([3, 12, 2]), row_len=5)  # 17 tokens -> 4 rows (last padded)
    assert len(rows) == 4 and packer.rows_out == 4
    assert [r.num_tokens for r in rows] == [5, 5, 5, 2]
    assert rows[0].doc_starts == [0, 3]
    assert [(s.doc_index, s.token_start, s.token_count) for s in rows[0].segments] == [
        (0, 0, 3),
        (1, 0, 2),
    ]
    assert [(s.doc_index, s.token_start, s.token_count) for s in rows[1].segments] == [(1, 2, 5)]
    assert [(s.doc_index, s.token_start, s.token_count) for s in rows[2].segments] == [(1, 7, 5)]
    assert [(s.doc_index, s.token_start) for s in rows[3].segments] == [(2, 0)]
    assert rows[3].tokens[2:].tolist() == [PAD] * 3
    assert packer.split_documents == 1  # document 1 continued into following rows


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=0, max_size=30), st.integers(2, 33))
def test_packing_keeps_every_token_and_boundary(lengths, row_len):
    docs = make_docs(lengths)
    _, rows = pack(docs, row_len)
    assert all(len(r.tokens) == row_len and len(r.structure_ids) == row_len for r in rows)
    assert all(r.num_tokens == row_len for r in rows[:-1])
    stream = np.concatenate([r.tokens[: r.num_tokens] for r in rows] + [np.zeros(0, np.int32)])
    expected = np.concatenate([d.tokens for d in docs] + [np.zeros(0, np.int32)])
    assert np.array_equal(stream, expected)
    structure = np.concatenate([r.structure_ids[: r.num_tokens] for r in rows] + [np.zeros(0)])
    assert np.array_equal(structure, expected % 9)
    for r in rows:
        assert r.doc_starts[0] == 0 and r.doc_starts == sorted(set(r.doc_starts))
        ends = r.doc_starts[1:] + [r.num_tokens]
        assert [e - s for s, e in zip(r.doc_starts, ends)] == [s.token_count for s in r.segments]
        for seg, start in zip(r.segments, r.doc_starts):
            doc = docs[seg.doc_index]
            piece = doc.tokens[seg.token_start : seg.token_start + seg.token_count]
            assert np.array_equal(r.tokens[start : start + seg.token_count], piece)
