"""Packed-dataset files: the shard schema, the shard/documents writers, the manifest with its
completion marker, and the checksum-verifying reader.

Layout of a dataset directory::

    manifest.json         schema version, config, tokenizer hash, stage counts, per-split totals,
                          sha256 of every file below
    _COMPLETE             written last: the sha256 of manifest.json
    tokenizer.json        the tokenizer the tokens belong to
    documents.parquet     the curated documents (text + provenance), see DOCUMENTS_SCHEMA
    train/shard-00000.parquet, ...          rows, see shard_schema()
    validation/shard-00000.parquet, ...

A directory without ``_COMPLETE`` (or whose manifest does not hash to it) is refused, as is a
file whose sha256 differs from the manifest: :class:`megacpp.errors.MegaCppError` names it.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from megacpp._io import (
    JSON_LIMIT,
    KiB,
    atomic_write_json,
    atomic_write_text,
    parse_json,
    read_bounded,
    sha256_bytes,
    sha256_file,
)
from megacpp.data.packing import SPLITS, Row
from megacpp.errors import MegaCppError

SCHEMA_VERSION = 1
DATASET_FORMAT = "megacpp-packed-shards"
MANIFEST, MARKER = "manifest.json", "_COMPLETE"
TOKENIZER_FILE, DOCUMENTS_FILE = "tokenizer.json", "documents.parquet"
_VERSION_KEY = b"megacpp.schema_version"
_COMPRESSION = "zstd"

SEGMENT_TYPE = pa.struct(
    [
        ("doc_index", pa.int64()),
        ("path", pa.string()),
        ("sha256", pa.string()),
        ("token_start", pa.int64()),
        ("token_count", pa.int32()),
    ]
)

DOCUMENTS_SCHEMA = pa.schema(
    [
        ("doc_index", pa.int64()),  # referenced by the shards' provenance
        ("split", pa.string()),
        ("source_root", pa.string()),
        ("rel_path", pa.string()),
        ("sha256", pa.string()),  # of the raw file bytes
        ("size", pa.int64()),  # bytes on disk
        ("license", pa.string()),
        ("num_tokens", pa.int64()),  # tokens as packed, without BOS/EOS (FIM: pieces + 3)
        ("text", pa.large_string()),
        ("meta", pa.string()),  # JSON object from the curation steps
    ],
    metadata={_VERSION_KEY: str(SCHEMA_VERSION).encode()},
)


def shard_schema(row_len: int) -> pa.Schema:
    """Schema of one shard: one row per packed sequence of ``row_len`` (= seq_len + 1) tokens."""
    return pa.schema(
        [
            ("row", pa.int64()),  # index within the split, in packing order
            ("tokens", pa.list_(pa.int32(), row_len)),
            ("structure_ids", pa.list_(pa.uint8(), row_len)),
            ("doc_starts", pa.list_(pa.int32())),  # start of each document segment in the row
            ("num_tokens", pa.int32()),  # real tokens; the rest is padding
            ("documents", pa.list_(SEGMENT_TYPE)),  # provenance, aligned with doc_starts
        ],
        metadata={_VERSION_KEY: str(SCHEMA_VERSION).encode()},
    )


# ---- writing -------------------------------------------------------------------------------


@dataclass
class ShardInfo:
    """A written shard as recorded in the manifest."""

    file: str  # relative to the dataset root
    rows: int
    tokens: int  # real (non-padding) tokens
    bytes: int
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "rows": self.rows,
            "tokens": self.tokens,
            "bytes": self.bytes,
            "sha256": self.sha256,
        }


class WriteBehind:
    """One background thread that runs file writes in submission order: parquet encoding and
    compression, closing, hashing. pyarrow and hashlib release the GIL, so the writes overlap
    the caller's Python work (packing the next rows) on another core. The files are the same
    bytes as with synchronous writes: same tables, same writer, same order.

    At most ``max_pending`` writes wait (memory stays bounded). A failed write raises from
    the next :meth:`submit` or from :meth:`wait`. Leaving the ``with`` block waits for the
    writes; on an exception it cancels the ones not started."""

    def __init__(self, max_pending: int = 8) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="megacpp-write")
        self._pending: deque[Future] = deque()
        self._max_pending = max_pending

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        self._pending.append(self._pool.submit(fn, *args))
        while self._pending and (self._pending[0].done() or len(self._pending) > self._max_pending):
            self._pending.popleft().result()  # raises the error of a failed write

    def wait(self) -> None:
        """Block until every submitted write is done (raises the first failure)."""
        while self._pending:
            self._pending.popleft().result()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        try:
            if exc_type is None:
                self.wait()
        finally:
            self._pool.shutdown(wait=True, cancel_futures=exc_type is not None)


def _run(io: WriteBehind | None, fn: Callable[..., Any], *args: Any) -> None:
    """``fn(*args)`` now, or on ``io``'s thread when given."""
    if io is None:
        fn(*args)
    else:
        io.submit(fn, *args)


