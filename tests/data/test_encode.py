"""The build's per-document work and the fast paths added for speed produce exactly what the
straightforward paths produce: the one-task encode (tokenizer given) equals tokenize + label
runs (tokenizer trained), the piece cache gives HF's ids whatever the batching or cache
resets, and shard rows' provenance column equals the per-segment-dict one."""

from __future__ import annotations

import dataclasses
import hashlib
import random
from concurrent.futures import Executor, Future
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from tokenizers import Tokenizer

from megacpp.data import tokenizer as tokenizer_module
from megacpp.data.build import BuildConfig, StructureConfig, _StructureJobs, build_dataset
from megacpp.data.document import Document
from megacpp.data.encode import (
    STRUCTURE_DISABLED,
    EncodedDoc,
    encode_chunk,
    structure_chunk,
    tokenize_chunk,
)
from megacpp.data.native import native_library, native_status
from megacpp.data.packing import PackedDocument, RowPacker
from megacpp.data.shards import SEGMENT_TYPE, _segments_array
from megacpp.data.tokenizer import CppTokenizer, train_tokenizer
from tests.data.packed_fixtures import SYNTHETIC, real_texts, tiny_config_dict, write_corpus

TEXTS_EXTRA = ["", "x <|eos|> y", "\r\r\n\x0b  \t\n", "int main() { return 0; }\n"]


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return real_texts() + list(SYNTHETIC.values()) + TEXTS_EXTRA


@pytest.fixture(scope="module")
def tok_file(tmp_path_factory, texts) -> str:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    CppTokenizer.from_hf(train_tokenizer(texts, 512)).save(path)
    return str(path)


def _hf_ids(tok_file: str, texts: list[str]) -> list[list[int]]:
    hf = Tokenizer.from_file(tok_file)
    hf.encode_special_tokens = True
    return [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]


def test_encode_chunk_equals_tokenize_then_map_runs(texts, tok_file):
    tok = CppTokenizer.load(tok_file)
    one_task = encode_chunk(texts, tok_file, 5.0)
    runs = structure_chunk(texts, 5.0)
    two_tasks = [
        EncodedDoc.from_runs(ids, r, tok.token_nbytes)
        for ids, r in zip(tokenize_chunk(texts, tok_file), runs)
    ]
    assert [d.outcome for d in one_task] == [d.outcome for d in two_tasks]
    for a, b in zip(one_task, two_tasks):
        assert a.ids.tolist() == b.ids.tolist()
        assert a.structure_ids.dtype == b.structure_ids.dtype == np.uint8
        assert a.structure_ids.tolist() == b.structure_ids.tolist()
    assert any(d.structure_ids.any() for d in one_task)  # real labels, not all OTHER


def test_encode_chunk_with_structure_disabled(texts, tok_file):
    for doc in encode_chunk(texts, tok_file, 5.0, enabled=False):
        assert doc.outcome == STRUCTURE_DISABLED
        assert doc.structure_ids.shape == doc.ids.shape and not doc.structure_ids.any()


def _load(tok_file, native: bool) -> CppTokenizer:
    tok = CppTokenizer.load(tok_file)
    if not native:
        tok._native = None  # the pure-Python path (what MEGACPP_NATIVE=0 or no g++ gives)
    return tok


def _cached_pieces(tok: CppTokenizer) -> int:
    return len(tok._native[0]) if tok._native else len(tok._pieces._row_of)


@pytest.mark.parametrize("native", [True, False])
def test_piece_cache_any_batching_and_resets_equal_hf(texts, tok_file, monkeypatch, native):
    if native and native_library() is None:
        pytest.skip(native_status())
    expected = _hf_ids(tok_file, texts)
    tok = _load(tok_file, native)
    one_by_one = [tok.encode(t).tolist() for t in reversed(texts)][::-1]  # warm cache, new order
    assert one_by_one == expected
    monkeypatch.setattr(tokenizer_module, "_PIECE_CACHE_LIMIT", 50)  # clears between batches
    small = _load(tok_file, native)
    for start in range(0, len(texts), 3):
        batch = texts[start : start + 3]
        assert [ids.tolist() for ids in small.encode_batch(batch)] == expected[start : start + 3]
    distinct = {p for t in texts for p in tokenizer_module._PIECE_RE.findall(t)}
    assert 0 < _cached_pieces(small) < len(distinct)  # the cache was cleared on the way


