"""Shards, manifest and completion marker as written by a real build; the reader refuses
corrupt, truncated, markerless and wrong-version datasets with a clear error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from megacpp._io import sha256_file
from megacpp.data.build import BuildConfig, build_dataset
from megacpp.data.packing import SPLITS, PackedDocument, RowPacker
from megacpp.data.shards import (
    MANIFEST,
    MARKER,
    SCHEMA_VERSION,
    DocumentsWriter,
    ShardedDataset,
    ShardWriter,
    WriteBehind,
)
from megacpp.errors import MegaCppError
from tests.data.packed_fixtures import build_tiny, tiny_config_dict, write_corpus


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("shards"))


@pytest.fixture
def damaged(dataset_dir, tmp_path) -> Path:
    """A private copy of the dataset to damage."""
    return Path(shutil.copytree(dataset_dir, tmp_path / "copy"))


def test_layout_and_manifest(dataset_dir):
    manifest = json.loads((dataset_dir / MANIFEST).read_text())
    assert (dataset_dir / MARKER).read_text().strip() == sha256_file(dataset_dir / MANIFEST)
    assert manifest["schema_version"] == SCHEMA_VERSION
    assert manifest["tokenizer"]["sha256"] == sha256_file(dataset_dir / "tokenizer.json")
    assert manifest["documents"]["sha256"] == sha256_file(dataset_dir / "documents.parquet")
    assert BuildConfig.from_dict(manifest["config"]).to_dict() == manifest["config"]
    assert manifest["config"]["packing"] == tiny_config_dict()["packing"]
    stage_names = [s["name"] for s in manifest["stages"]]
    assert stage_names[0] == "sources" and stage_names[-5:] == [
        "split",
        "tokenize",
        "structure",
        "fim",
        "pack",
    ]
    train = manifest["splits"]["train"]
    assert len(train["shards"]) >= 2  # rows_per_shard=16 in the tiny config
    for split in SPLITS:
        shards = manifest["splits"][split]["shards"]
        assert sum(s["rows"] for s in shards) == manifest["splits"][split]["rows"]
        assert sum(s["tokens"] for s in shards) == manifest["splits"][split]["tokens"]
        for shard in shards:
            assert sha256_file(dataset_dir / shard["file"]) == shard["sha256"]
    documents = pq.read_table(dataset_dir / "documents.parquet")
    assert documents.num_rows == manifest["documents"]["count"]
    assert documents["doc_index"].to_pylist() == list(range(documents.num_rows))


def test_reader_blocks_are_in_row_order(dataset_dir):
    ds = ShardedDataset.open(dataset_dir)
    rows = []
    for block in ds.iter_blocks("train"):
        assert block.tokens.shape == (len(block.rows), ds.row_len)
        assert block.structure_ids.shape == block.tokens.shape
        assert block.structure_ids.max() < ds.manifest["num_structure_ids"]
        assert all(len(s) == len(d) for s, d in zip(block.segments, block.doc_starts))
        rows += block.rows.tolist()
    assert rows == list(range(ds.num_rows("train")))
    groups = ds.row_groups("train")
    assert all(n <= 4 for _, _, n in groups) and len(groups) >= 4  # rows_per_group=4


def test_build_is_deterministic(dataset_dir, tmp_path):
    again = build_tiny(tmp_path)
    first = json.loads((dataset_dir / MANIFEST).read_text())
    second = json.loads((again / MANIFEST).read_text())
    for split in SPLITS:
        assert [s["sha256"] for s in first["splits"][split]["shards"]] == [
            s["sha256"] for s in second["splits"][split]["shards"]
        ]


def _first_shard(root: Path) -> Path:
    return min((root / "train").glob("shard-*.parquet"))


def test_flipped_byte_is_refused(damaged):
    shard = _first_shard(damaged)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(MegaCppError, match=rf"{shard.name} is corrupt: sha256"):
        ShardedDataset.open(damaged)


def test_truncated_shard_is_refused(damaged):
    shard = _first_shard(damaged)
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(MegaCppError, match=rf"{shard.name} is corrupt"):
        ShardedDataset.open(damaged)


def test_missing_shard_is_refused(damaged):
    shard = _first_shard(damaged)
    shard.unlink()
    with pytest.raises(MegaCppError, match=rf"{shard.name} is missing"):
        ShardedDataset.open(damaged)


def test_missing_marker_is_refused(damaged):
    (damaged / MARKER).unlink()
    with pytest.raises(MegaCppError, match="has no _COMPLETE marker"):
        ShardedDataset.open(damaged, verify=False)


def test_edited_manifest_is_refused(damaged):
    manifest = json.loads((damaged / MANIFEST).read_text())
    manifest["splits"]["train"]["rows"] += 1
    (damaged / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(MegaCppError, match="does not match its _COMPLETE marker"):
        ShardedDataset.open(damaged, verify=False)


def test_wrong_schema_version_is_refused(damaged):
    manifest = json.loads((damaged / MANIFEST).read_text())
    manifest["schema_version"] = SCHEMA_VERSION + 1
    (damaged / MANIFEST).write_text(json.dumps(manifest))
    (damaged / MARKER).write_text(sha256_file(damaged / MANIFEST) + "\n")
    with pytest.raises(MegaCppError, match=f"schema version {SCHEMA_VERSION + 1}"):
        ShardedDataset.open(damaged)


def test_not_a_dataset(tmp_path):
    with pytest.raises(MegaCppError, match="no dataset at"):
        ShardedDataset.open(tmp_path / "nothing")
    (tmp_path / MARKER).write_text("x\n")
    (tmp_path / MANIFEST).write_text("{}")
    with pytest.raises(MegaCppError, match="_COMPLETE is corrupt"):
        ShardedDataset.open(tmp_path)
    (tmp_path / MARKER).write_text("0" * 64 + "\n")
    with pytest.raises(MegaCppError, match="does not match"):
        ShardedDataset.open(tmp_path)


def test_structure_disabled(tmp_path):
    cfg = BuildConfig.from_dict({**tiny_config_dict(), "structure": {"enabled": False}})
    out = tmp_path / "ds"
    build_dataset([write_corpus(tmp_path / "src", real=False)], out, cfg, workers=1)
    ds = ShardedDataset.open(out)
    assert all(not b.structure_ids.any() for s in SPLITS for b in ds.iter_blocks(s))
    structure = next(s for s in ds.manifest["stages"] if s["name"] == "structure")
    assert structure["notes"] == {"disabled": structure["seen"]}


def test_structure_ids_cover_several_regions(dataset_dir):
    ds = ShardedDataset.open(dataset_dir, verify=False)
    counts = np.zeros(ds.manifest["num_structure_ids"], dtype=np.int64)
    for block in ds.iter_blocks("train", with_provenance=False):
        counts += np.bincount(block.structure_ids.ravel(), minlength=len(counts))
    assert (counts > 0).sum() >= 6


# ---- writes on a background thread ----------------------------------------------------------


def _rows(n_docs: int, row_len: int) -> list:
    rng = np.random.default_rng(0)
    packer, rows = RowPacker(row_len, pad_id=0), []
    for i in range(n_docs):
        n = int(rng.integers(1, 3 * row_len))
        tokens = rng.integers(7, 500, n).astype(np.int32)
        structure = rng.integers(0, 9, n).astype(np.uint8)
        rows += packer.add(PackedDocument(i, f"d{i}.h", f"{i:064x}", tokens, structure))
    return rows + list(packer.finish())


def _write_split(root: Path, rows: list, io: WriteBehind | None) -> list:
    writer = ShardWriter(root, "train", 33, rows_per_shard=7, rows_per_group=3, io=io)
    for row in rows:
        writer.write(row)
    return [s.to_dict() for s in writer.close()]


def test_write_behind_writes_the_same_bytes(tmp_path):
    """Shards (several per split, groups split across shards) and documents written on the
    WriteBehind thread are byte-identical to synchronous writes, with the same manifest
    entries."""
    rows = _rows(40, 33)
    records = [
        {"doc_index": i, "split": "train", "source_root": "/s", "rel_path": f"d{i}.h",
         "sha256": f"{i:064x}", "size": 10 * i, "license": "MIT", "num_tokens": i,
         "text": "x" * i, "meta": "{}"}
        for i in range(50)
    ]  # fmt: skip
    results = {}
    for name, io in (("sync", None), ("behind", WriteBehind(max_pending=2))):
        root = tmp_path / name
        shards = _write_split(root, rows, io)
        documents = DocumentsWriter(root / "documents.parquet", io)
        for start in range(0, len(records), 8):
            documents.write(records[start : start + 8])
        documents.close()
        files = sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file())
        results[name] = (shards, {f: sha256_file(root / f) for f in files})
    assert results["behind"] == results["sync"]
    assert len(results["sync"][0]) == -(-len(rows) // 7) >= 3


def test_write_behind_raises_a_failed_write():
    def fail() -> None:
        raise OSError("disk full")

    io = WriteBehind()
    with pytest.raises(OSError, match="disk full"):  # from submit (if done) or wait
        io.submit(fail)
        io.wait()
    with pytest.raises(OSError, match="disk full"), WriteBehind() as io:
        io.submit(fail)
    done: list[int] = []
    with pytest.raises(RuntimeError, match="stop"), WriteBehind() as io:
        io.submit(done.append, 1)
        raise RuntimeError("stop")  # leaving on an error still ends the thread cleanly
