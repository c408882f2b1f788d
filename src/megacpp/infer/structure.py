"""Structure ids for serving: the data build's tree-sitter labels, computed for a sequence.

A model with a structure-id embedding (``[structure] embedding = true``) was trained on the
ids :mod:`megacpp.data.structure` stored for every token of a document. The engine computes
them with the same :class:`~megacpp.data.structure.StructureLabeler` over the sequence's
bytes (the tokens' bytes, concatenated: for a prompt string, its UTF-8):

* **prompt** -- one parse of the prompt's bytes; each token takes the label of its last byte,
  special tokens (BOS, ...) :attr:`~megacpp.data.structure.Structure.OTHER`, as the build
  labels BOS/EOS. A prompt that is a whole document gets exactly the ids the build stored.
* **decode** -- each generated token's id is the label of its last byte in a fresh parse of
  the sequence so far (prompt + completion up to and including that token). Ids already fed
  to the model are never revised. Cost: one tree-sitter parse of the sequence's bytes per
  generated token, O(sequence bytes) (tree-sitter parses C++ at tens of MB/s: a few hundred
  microseconds for a 4 kB sequence), on the host, before the token's decode step.

Fallback: where the parser gives no labels -- the parse passes the labeler's deadline, or the
sequence is over :data:`~megacpp.data.structure.MAX_PARSE_BYTES` -- every token gets
``FALLBACK_ID`` (OTHER), exactly what the data build stores for such a document; the
outcome is counted in :attr:`StructureIds.fallbacks`. A parse with syntax errors (a prompt
cut in the middle of a function, which is the usual case) is labelled from tree-sitter's
recovered tree, as in the build.
"""

from __future__ import annotations

import numpy as np

from megacpp.data.structure import PARSE_TIMEOUT, PARSE_TOO_LARGE, Structure, StructureLabeler
from megacpp.data.tokenizer import CppTokenizer
from megacpp.infer.detokenize import token_bytes

FALLBACK_ID = int(Structure.OTHER)


class StructureIds:
    """Per-token structure ids of token sequences (one per engine: holds a parser)."""

    def __init__(self, tokenizer: CppTokenizer, timeout_s: float = 5.0) -> None:
        self._bytes = token_bytes(tokenizer)
        self._labeler = StructureLabeler(timeout_s)
        self.fallbacks = 0  # sequences labelled FALLBACK_ID because the parse gave no labels

    def _byte_labels(self, token_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(uint8 byte labels of the tokens' bytes, int64[n] each token's byte count)."""
        pieces = [self._bytes[t] for t in token_ids]
        labels, outcome = self._labeler.byte_labels(b"".join(pieces))
        if outcome in (PARSE_TIMEOUT, PARSE_TOO_LARGE):
            self.fallbacks += 1
        return labels, np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))

    def label(self, token_ids: list[int]) -> list[int]:
        """The structure id of every token of ``token_ids`` (a prompt)."""
        if not token_ids:
            return []
        labels, nbytes = self._byte_labels(token_ids)
        ends = np.cumsum(nbytes)
        ids = np.full(len(token_ids), FALLBACK_ID, dtype=np.int64)
        has_bytes = nbytes > 0  # special tokens stand for no bytes: OTHER
        ids[has_bytes] = labels[ends[has_bytes] - 1]
        return ids.tolist()

    def label_last(self, token_ids: list[int]) -> int:
        """The structure id of the last token of ``token_ids`` (a newly generated token), from
        a parse of the whole sequence."""
        if not token_ids or not self._bytes[token_ids[-1]]:
            return FALLBACK_ID
        labels, _ = self._byte_labels(token_ids)
        return int(labels[-1])