class ShardWriter:
    """Writes the rows of one split into ``<root>/<split>/shard-NNNNN.parquet`` files of at
    most ``rows_per_shard`` rows, in row groups of ``rows_per_group`` rows. With ``io`` the
    file work runs on that :class:`WriteBehind` thread (tables are built here)."""

    def __init__(
        self,
        root: Path,
        split: str,
        row_len: int,
        *,
        rows_per_shard: int,
        rows_per_group: int,
        io: WriteBehind | None = None,
    ) -> None:
        self.root = Path(root)
        self._io = io
        self.split = split
        self.schema = shard_schema(row_len)
        self.row_len = row_len
        self.rows_per_shard = rows_per_shard
        self.rows_per_group = min(rows_per_group, rows_per_shard)
        self.shards: list[ShardInfo] = []  # filled by _finish_shard (maybe on io's thread)
        self._opened = 0  # shards opened so far (numbers the files)
        self._pending: list[Row] = []
        self._writer: pq.ParquetWriter | None = None
        self._current = ""  # the open shard, relative to root
        self._rows_in_shard = 0
        self._tokens_in_shard = 0
        self._next_row = 0

    def write(self, row: Row) -> None:
        self._pending.append(row)
        if len(self._pending) == self.rows_per_group:
            self._flush_group()

    def close(self) -> list[ShardInfo]:
        """Flush and close; returns the shards written (none for an empty split)."""
        if self._pending:
            self._flush_group()
        self._close_shard()
        if self._io is not None:
            self._io.wait()  # the shards list fills in on the writer thread
        return self.shards

    def _flush_group(self) -> None:
        while self._pending:
            if self._writer is None:
                self._open_shard()
            room = self.rows_per_shard - self._rows_in_shard
            group, self._pending = self._pending[:room], self._pending[room:]
            _run(self._io, self._writer.write_table, self._rows_table(group))
            self._rows_in_shard += len(group)
            self._tokens_in_shard += sum(r.num_tokens for r in group)
            if self._rows_in_shard == self.rows_per_shard:
                self._close_shard()

    def _rows_table(self, rows: Sequence[Row]) -> pa.Table:
        n = len(rows)
        first = self._next_row
        self._next_row += n
        tokens = np.concatenate([r.tokens for r in rows])  # [n * row_len]
        structure = np.concatenate([r.structure_ids for r in rows])
        columns = [
            pa.array(np.arange(first, first + n, dtype=np.int64)),
            pa.FixedSizeListArray.from_arrays(pa.array(tokens), self.row_len),
            pa.FixedSizeListArray.from_arrays(pa.array(structure), self.row_len),
            pa.array([r.doc_starts for r in rows], type=pa.list_(pa.int32())),
            pa.array([r.num_tokens for r in rows], type=pa.int32()),
            _segments_array(rows),
        ]
        return pa.Table.from_arrays(columns, schema=self.schema)

    def _open_shard(self) -> None:
        rel = f"{self.split}/shard-{self._opened:05d}.parquet"
        self._opened += 1
        (self.root / self.split).mkdir(parents=True, exist_ok=True)
        self._current = rel
        self._writer = pq.ParquetWriter(self.root / rel, self.schema, compression=_COMPRESSION)
        self._rows_in_shard = self._tokens_in_shard = 0

    def _close_shard(self) -> None:
        if self._writer is None:
            return
        shard = (self._writer, self._current, self._rows_in_shard, self._tokens_in_shard)
        _run(self._io, self._finish_shard, *shard)
        self._writer = None

    def _finish_shard(self, writer: pq.ParquetWriter, rel: str, rows: int, tokens: int) -> None:
        writer.close()
        path = self.root / rel
        self.shards.append(ShardInfo(rel, rows, tokens, path.stat().st_size, sha256_file(path)))


def _segments_array(rows: Sequence[Row]) -> pa.ListArray:
    """The rows' segments as a ``list<SEGMENT_TYPE>`` column, built field by field (no
    per-segment dicts)."""
    segments = [s for r in rows for s in r.segments]
    offsets = np.cumsum([0, *(len(r.segments) for r in rows)], dtype=np.int32)  # [rows + 1]
    fields = [
        pa.array([getattr(s, field.name) for s in segments], type=field.type)
        for field in SEGMENT_TYPE
    ]
    struct = pa.StructArray.from_arrays(fields, fields=list(SEGMENT_TYPE))
    return pa.ListArray.from_arrays(pa.array(offsets), struct, type=pa.list_(SEGMENT_TYPE))


