"""The training loader: the sample contract (labels never cross documents), byte-exact round
trip, disjoint/covering split across ranks and workers, determinism, exact resume."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from megacpp.data.loader import IGNORE_INDEX, PackedLoader, PackedRowsDataset, sample_from_row
from megacpp.data.shards import ShardedDataset
from megacpp.errors import MegaCppError
from tests.data.packed_fixtures import build_tiny

BOS, EOS, PAD = 1, 2, 0


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("loader"))


@pytest.fixture(scope="module")
def dataset(dataset_dir) -> ShardedDataset:
    return ShardedDataset.open(dataset_dir)


def test_sample_masks_document_boundaries_and_padding():
    tokens = np.array([BOS, 11, 12, EOS, BOS, 13, 14, EOS, PAD, PAD], dtype=np.int32)
    sample = sample_from_row(tokens, np.arange(10, dtype=np.uint8), np.array([0, 4]), 8)
    assert sample["input_ids"].tolist() == tokens[:-1].tolist()
    assert sample["labels"].tolist() == [11, 12, EOS, -100, 13, 14, EOS, -100, -100]
    assert sample["doc_ids"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2]
    assert sample["structure_ids"].tolist() == list(range(9))


def test_sample_of_a_continued_document():
    tokens = np.array([21, 22, EOS, BOS, 23], dtype=np.int32)  # tail of one doc, head of next
    sample = sample_from_row(tokens, np.zeros(5, np.uint8), np.array([0, 3]), 5)
    assert sample["labels"].tolist() == [22, EOS, -100, 23]
    assert sample["doc_ids"].tolist() == [0, 0, 0, 1]


def _all_samples(loader) -> list[dict[str, torch.Tensor]]:
    out = []
    for batch in loader:
        for i in range(len(batch["row"])):
            out.append({k: v[i] for k, v in batch.items()})
    return out


def test_batches_follow_the_contract(dataset):
    loader = PackedLoader(dataset, batch_size=4, seed=3)
    batch = next(iter(loader))
    seq_len = dataset.seq_len
    for key in ("input_ids", "labels", "doc_ids", "structure_ids"):
        assert batch[key].dtype == torch.int64 and batch[key].shape == (4, seq_len)
    for s in _all_samples(loader):
        ids, labels, docs = s["input_ids"], s["labels"], s["doc_ids"]
        assert docs[0] == 0 and bool((docs[1:] - docs[:-1] >= 0).all())
        assert bool((docs[1:] - docs[:-1] <= 1).all())
        same_doc = docs[1:] == docs[:-1]
        kept = labels[:-1] != IGNORE_INDEX
        assert bool((~same_doc & kept).sum() == 0)  # never across a document boundary
        assert bool((labels[:-1][kept] == ids[1:][kept]).all())  # labels are the next tokens
        starts = ids[1:][docs[1:] != docs[:-1]]
        assert set(starts.tolist()) <= {BOS, PAD}  # a document (or the padding) begins
        if PAD in starts.tolist():  # padding only at the end of the split's last row
            assert bool((ids[docs == docs[-1]] == PAD).all())


def test_round_trip_documents_shards_loader_text(dataset, dataset_dir):
    """documents -> shards -> loader -> detokenize == the source files, byte for byte."""
    tok = dataset.tokenizer()
    loader = PackedLoader(dataset, "train", batch_size=3, shuffle=False)
    stream = []
    for s in _all_samples(loader):
        stream += s["input_ids"].tolist()
        if s["labels"][-1] != IGNORE_INDEX:  # the row's last token, if it is text
            stream.append(int(s["labels"][-1]))
    stream = [t for t in stream if t not in (BOS, PAD)]
    pieces = np.split(np.array(stream), np.flatnonzero(np.array(stream) == EOS) + 1)
    texts = [tok.decode(p) for p in pieces if len(p)]
    docs = pq.read_table(dataset_dir / "documents.parquet").to_pylist()
    train_docs = [d for d in docs if d["split"] == "train"]
    assert len(texts) == len(train_docs) > 5
    for text, doc in zip(texts, train_docs):
        source = (Path(doc["source_root"]) / doc["rel_path"]).read_bytes()
        assert text == doc["text"]
        assert text.encode("utf-8") == source


def test_ranks_and_workers_are_disjoint_and_cover(dataset):
    n = dataset.num_rows("train")
    seen = []
    orders = {}
    for rank in range(2):
        for workers in (0, 2):
            loader = PackedLoader(
                dataset, batch_size=2, seed=5, rank=rank, world_size=2, num_workers=workers
            )
            rows = [int(r) for b in loader for r in b["row"]]
            orders[(rank, workers)] = rows
        assert orders[(rank, 0)] == orders[(rank, 2)]  # same order with any worker count
        seen += orders[(rank, 0)]
    assert sorted(seen) == list(range(n))


def test_order_is_deterministic_per_seed_and_epoch(dataset):
    rows = PackedRowsDataset(dataset, seed=1)
    assert np.array_equal(rows.rank_rows(0), PackedRowsDataset(dataset, seed=1).rank_rows(0))
    assert not np.array_equal(rows.rank_rows(0), rows.rank_rows(1))
    assert not np.array_equal(rows.rank_rows(0), PackedRowsDataset(dataset, seed=2).rank_rows(0))
    assert sorted(rows.rank_rows(1).tolist()) == list(range(dataset.num_rows("train")))


def test_resume_continues_exactly(dataset):
    full = PackedLoader(dataset, batch_size=2, seed=9)
    epoch0 = [int(r) for b in full for r in b["row"]]
    epoch1 = [int(r) for b in full for r in b["row"]]
    assert full.state_dict()["epoch"] == 2 and sorted(epoch0) == sorted(epoch1)

    first = PackedLoader(dataset, batch_size=2, seed=9)
    it = iter(first)
    head = [int(r) for _, b in zip(range(3), it) for r in b["row"]]
    state = first.state_dict()
    assert (state["epoch"], state["sample_in_epoch"]) == (0, 6)

    resumed = PackedLoader(dataset, batch_size=2, seed=9, num_workers=2)
    resumed.load_state_dict(state)
    tail = [int(r) for b in resumed for r in b["row"]]
    assert head + tail == epoch0
    assert [int(r) for b in resumed for r in b["row"]] == epoch1


def test_resume_continues_on_another_world_size_at_the_global_sample(dataset):
    """Two ranks of 2 rows and one rank of 4 consume the same rows per batch: a position written
    by either continues on the other (and with an older per-rank batch count)."""
    order = [int(r) for b in PackedLoader(dataset, batch_size=4, seed=9) for r in b["row"]]
    two = [PackedLoader(dataset, batch_size=2, seed=9, rank=r, world_size=2) for r in range(2)]
    iters = [iter(loader) for loader in two]
    head = [int(r) for _ in range(3) for it in iters for r in next(it)["row"]]
    assert sorted(head) == sorted(order[:12])
    state = two[1].state_dict()
    assert state["sample_in_epoch"] == 12 and state == {**two[0].state_dict(), "rank": 1}
    one = PackedLoader(dataset, batch_size=4, seed=9)
    one.load_state_dict(state)
    assert [int(r) for b in one for r in b["row"]] == order[12:]

    legacy = {**state, "batch_in_epoch": 3}  # a per-rank batch count, as older loaders wrote
    del legacy["sample_in_epoch"]
    one.load_state_dict(legacy)
    assert one.state_dict()["sample_in_epoch"] == 12


def test_resume_refuses_another_order(dataset):
    state = PackedLoader(dataset, batch_size=2, seed=9).state_dict()
    with pytest.raises(MegaCppError, match="seed was 9"):
        PackedLoader(dataset, batch_size=2, seed=3).load_state_dict(state)
    with pytest.raises(MegaCppError, match="shuffle"):
        PackedLoader(dataset, batch_size=2, seed=9, shuffle=False).load_state_dict(state)


def test_step_samples_end_every_rank_at_the_same_whole_step(dataset):
    n = dataset.num_rows("train")
    per_rank = [[len(b["row"]) for b in PackedLoader(dataset, batch_size=3, seed=1, rank=r,
                                                     world_size=2, step_samples=12)]
                for r in range(2)]
    assert per_rank[0] == per_rank[1] == [3] * (n // 12 * 2)


def test_loader_refuses_corrupt_dataset(dataset_dir, tmp_path):
    import shutil

    copy = Path(shutil.copytree(dataset_dir, tmp_path / "copy"))
    shard = max((copy / "train").glob("*.parquet"))
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(MegaCppError, match=shard.name):
        PackedLoader(copy, batch_size=2)


def test_bad_rank(dataset):
    with pytest.raises(MegaCppError, match="rank 2 is outside world_size 2"):
        PackedRowsDataset(dataset, rank=2, world_size=2)
