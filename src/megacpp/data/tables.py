"""Source documents from tables: parquet files and JSON Lines (``.jsonl``, ``.jsonl.gz``,
``.jsonl.zst``), one document per row, as The Stack ships them.

Columns (JSONL: keys):

* ``content`` (required): the file's text (a string; parquet binary is taken as bytes);
* ``path`` (or ``max_stars_repo_path``): the file's path in its repository. When present, it
  selects rows like a directory walk does: by extension, or for an extensionless path by
  sniffing the content (:func:`megacpp.data.sources.looks_like_cpp_header`);
* ``repo`` (or ``repo_name``, ``max_stars_repo_name``): the repository;
* ``license`` / ``licence`` / ``licenses`` (or ``max_stars_repo_licenses``): SPDX ids, a
  string or a list (a list means all of them apply: joined with AND). An expression that
  parses becomes the document's license (the license step then applies the policy to it
  instead of detecting one in the text); one that does not parse is kept in ``meta`` and
  the text is scanned as for files on disk.

Reading streams: parquet in record batches (:meth:`pyarrow.parquet.ParquetFile.iter_batches`),
JSONL line by line through pyarrow's decompressing input stream. A bad row never stops the
build; it is counted in the ``sources`` stage under ``bad_json`` (a line that is not JSON),
``not_an_object``, ``missing_content`` (no ``content`` or null), ``bad_field`` (a column of
the wrong type), ``too_large`` or ``not_source``. A file that breaks mid-way (a truncated
compressed stream, a corrupt row group) counts once under ``table_read_error``, keeping
the rows before the break. A file that cannot be opened at all, or a parquet file without
a ``content`` column, is a user error raised before the build starts.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from megacpp.data.config import CorpusConfig
from megacpp.data.document import Document
from megacpp.data.license import LicenseExpressionError, parse_spdx
from megacpp.data.pipeline import StageStats
from megacpp.data.sources import looks_like_cpp_header
from megacpp.errors import MegaCppError

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".ndjson")
PARQUET_SUFFIX = ".parquet"
CONTENT = "content"
# field -> the column names read for it, first match wins
ALIASES = {
    "path": ("path", "max_stars_repo_path"),
    "repo": ("repo", "repo_name", "max_stars_repo_name"),
    "license": ("license", "licence", "licenses", "max_stars_repo_licenses"),
}
BATCH_ROWS = 256


def is_table(path: Path) -> bool:
    """Whether ``path`` is read as a table of documents (by its name)."""
    name = path.name.lower()
    return name.endswith(PARQUET_SUFFIX) or name.endswith(JSONL_SUFFIXES)


def check_table(path: Path) -> None:
    """Open ``path`` once to fail early (before the build) on a file that is not readable."""
    if path.name.lower().endswith(PARQUET_SUFFIX):
        columns = _parquet_columns(path)
        if CONTENT not in columns:
            raise MegaCppError(f"{path}: no {CONTENT!r} column (columns: {', '.join(columns)}); "
                               f"a document table needs the text in {CONTENT!r}")
    else:
        try:
            with pa.input_stream(str(path), compression="detect") as stream:
                stream.read(1)
        except (OSError, pa.ArrowException) as exc:
            raise MegaCppError(f"cannot read {path}: {exc}") from None


def iter_table(path: Path, cfg: CorpusConfig, stats: StageStats,
               extensions: frozenset[str]) -> Iterator[Document]:
    """The documents of one table, in row order (bad rows counted in ``stats``)."""
    is_parquet = path.name.lower().endswith(PARQUET_SUFFIX)
    rows = enumerate(_parquet_rows(path)) if is_parquet else _jsonl_rows(path)
    where = "row" if is_parquet else "line"  # rows count from 0, lines from 1
    source_root = os.path.abspath(path)
    number = 0
    try:
        for number, row in rows:
            doc = _document(row, (where, number), source_root, cfg, stats, extensions)
            if doc is not None:
                yield doc
    except (OSError, pa.ArrowException, EOFError) as exc:  # the file broke mid-way
        stats.dropped["table_read_error"] += 1
        stats.notes[f"table_read_error={path.name} after {where} {number}: {exc}"[:300]] += 1


# -- rows -------------------------------------------------------------------------------------------
class _BadRow:
    """A row that could not be read, with the reason it is counted under."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _parquet_columns(path: Path) -> list[str]:
    try:
        return list(pq.ParquetFile(str(path)).schema_arrow.names)
    except (OSError, pa.ArrowException) as exc:
        raise MegaCppError(f"{path} is not a readable parquet file: {exc}") from None