class DocumentsWriter:
    """Streams curated documents (text + provenance) into ``documents.parquet`` (with ``io``,
    the file work runs on that :class:`WriteBehind` thread)."""

    def __init__(self, path: Path, io: WriteBehind | None = None) -> None:
        self.path = Path(path)
        self._writer = pq.ParquetWriter(self.path, DOCUMENTS_SCHEMA, compression=_COMPRESSION)
        self._io = io
        self.count = 0

    def write(self, records: Sequence[dict[str, Any]]) -> None:
        if records:
            table = pa.Table.from_pylist(list(records), schema=DOCUMENTS_SCHEMA)
            _run(self._io, self._writer.write_table, table)
            self.count += len(records)

    def close(self) -> None:
        _run(self._io, self._writer.close)
        if self._io is not None:
            self._io.wait()


def write_manifest_and_marker(root: Path, manifest: dict[str, Any]) -> str:
    """Write ``manifest.json`` then ``_COMPLETE`` (its sha256) -- the marker is always last."""
    atomic_write_json(root / MANIFEST, manifest)
    digest = sha256_file(root / MANIFEST)
    atomic_write_text(root / MARKER, digest + "\n")
    return digest


# ---- reading -------------------------------------------------------------------------------


@dataclass
class RowBlock:
    """A row group of one shard as numpy arrays."""

    rows: np.ndarray  # int64[r] row index within the split
    tokens: np.ndarray  # int32[r, row_len]
    structure_ids: np.ndarray  # uint8[r, row_len]
    doc_starts: list[np.ndarray]  # r x int32[k_i]
    num_tokens: np.ndarray  # int32[r]
    # provenance (only when read with_provenance): r x [(doc_index, token_start), ...]
    segments: list[list[tuple[int, int]]] | None = None


class ShardedDataset:
    """A verified, complete dataset directory (open with :meth:`open`)."""

    def __init__(self, root: Path, manifest: dict[str, Any], manifest_sha256: str) -> None:
        self.root = root
        self.manifest = manifest
        self.manifest_sha256 = manifest_sha256  # identifies the dataset (e.g. in resume state)
        self.row_len: int = manifest["row_len"]
        self.seq_len: int = manifest["seq_len"]

    @classmethod
    def open(cls, path: str | Path, *, verify: bool = True) -> ShardedDataset:
        """Open ``path``: requires the completion marker, a manifest that hashes to it and
        the supported schema version; with ``verify`` also checks every file's sha256."""
        root = Path(path)
        manifest, digest = read_manifest(root)
        dataset = cls(root, manifest, digest)
        if verify:
            dataset.verify()
        return dataset

    def verify(self) -> None:
        """Check the sha256 of every file listed in the manifest, then that every shard holds
        the rows the manifest says, of ``row_len`` tokens."""
        for rel, expected in self._listed_files():
            _check_file(self.root, rel, expected)
        wanted = shard_schema(self.row_len).field("tokens").type
        for split in SPLITS:
            for shard in self.shards(split):
                path = self.root / shard["file"]
                try:
                    meta = pq.ParquetFile(path).metadata
                    tokens = meta.schema.to_arrow_schema().field("tokens").type
                except (OSError, KeyError, pa.ArrowException) as exc:
                    raise MegaCppError(f"cannot read shard {path}: {exc}") from None
                if meta.num_rows != shard["rows"] or tokens != wanted:
                    raise MegaCppError(
                        f"{path} holds {meta.num_rows} rows of {tokens}, but the manifest says "
                        f"{shard['rows']} rows of {wanted} (row_len {self.row_len}); rebuild "
                        "the dataset"
                    )

    def shards(self, split: str) -> list[dict[str, Any]]:
        if split not in SPLITS:
            raise MegaCppError(f"unknown split {split!r}: use one of {', '.join(SPLITS)}")
        return list(self.manifest["splits"][split]["shards"])

    def num_rows(self, split: str) -> int:
        return int(self.manifest["splits"][split]["rows"])

    def row_groups(self, split: str) -> list[tuple[str, int, int]]:
        """Every row group of ``split`` as (shard file, group index, rows), in row order."""
        groups = []
        for shard in self.shards(split):
            meta = pq.ParquetFile(self.root / shard["file"]).metadata
            groups += [
                (shard["file"], g, meta.row_group(g).num_rows) for g in range(meta.num_row_groups)
            ]
        return groups

    def read_group(self, shard_file: str, group: int, *, with_provenance: bool = False) -> RowBlock:
        """One row group as numpy arrays (provenance only if asked: it is the slow column)."""
        columns = list(_ROW_COLUMNS) + (["documents"] if with_provenance else [])
        try:
            table = pq.ParquetFile(self.root / shard_file).read_row_group(group, columns=columns)
        except (OSError, pa.ArrowException) as exc:
            raise MegaCppError(f"cannot read shard {self.root / shard_file}: {exc}") from None
        block = _row_block(table, self.row_len)
        if with_provenance:
            block.segments = _segments(table["documents"])
        return block

    def iter_blocks(self, split: str, *, with_provenance: bool = True) -> Iterator[RowBlock]:
        """All row groups of ``split`` in row order."""
        for shard_file, group, _ in self.row_groups(split):
            yield self.read_group(shard_file, group, with_provenance=with_provenance)

    def documents(self, columns: Sequence[str] | None = None) -> pa.Table:
        """The curated documents (``documents.parquet``)."""
        return pq.read_table(self.root / DOCUMENTS_FILE, columns=list(columns) if columns else None)

    def tokenizer(self):
        """The dataset's tokenizer (a :class:`megacpp.data.tokenizer.CppTokenizer`)."""
        from megacpp.data.tokenizer import CppTokenizer

        return CppTokenizer.load(self.root / TOKENIZER_FILE)

    def _listed_files(self) -> list[tuple[str, str]]:
        files = [
            (TOKENIZER_FILE, self.manifest["tokenizer"]["sha256"]),
            (DOCUMENTS_FILE, self.manifest["documents"]["sha256"]),
        ]
        for split in SPLITS:
            files += [(s["file"], s["sha256"]) for s in self.manifest["splits"][split]["shards"]]
        return files


