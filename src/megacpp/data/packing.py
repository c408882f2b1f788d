"""Splitting, shuffling and packing documents into fixed-length rows.

* Split: a document goes to validation when ``int(sha256[:16], 16) % 1000 < val_permille``;
  the decision depends on the document's own content hash only, so it is stable when the
  corpus grows.
* Shuffle: within a split, documents are ordered by ``sha256(f"{seed}:{doc sha256}")``: a
  deterministic shuffle from the seed (the loader reshuffles rows every epoch on top).
* Pack: each document becomes ``BOS + tokens + EOS`` (structure id OTHER on BOS/EOS) and the
  documents are concatenated into rows of ``seq_len + 1`` tokens (inputs are ``row[:-1]``,
  labels ``row[1:]``). A long document continues in the next row (same ``doc_index`` in the
  provenance of both rows, ``token_start`` says where the piece begins). The last row of a
  split is padded with PAD tokens after ``num_tokens``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

TRAIN, VALIDATION = "train", "validation"
SPLITS = (TRAIN, VALIDATION)


def split_of(sha256: str, val_permille: int) -> str:
    """The split of a document from its content hash (stable as the corpus grows)."""
    return VALIDATION if int(sha256[:16], 16) % 1000 < val_permille else TRAIN


def shuffle_key(sha256: str, seed: int) -> str:
    """Sort key that shuffles documents deterministically for ``seed``."""
    return hashlib.sha256(f"{seed}:{sha256}".encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Segment:
    """The piece of one document that lies in a row."""

    doc_index: int  # the document's index in documents.parquet
    path: str  # POSIX path relative to its source root
    sha256: str  # of the document's raw bytes
    token_start: int  # offset of the piece within the document's BOS..EOS token sequence
    token_count: int


@dataclass(slots=True)
class Row:
    """One packed row of ``seq_len + 1`` tokens."""

    tokens: np.ndarray  # int32[seq_len + 1]
    structure_ids: np.ndarray  # uint8[seq_len + 1]
    doc_starts: list[int]  # position in the row where each segment starts (first is 0)
    num_tokens: int  # real tokens; positions >= num_tokens are padding
    segments: list[Segment] = field(default_factory=list)


@dataclass(slots=True)
class PackedDocument:
    """A tokenized document ready to pack: ``tokens`` already include BOS and EOS."""

    doc_index: int
    path: str
    sha256: str
    tokens: np.ndarray  # int32[n]
    structure_ids: np.ndarray  # uint8[n]


def with_bos_eos(
    ids: np.ndarray, structure_ids: np.ndarray, bos_id: int, eos_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """``BOS + ids + EOS`` and the matching structure ids (OTHER = 0 on BOS/EOS)."""
    tokens = np.empty(len(ids) + 2, dtype=np.int32)
    tokens[0], tokens[1:-1], tokens[-1] = bos_id, ids, eos_id
    structure = np.zeros(len(ids) + 2, dtype=np.uint8)
    structure[1:-1] = structure_ids
    return tokens, structure


class RowPacker:
    """Concatenates documents into rows of ``row_len`` tokens, keeping document boundaries."""

    def __init__(self, row_len: int, pad_id: int) -> None:
        if row_len < 2:
            raise ValueError(f"row_len must be >= 2, got {row_len}")
        self.row_len = row_len
        self.pad_id = pad_id
        self.rows_out = 0
        self.split_documents = 0  # documents that continue into a following row
        self._new_row()

    def add(self, doc: PackedDocument) -> Iterator[Row]:
        """Append ``doc``; yields every row it completes."""
        offset, n, continued = 0, len(doc.tokens), False
        while offset < n:
            take = min(self.row_len - self._fill, n - offset)
            self._put(doc, offset, take)
            offset += take
            if self._fill == self.row_len:
                continued = continued or offset < n
                yield self._emit()
        self.split_documents += continued

    def finish(self) -> Iterator[Row]:
        """The last, padded row (if any tokens are pending)."""
        if self._fill:
            yield self._emit()

    def _put(self, doc: PackedDocument, offset: int, take: int) -> None:
        end = self._fill + take
        self._tokens[self._fill : end] = doc.tokens[offset : offset + take]
        self._structure[self._fill : end] = doc.structure_ids[offset : offset + take]
        self._starts.append(self._fill)
        self._segments.append(Segment(doc.doc_index, doc.path, doc.sha256, offset, take))
        self._fill = end

    def _emit(self) -> Row:
        row = Row(self._tokens, self._structure, self._starts, self._fill, self._segments)
        self.rows_out += 1
        self._new_row()
        return row

    def _new_row(self) -> None:
        self._tokens = np.full(self.row_len, self.pad_id, dtype=np.int32)
        self._structure = np.zeros(self.row_len, dtype=np.uint8)
        self._starts: list[int] = []
        self._segments: list[Segment] = []
        self._fill = 0