def _parquet_rows(path: Path) -> Iterator[dict[str, Any]]:
    table = pq.ParquetFile(str(path))
    names = set(table.schema_arrow.names)
    wanted = [CONTENT] + [c for cols in ALIASES.values() for c in cols if c in names]
    for batch in table.iter_batches(batch_size=BATCH_ROWS, columns=wanted):
        yield from batch.to_pylist()


def _jsonl_rows(path: Path) -> Iterator[tuple[int, dict[str, Any] | _BadRow]]:
    """``(line number, row)`` of every non-blank line."""
    with pa.input_stream(str(path), compression="detect") as stream:
        for number, line in enumerate(_lines(stream), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):  # also invalid UTF-8, hostile nesting
                yield number, _BadRow("bad_json")
                continue
            yield number, row if isinstance(row, dict) else _BadRow("not_an_object")


def _lines(stream: pa.NativeFile, chunk_bytes: int = 1 << 16) -> Iterator[bytes]:
    """The lines of a (decompressing) stream, read in small chunks so that a stream breaking
    mid-way has yielded every whole line before the break."""
    pending = b""
    while chunk := stream.read(chunk_bytes):
        lines = (pending + chunk).split(b"\n")
        pending = lines.pop()
        yield from lines
    if pending:
        yield pending


# -- documents --------------------------------------------------------------------------------------
def _document(row: dict[str, Any] | _BadRow, location: tuple[str, int], source_root: str,
              cfg: CorpusConfig, stats: StageStats, extensions: frozenset[str]) -> Document | None:
    stats.seen += 1
    if isinstance(row, _BadRow):
        return _drop(stats, row.reason)
    content = row.get(CONTENT)
    if content is None:
        return _drop(stats, "missing_content")
    fields = {name: _first(row, cols) for name, cols in ALIASES.items()}
    if not isinstance(content, (str, bytes)) or not _valid_fields(fields):
        return _drop(stats, "bad_field")
    raw = content.encode("utf-8", "surrogatepass") if isinstance(content, str) else content
    stats.bytes_in += len(raw)
    if len(raw) > cfg.max_bytes:
        return _drop(stats, "too_large")
    path, repo, license_field = fields["path"], fields["repo"], fields["license"]
    if path is not None:
        suffix = os.path.splitext(os.path.basename(path))[1].lower()
        sniffed = not suffix and cfg.detect_extensionless_headers and looks_like_cpp_header(
            raw[:1024])
        if suffix not in extensions and not sniffed:
            return _drop(stats, "not_source")
    where, number = location
    meta: dict[str, Any] = {where: number}
    if repo is not None:
        meta["repo"] = repo
    if path is not None:
        meta["path"] = path
    if license_field is not None:
        expression = license_field if isinstance(license_field, str) else " AND ".join(
            f"({item})" for item in license_field)
        meta["license_column"] = expression
        try:
            parse_spdx(expression)
            meta["declared_license"] = expression
        except LicenseExpressionError:
            stats.notes["unparsed_license_column"] += 1
    stats.kept += 1
    stats.bytes_out += len(raw)
    rel_path = "/".join(p for p in (repo, path) if p) or f"{where}_{number}"
    return Document(source_root=source_root, rel_path=rel_path, size=len(raw),
                    sha256=hashlib.sha256(raw).hexdigest(), raw=raw, meta=meta)


def _first(row: dict[str, Any], columns: tuple[str, ...]) -> Any:
    return next((row[c] for c in columns if row.get(c) is not None), None)


def _valid_fields(fields: dict[str, Any]) -> bool:
    license_field = fields["license"]
    license_ok = license_field is None or isinstance(license_field, str) or (
        isinstance(license_field, list) and license_field
        and all(isinstance(x, str) and x for x in license_field))
    return license_ok and all(fields[k] is None or isinstance(fields[k], str)
                              for k in ("path", "repo"))


def _drop(stats: StageStats, reason: str) -> None:
    stats.dropped[reason] += 1