_ROW_COLUMNS = ("row", "tokens", "structure_ids", "doc_starts", "num_tokens")


def _segments(documents: pa.ChunkedArray) -> list[list[tuple[int, int]]]:
    lists = documents.combine_chunks()
    offsets = lists.offsets.to_numpy()
    doc_index = lists.values.field("doc_index").to_numpy().tolist()
    token_start = lists.values.field("token_start").to_numpy().tolist()
    pairs = list(zip(doc_index, token_start))
    return [pairs[offsets[i] : offsets[i + 1]] for i in range(len(lists))]


def _row_block(table: pa.Table, row_len: int) -> RowBlock:
    n = table.num_rows
    doc_starts = table["doc_starts"].combine_chunks()
    offsets = doc_starts.offsets.to_numpy()
    starts_flat = doc_starts.values.to_numpy(zero_copy_only=False)
    return RowBlock(
        rows=table["row"].to_numpy(),
        tokens=_fixed_lists(table["tokens"], np.int32).reshape(n, row_len),
        structure_ids=_fixed_lists(table["structure_ids"], np.uint8).reshape(n, row_len),
        doc_starts=[starts_flat[offsets[i] : offsets[i + 1]] for i in range(n)],
        num_tokens=table["num_tokens"].to_numpy(),
    )


def _fixed_lists(column: pa.ChunkedArray, dtype: type) -> np.ndarray:
    return (
        column.combine_chunks().flatten().to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    )


def read_manifest(root: Path) -> tuple[dict[str, Any], str]:
    """The manifest of a *complete* dataset and its sha256, after checking the marker, the
    hash and the schema version."""
    if not root.is_dir():
        raise MegaCppError(f"no dataset at {root}: expected a directory from `megacpp data build`")
    marker = root / MARKER
    if not marker.is_file():
        raise MegaCppError(
            f"{root} has no {MARKER} marker: the build did not finish (rerun `megacpp data build`)"
        )
    expected = read_bounded(marker, 4 * KiB, what="dataset marker").strip()
    if not _SHA256.fullmatch(expected):
        raise MegaCppError(
            f"{marker} is corrupt: it should hold the sha256 of {MANIFEST} (64 hex digits); "
            "rebuild the dataset"
        )
    manifest_bytes = read_bounded(root / MANIFEST, JSON_LIMIT, what="dataset manifest")
    if sha256_bytes(manifest_bytes) != expected.decode("ascii"):
        raise MegaCppError(
            f"{root / MANIFEST} does not match its {MARKER} marker (sha256 differs): the dataset "
            "was modified after the build; rebuild it"
        )
    manifest = _parse_manifest(root, manifest_bytes)
    version = manifest.get("schema_version")
    if version != SCHEMA_VERSION:
        raise MegaCppError(
            f"{root} uses shard schema version {version!r}; this megacpp reads version "
            f"{SCHEMA_VERSION} (rebuild the dataset with this megacpp)"
        )
    _check_manifest(root / MANIFEST, manifest)
    return manifest, expected.decode("ascii")


