"""Megatron export: the real megatron-core IndexedDataset reads back identical documents."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from megacpp.data.megatron import export_megatron, megatron_dtype
from megacpp.data.shards import ShardedDataset
from tests.data.packed_fixtures import build_tiny


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[ShardedDataset, Path, list[dict]]:
    tmp = tmp_path_factory.mktemp("megatron")
    ds = ShardedDataset.open(build_tiny(tmp))
    written = export_megatron(ds, tmp / "mega" / "cpp")
    return ds, tmp / "mega" / "cpp", written


def test_megatron_core_reads_identical_documents(exported):
    indexed_dataset = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    ds, prefix, written = exported
    assert {w["split"] for w in written} == {"train", "validation"}
    tok = ds.tokenizer()
    docs = pq.read_table(ds.root / "documents.parquet").to_pylist()
    for split in ("train", "validation"):
        mega = indexed_dataset.IndexedDataset(f"{prefix}_{split}")
        expected = [d for d in docs if d["split"] == split]
        assert len(mega) == len(expected)
        assert mega.document_indices.tolist() == list(range(len(expected) + 1))
        for i, doc in enumerate(expected):
            tokens = mega[i]
            assert tokens.dtype == megatron_dtype(tok.vocab_size)
            want = np.concatenate([[tok.bos_id], tok.encode(doc["text"]), [tok.eos_id]])
            assert np.array_equal(tokens.astype(np.int64), want)
            assert tok.decode(tokens) == doc["text"]


def test_written_summary(exported):
    ds, _, written = exported
    train = next(w for w in written if w["split"] == "train")
    assert train["documents"] == ds.manifest["splits"]["train"]["documents"]
    assert train["tokens"] == ds.manifest["splits"]["train"]["tokens"]
