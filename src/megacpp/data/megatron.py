"""Export a packed dataset as Megatron-LM indexed datasets (``.bin`` + ``.idx``, MMIDIDX v1).

One Megatron *sequence per document* (documents are the natural unit; Megatron's GPTDataset
concatenates and re-chunks them itself): the document's tokens exactly as packed, i.e.
``BOS + tokens + EOS`` (use the EOS id as Megatron's ``eod``). ``document_indices`` is
``[0, 1, ..., n]``. Documents keep the packed order. Each split becomes its own prefix:
``PREFIX_train`` and ``PREFIX_validation`` (empty splits are skipped).

The documents are reassembled from the rows' provenance (``doc_index``, ``token_start``), so
the export is a check of the shards too: a piece out of order is reported as corruption.

Format (little endian), as read by ``megatron.core.datasets.indexed_dataset.IndexedDataset``::

    .idx: b"MMIDIDX\\x00\\x00" | u64 version=1 | u8 dtype code | u64 n_sequences |
          u64 n_document_indices | i32 lengths[n] | i64 byte offsets[n] | i64 doc indices[n+1]
    .bin: the tokens of every sequence back to back, in the dtype
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from megacpp.data.packing import SPLITS
from megacpp.data.shards import ShardedDataset
from megacpp.errors import MegaCppError

_INDEX_HEADER = b"MMIDIDX\x00\x00"
_DTYPE_CODES = {np.dtype(np.uint16): 8, np.dtype(np.int32): 4}


def megatron_dtype(vocab_size: int) -> np.dtype:
    """Megatron's choice for token ids: uint16 below 65500 ids, else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def iter_documents(dataset: ShardedDataset, split: str) -> Iterator[tuple[int, np.ndarray]]:
    """(doc_index, int32[n] tokens incl. BOS/EOS) of each document of ``split``, in order."""
    current, pieces, expected_start = -1, [], 0
    for block in dataset.iter_blocks(split, with_provenance=True):
        for r in range(len(block.rows)):
            starts = block.doc_starts[r]
            ends = np.append(starts[1:], block.num_tokens[r])
            for (start, end), (doc, token_start) in zip(
                zip(starts.tolist(), ends.tolist()), block.segments[r]
            ):
                if doc != current:
                    if pieces:
                        yield current, np.concatenate(pieces)
                    current, pieces, expected_start = doc, [], 0
                if token_start != expected_start:
                    raise MegaCppError(
                        f"{dataset.root}: row {int(block.rows[r])} continues document {doc} at "
                        f"token {token_start}, expected {expected_start} (corrupt shards)"
                    )
                pieces.append(block.tokens[r, start:end])
                expected_start += end - start
    if pieces:
        yield current, np.concatenate(pieces)


def export_megatron(dataset: ShardedDataset, prefix: str | Path) -> list[dict[str, Any]]:
    """Write ``{prefix}_{split}.bin/.idx`` for each non-empty split; returns what was written."""
    dtype = megatron_dtype(dataset.manifest["tokenizer"]["vocab_size"])
    written = []
    for split in SPLITS:
        if dataset.num_rows(split) == 0:
            continue
        split_prefix = Path(f"{prefix}_{split}")
        split_prefix.parent.mkdir(parents=True, exist_ok=True)
        lengths = _write_bin(
            dataset, split, split_prefix.with_name(split_prefix.name + ".bin"), dtype
        )
        _write_idx(split_prefix.with_name(split_prefix.name + ".idx"), lengths, dtype)
        written.append(
            {
                "split": split,
                "prefix": str(split_prefix),
                "documents": len(lengths),
                "tokens": int(lengths.sum()),
                "dtype": dtype.name,
            }
        )
    return written


def _write_bin(dataset: ShardedDataset, split: str, path: Path, dtype: np.dtype) -> np.ndarray:
    lengths = []
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        for _, tokens in iter_documents(dataset, split):
            f.write(tokens.astype(dtype).tobytes())
            lengths.append(len(tokens))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return np.asarray(lengths, dtype=np.int64)


def _write_idx(path: Path, lengths: np.ndarray, dtype: np.dtype) -> None:
    n = len(lengths)
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]) * dtype.itemsize
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(_INDEX_HEADER)
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", _DTYPE_CODES[dtype]))
        f.write(struct.pack("<Q", n))
        f.write(struct.pack("<Q", n + 1))
        f.write(lengths.astype(np.int32).tobytes())
        f.write(pointers.astype(np.int64).tobytes())
        f.write(np.arange(n + 1, dtype=np.int64).tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