def _parse_manifest(root: Path, data: bytes) -> dict[str, Any]:
    manifest = parse_json(data, f"{root / MANIFEST}")
    if not isinstance(manifest, dict) or manifest.get("format") != DATASET_FORMAT:
        raise MegaCppError(f"{root / MANIFEST} is not a {DATASET_FORMAT} manifest")
    return manifest


_SHA256 = re.compile(rb"[0-9a-f]{64}")
_INT = "an integer >= 0"


def _check_manifest(path: Path, m: dict[str, Any]) -> None:
    """Every manifest field the readers use has its type (a hand-edited manifest whose marker
    was recomputed still fails here, naming the field)."""

    def need(ok: bool, name: str, value: Any, expected: str) -> None:
        if not ok:
            raise MegaCppError(f"{path}: {name} = {value!r:.80}: expected {expected} "
                               "(the manifest was edited or is corrupt; rebuild the dataset)")

    def count(table: dict[str, Any], key: str, where: str) -> int:
        value = table.get(key)
        need(_is_int(value) and value >= 0, f"{where}.{key}", value, _INT)
        return value

    def digest(table: Any, where: str) -> None:
        value = table.get("sha256") if isinstance(table, dict) else None
        need(isinstance(value, str) and bool(_SHA256.fullmatch(value.encode())),
             f"{where}.sha256", value, "a sha256 (64 lowercase hex digits)")

    seq_len = m.get("seq_len")
    need(_is_int(seq_len) and seq_len >= 1, "seq_len", seq_len, "an integer >= 1")
    need(m.get("row_len") == seq_len + 1, "row_len", m.get("row_len"),
         f"seq_len + 1 = {seq_len + 1}")
    for name in ("tokenizer", "documents"):
        need(isinstance(m.get(name), dict), name, m.get(name), "a table")
        digest(m[name], name)
    vocab = m["tokenizer"].get("vocab_size")
    need(_is_int(vocab) and vocab >= 1, "tokenizer.vocab_size", vocab, "an integer >= 1")
    splits = m.get("splits")
    need(isinstance(splits, dict) and set(splits) == set(SPLITS), "splits", splits,
         f"a table of {', '.join(SPLITS)}")
    for split in SPLITS:
        table = splits[split]
        need(isinstance(table, dict), f"splits.{split}", table, "a table")
        for key in ("documents", "tokens", "rows"):
            count(table, key, f"splits.{split}")
        shards = table.get("shards")
        need(isinstance(shards, list), f"splits.{split}.shards", shards, "a list")
        for i, shard in enumerate(shards):
            where = f"splits.{split}.shards[{i}]"
            need(isinstance(shard, dict), where, shard, "a table")
            file = shard.get("file")
            need(isinstance(file, str) and _inside(file), f"{where}.file", file,
                 "a relative path inside the dataset")
            digest(shard, where)
            count(shard, "rows", where)
        rows = sum(shard["rows"] for shard in shards)
        need(rows == table["rows"], f"splits.{split}.rows", table["rows"],
             f"the sum of its shards' rows ({rows})")
    stages = m.get("stages")
    need(isinstance(stages, list) and all(_is_stage(s) for s in stages), "stages",
         stages, "a list of stage tables (name, seen, kept, bytes_in, bytes_out, dropped, notes)")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _inside(rel: str) -> bool:
    parts = Path(rel).parts
    return bool(parts) and not Path(rel).is_absolute() and ".." not in parts and "\0" not in rel


def _is_stage(stage: Any) -> bool:
    return (isinstance(stage, dict) and isinstance(stage.get("name"), str)
            and all(_is_int(stage.get(k)) for k in ("seen", "kept", "bytes_in", "bytes_out"))
            and all(isinstance(stage.get(k), dict)
                    and all(_is_int(v) for v in stage[k].values()) for k in ("dropped", "notes")))


def _check_file(root: Path, rel: str, expected: str) -> None:
    path = root / rel
    if not path.is_file():
        raise MegaCppError(f"{path} is missing (listed in {root / MANIFEST})")
    actual = sha256_file(path)
    if actual != expected:
        raise MegaCppError(
            f"{path} is corrupt: sha256 {actual[:16]}... does not match the manifest's "
            f"{expected[:16]}... (rebuild the dataset)"
        )