def test_segments_column_equals_per_segment_dicts():
    packer = RowPacker(16, pad_id=0)
    rows = []
    for i, n in enumerate([5, 30, 1, 12, 40]):
        doc = PackedDocument(
            i, f"d{i}.h", f"{i:064x}", np.arange(n, dtype=np.int32), np.zeros(n, np.uint8)
        )
        rows += list(packer.add(doc))
    rows += list(packer.finish())
    reference = pa.array(
        [[dataclasses.asdict(s) for s in r.segments] for r in rows], type=pa.list_(SEGMENT_TYPE)
    )
    assert _segments_array(rows).equals(reference)


def _file_digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_given_tokenizer_build_equals_trained_build(tmp_path):
    """The one-task path (tokenizer given, 2 workers) writes the same bytes, file for file,
    as the two-task path (tokenizer trained in the build, inline)."""
    sources = write_corpus(tmp_path / "src")
    cfg = BuildConfig.from_dict(tiny_config_dict())
    trained = build_dataset([sources], tmp_path / "trained", cfg, workers=1).out
    given = build_dataset(
        [sources], tmp_path / "given", cfg, tokenizer_path=trained / "tokenizer.json", workers=2
    ).out
    assert _file_digests(given) == _file_digests(trained)


class _ManualExecutor(Executor):
    """Tasks wait until :meth:`run` (so a test decides which chunks a worker has started)."""

    def __init__(self) -> None:
        self.tasks: list[tuple[Future, list[str]]] = []
        self._calls: dict[int, tuple] = {}

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        self.tasks.append((future, args[0]))
        self._calls[id(future)] = (fn, args, kwargs)
        return future

    def run(self, future: Future) -> None:
        fn, args, kwargs = self._calls.pop(id(future))
        if future.set_running_or_notify_cancel():
            future.set_result(fn(*args, **kwargs))


def test_prioritize_resubmits_unstarted_chunks_in_packing_order(texts, tok_file):
    """Chunks no worker started are cancelled and their documents resubmitted in the order
    packing needs them; started and finished chunks stay; every document's result equals
    encoding it alone."""
    from rich.progress import Progress

    docs = [
        Document("/s", f"d{i}.h", len(t.encode()), f"{i:064x}", text=t) for i, t in enumerate(texts)
    ]
    pool = _ManualExecutor()
    jobs = _StructureJobs(pool, StructureConfig(), Progress(disable=True), Path(tok_file))
    for start in range(0, len(docs), 3):
        jobs.submit(docs[start : start + 3])
    first, second, third = (future for future, _ in pool.tasks[:3])
    pool.run(first)  # finished
    assert second.set_running_or_notify_cancel()  # a worker is on it
    order = docs[:]
    random.Random(0).shuffle(order)
    submitted = len(pool.tasks)
    moved = jobs.prioritize(order)
    assert moved == len(docs) - 6 > 0
    assert third.cancelled()
    resubmitted = [text for _, chunk in pool.tasks[submitted:] for text in chunk]
    assert resubmitted == [d.text for d in order if d not in docs[:6]]
    second.set_result(encode_chunk([d.text for d in docs[3:6]], tok_file, 5.0))
    for future, _ in pool.tasks:
        if not future.done():
            pool.run(future)
    for doc in docs:
        (alone,) = encode_chunk([doc.text], tok_file, 5.0)
        got = jobs.encoded(doc)
        assert got.ids.tolist() == alone.ids.tolist(), doc.rel_path
        assert got.structure_ids.tolist() == alone.structure_ids.tolist()
        assert got.outcome == alone.outcome
