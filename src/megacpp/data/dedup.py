"""Exact and near-duplicate removal.

* :class:`ExactDedup` drops a document whose whitespace-normalized text (every run of
  whitespace collapsed to one space, ends stripped) hashes (sha256) like an earlier one.
* :class:`NearDedup` drops a document whose estimated Jaccard similarity with an earlier
  *kept* document reaches ``threshold``. Sets are shingles of ``shingle_size`` consecutive
  lexical tokens (:mod:`megacpp.data.cpp_lex`: comments and whitespace never count, so
  reformatting and comment edits do not hide a copy). A MinHash of ``num_perm`` permutations
  (datasketch's ``affine32`` scheme) summarizes each set; LSH with ``bands`` x ``rows`` finds
  candidates (S-curve threshold ``(1/bands)**(1/rows)``), and a candidate counts only when
  the MinHash estimate of its Jaccard similarity is ``>= threshold``. The LSH index
  (:class:`BandIndex`) finds the same candidates as ``datasketch.MinHashLSH`` (a kept
  document is one when any band of ``rows`` signature values equals the query's), with one
  dict lookup per band instead of datasketch's per-band numpy and storage calls (tested).

Both keep the first occurrence in stream order (the sources walk is sorted, so the result is
deterministic) and note on the dropped document which kept document it duplicates.

Speed: shingle hashing is vectorized (a polynomial rolling hash over the bytes, mod 2^64, so
a token's hash is a difference of prefix sums), and the MinHash is one numpy min over a
``[shingles, num_perm]`` product computed in blocks. The result equals what
``datasketch.MinHash.update_batch`` gives for the same 32-bit shingle hashes (tested).
"""

from __future__ import annotations

import hashlib
import itertools
import re
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from datasketch import MinHash

from megacpp.data import cpp_lex
from megacpp.data.document import Document
from megacpp.data.pipeline import Drop, StageStats, Step, require_text
from megacpp.errors import ConfigError

_P = np.uint64(0x100000001B3)  # odd, so invertible mod 2^64 (the 64-bit FNV prime)
_P_INV = np.uint64(pow(int(_P), -1, 1 << 64))
_Q = np.uint64(0x9E3779B97F4A7C15)  # combines token hashes into a shingle hash
_BLOCK = 1024  # shingles per block of the [shingles, num_perm] MinHash product
WINDOW_BYTES = 4 << 20  # a larger source is lexed and hashed a window at a time
BATCH_BYTES = 1 << 20  # NearDedup lexes and hashes documents in batches of about this size


def _fmix64(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finalizer (an avalanching bijection), elementwise on uint64."""
    h = h ^ (h >> np.uint64(33))
    h = h * np.uint64(0xFF51AFD7ED558CCD)
    h = h ^ (h >> np.uint64(33))
    h = h * np.uint64(0xC4CEB9FE1A85EC53)
    return h ^ (h >> np.uint64(33))


def _fmix32(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 32-bit finalizer, elementwise on uint32 (datasketch pre-mixes with it)."""
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


class _Powers:
    """``P**i`` and ``P**-i`` mod 2^64 for ``i < n``, grown on demand and shared."""

    def __init__(self) -> None:
        self.forward = np.ones(1, dtype=np.uint64)
        self.inverse = np.ones(1, dtype=np.uint64)

    def get(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if self.forward.shape[0] < n:
            size = max(n, 2 * self.forward.shape[0])
            self.forward = self._cumulative_powers(_P, size)
            self.inverse = self._cumulative_powers(_P_INV, size)
        return self.forward[:n], self.inverse[:n]

    @staticmethod
    def _cumulative_powers(base: np.uint64, size: int) -> np.ndarray:
        factors = np.full(size, base, dtype=np.uint64)
        factors[0] = 1
        return np.cumprod(factors, dtype=np.uint64)  # wraps mod 2^64


_POWERS = _Powers()


def _combine(token: np.ndarray, width: int) -> np.ndarray:
    """Hashes of every ``width`` consecutive token hashes: uint64 ``[len(token) - width + 1]``."""
    count = token.shape[0] - width + 1
    shingle = token[:count].copy()
    for offset in range(1, width):
        shingle = shingle * _Q + token[offset : offset + count]
    return shingle


def _token_hashes(data: bytes, spans: cpp_lex.TokenSpans) -> np.ndarray:
    """uint64 ``[T]``: a hash of each token's bytes (independent of where the token is)."""
    forward, inverse = _POWERS.get(len(data))
    prefix = np.empty(len(data) + 1, dtype=np.uint64)  # [n+1]: sum of byte[j] * P**j, j < i
    prefix[0] = 0
    np.multiply(np.frombuffer(data, dtype=np.uint8), forward, out=prefix[1:])
    np.cumsum(prefix[1:], out=prefix[1:])
    token = (prefix[spans.ends] - prefix[spans.starts]) * inverse[spans.starts]
    return _fmix64(token ^ (spans.ends - spans.starts).astype(np.uint64))


def shingle_hashes_batch(
    sources: Sequence[bytes], shingle_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Distinct 32-bit shingle hashes of several sources at once: ``(hashes, offsets)``;
    source ``i``'s sorted hashes are ``hashes[offsets[i]:offsets[i + 1]]``.

    A source with fewer tokens than ``shingle_size`` is one shingle of all its tokens; one
    with no tokens (only comments/whitespace) has none. A source larger than
    :data:`WINDOW_BYTES` is lexed a window of lines at a time (:func:`_windowed_hashes`).
    """
    if any(len(source) > WINDOW_BYTES for source in sources):
        per_source = [_windowed_hashes(s, shingle_size) if len(s) > WINDOW_BYTES
                      else shingle_hashes_batch([s], shingle_size)[0] for s in sources]
        offsets = np.concatenate(([0], np.cumsum([len(h) for h in per_source])))
        return np.concatenate(per_source).astype(np.uint32), offsets
    batch = cpp_lex.token_spans_batch(sources)
    token = _token_hashes(batch.data, batch.spans)  # [T]
    per_source = np.diff(batch.token_offsets)  # [S] tokens of each source
    source_of_token = np.repeat(np.arange(len(sources)), per_source)  # [T]
    shingle, owner = np.zeros(0, np.uint64), np.zeros(0, np.int64)
    if token.shape[0] >= shingle_size:  # full shingles that stay inside one source
        shingle = _combine(token, shingle_size)
        owner = source_of_token[: shingle.shape[0]]
        inside = owner == source_of_token[shingle_size - 1 :]
        shingle, owner = shingle[inside], owner[inside]
    short = np.flatnonzero((per_source > 0) & (per_source < shingle_size))
    if short.size:  # rare: one shingle of all the source's tokens
        first = batch.token_offsets[short]
        extra = [_combine(token[f : f + n], n) for f, n in zip(first, per_source[short])]
        shingle = np.concatenate([shingle, *extra])
        owner = np.concatenate((owner, short))
    # The high half of the last multiply-add is well mixed; MinHasher mixes again (fmix32).
    # Sort by (source, hash) and keep distinct values: far cheaper than 128 permutations
    # of a repeat.
    keys = np.sort((owner.astype(np.uint64) << np.uint64(32)) | (shingle >> np.uint64(32)))
    keys = keys[np.concatenate((keys[:1] == keys[:1], keys[1:] != keys[:-1]))]  # distinct
    offsets = np.searchsorted(keys >> np.uint64(32), np.arange(len(sources) + 1))
    return (keys & np.uint64(0xFFFFFFFF)).astype(np.uint32), offsets


def _windowed_hashes(data: bytes, shingle_size: int) -> np.ndarray:
    """Distinct 32-bit shingle hashes of one large source, lexed a window of at most
    :data:`WINDOW_BYTES` at a time (cut after its last newline, or anywhere in a longer line), with
    the last ``shingle_size - 1`` token hashes carried into the next window so shingles across
    a cut still count. Memory follows the window, not the source (lexing a whole 50 MB file
    takes gigabytes). A token cut by a window boundary (a block comment or string across it,
    or any token of a hard cut) hashes as its two halves."""
    per_window: list[np.ndarray] = []  # distinct hashes of each window
    carry = np.zeros(0, dtype=np.uint64)  # [< shingle_size] the previous window's last tokens
    tokens_seen = 0
    start = 0
    while start < len(data):
        end = min(start + WINDOW_BYTES, len(data))
        if end < len(data):  # after the window's last newline, if it has one
            newline = data.rfind(b"\n", start, end)
            end = newline + 1 if newline >= 0 else end
        window = data[start:end]
        batch = cpp_lex.token_spans_batch([window])
        tokens_seen += len(batch.spans.starts)
        token = np.concatenate((carry, _token_hashes(batch.data, batch.spans)))  # [T]
        if token.shape[0] >= shingle_size:
            per_window.append(_distinct(
                (_combine(token, shingle_size) >> np.uint64(32)).astype(np.uint32)))
        carry = token[token.shape[0] - (shingle_size - 1):] if shingle_size > 1 else token[:0]
        start = end
    if per_window:
        return _distinct(np.concatenate(per_window))
    if tokens_seen:  # fewer tokens than a shingle: one shingle of them all
        return (_combine(carry, carry.shape[0]) >> np.uint64(32)).astype(np.uint32)
    return np.zeros(0, dtype=np.uint32)


def _distinct(values: np.ndarray) -> np.ndarray:
    """Sorted distinct ``values`` (by sorting: numpy's hash-based ``unique`` is slower here)."""
    values = np.sort(values)
    return values[np.concatenate((values[:1] == values[:1], values[1:] != values[:-1]))]


def shingle_hashes(data: bytes, shingle_size: int) -> np.ndarray:
    """Distinct 32-bit shingle hashes of one source (see :func:`shingle_hashes_batch`)."""
    return shingle_hashes_batch([data], shingle_size)[0]


class MinHasher:
    """Computes datasketch-compatible ``affine32`` MinHash signatures with numpy."""

    scheme = "affine32"

    def __init__(self, num_perm: int, seed: int) -> None:
        self.num_perm = num_perm
        self.seed = seed
        self.permutations = MinHash(num_perm=num_perm, seed=seed, scheme=self.scheme).permutations
        self._a = self.permutations[0].astype(np.uint32)  # [num_perm]
        self._b = self.permutations[1].astype(np.uint32)  # [num_perm]
        self._product = np.empty((_BLOCK, num_perm), dtype=np.uint32)  # reused scratch

    def signatures(self, hashes: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """uint32 ``[num_sets, num_perm]`` MinHashes of sets given by their uint32 element
        hashes: set ``i`` is ``hashes[offsets[i]:offsets[i + 1]]`` (an empty set's row stays
        at the maximum value)."""
        num_sets = offsets.shape[0] - 1
        out = np.full((num_sets, self.num_perm), np.iinfo(np.uint32).max, dtype=np.uint32)
        mixed = _fmix32(hashes.astype(np.uint32))
        owner = np.repeat(np.arange(num_sets), np.diff(offsets))  # [len(hashes)]
        for begin in range(0, mixed.shape[0], _BLOCK):
            block = mixed[begin : begin + _BLOCK, None]  # [rows, 1]
            rows = self._product[: block.shape[0]]  # [rows, num_perm]
            np.multiply(block, self._a, out=rows)
            np.add(rows, self._b, out=rows)  # wraps mod 2^32, as datasketch's affine32
            block_owner = owner[begin : begin + block.shape[0]]
            cuts = np.flatnonzero(block_owner[1:] != block_owner[:-1]) + 1
            bounds = [0, *cuts.tolist(), block.shape[0]]  # a few sets per block
            for lo, hi in itertools.pairwise(bounds):  # min over rows is fast, reduceat is not
                target = out[block_owner[lo]]
                np.minimum(target, rows[lo:hi].min(axis=0), out=target)
        return out

    def signature(self, hashes: np.ndarray) -> np.ndarray:
        """uint32 ``[num_perm]`` MinHash of one set given by its uint32 element hashes."""
        return self.signatures(hashes, np.array([0, hashes.shape[0]]))[0]

    def to_minhash(self, signature: np.ndarray) -> MinHash:
        return MinHash(
            seed=self.seed,
            hashvalues=signature,
            permutations=self.permutations,
            scheme=self.scheme,
        )


_ASCII_SPACE = re.compile(rb"[ \t\n\r\x0b\x0c]")  # what bytes.split() splits at
_DIGEST_CHUNK = 1 << 20


def normalized_text_digest(text: str) -> bytes:
    """sha256 of ``text`` (UTF-8) with every run of ASCII whitespace collapsed to one space
    and the ends stripped. Splitting bytes runs at C speed, unlike ``str.split``; it runs on
    about 1 MiB at a time, cut at whitespace, so a huge document costs no more than its
    bytes (one list of words of a 50 MB file is gigabytes)."""
    data = text.encode("utf-8", "surrogatepass")
    digest, start, separator = hashlib.sha256(), 0, b""
    while start < len(data):
        cut = _ASCII_SPACE.search(data, min(start + _DIGEST_CHUNK, len(data)))
        end = cut.start() if cut else len(data)
        words = data[start:end].split()
        if words:
            digest.update(separator + b" ".join(words))
            separator = b" "
        start = end + (cut is not None)
    return digest.digest()


@dataclass(frozen=True)
class DuplicateRecord:
    """A dropped duplicate and the kept document it duplicates."""

    dropped: str  # source_root/rel_path of the dropped document
    kept: str  # source_root/rel_path of the kept document
    kept_doc_id: str
    similarity: float  # 1.0 for exact duplicates, the MinHash Jaccard estimate otherwise


def _batches(docs: Iterable[Document], max_bytes: int) -> Iterator[list[Document]]:
    """Consecutive documents, about ``max_bytes`` of source per batch (at least one each)."""
    batch: list[Document] = []
    size = 0
    for doc in docs:
        batch.append(doc)
        size += doc.size
        if size >= max_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _location(doc: Document) -> str:
    return f"{doc.source_root.rstrip('/')}/{doc.rel_path}"


def _provenance(doc: Document) -> Document:
    """A text-free copy of a kept document's identity (dedup indexes must not pin texts)."""
    return Document(doc.source_root, doc.rel_path, doc.size, doc.sha256)


class ExactDedup(Step):
    """Drops documents whose whitespace-normalized text was seen before (``exact_duplicate``)."""

    name = "exact_dedup"

    def __init__(self) -> None:
        self._kept: dict[bytes, Document] = {}
        self.duplicates: list[DuplicateRecord] = []

    def process(self, doc: Document, stats: StageStats) -> Document | Drop:
        digest = normalized_text_digest(require_text(doc, self.name))
        kept = self._kept.get(digest)
        if kept is None:
            self._kept[digest] = _provenance(doc)
            return doc
        doc.meta["duplicate_of"] = kept.doc_id
        self.duplicates.append(DuplicateRecord(_location(doc), _location(kept), kept.doc_id, 1.0))
        return Drop("exact_duplicate")


def validate_near_dedup(
    num_perm: int, bands: int, rows: int, threshold: float, shingle_size: int
) -> None:
    """Raise :class:`ConfigError` for MinHash/LSH parameters that cannot work."""
    for name, value in (("num_perm", num_perm), ("bands", bands), ("rows", rows),
                        ("shingle_size", shingle_size)):  # fmt: skip
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"near dedup {name}: expected a positive integer, got {value!r}")
    if bands * rows > num_perm:
        raise ConfigError(
            f"near dedup bands x rows = {bands} x {rows} = {bands * rows} exceeds "
            f"num_perm = {num_perm}; choose bands * rows <= num_perm"
        )
    if not 0.0 < threshold <= 1.0:
        raise ConfigError(f"near dedup threshold: expected 0 < threshold <= 1, got {threshold!r}")


class BandIndex:
    """LSH over MinHash signatures: the integer keys of the inserted signatures that share at
    least one whole band (``rows`` consecutive values; bands ``0..bands-1`` from the start)
    with a query. The candidates ``datasketch.MinHashLSH(params=(bands, rows))`` returns for
    the same signatures, without its per-band overhead: one dict per band, keyed by the
    band's bytes (equal bytes <=> equal values, so no false or missed candidates)."""

    def __init__(self, bands: int, rows: int) -> None:
        self.bands = bands
        self.rows = rows
        self._tables: list[dict[bytes, list[int]]] = [{} for _ in range(bands)]

    def _band_keys(self, signature: np.ndarray) -> list[bytes]:
        data = np.ascontiguousarray(signature[: self.bands * self.rows], np.uint32).tobytes()
        width = 4 * self.rows
        return [data[i : i + width] for i in range(0, len(data), width)]

    def query(self, signature: np.ndarray) -> set[int]:
        """Keys of the inserted signatures sharing a band with ``signature`` (uint32[num_perm])."""
        found: set[int] = set()
        for table, band in zip(self._tables, self._band_keys(signature)):
            keys = table.get(band)
            if keys is not None:
                found.update(keys)
        return found

    def insert(self, key: int, signature: np.ndarray) -> None:
        for table, band in zip(self._tables, self._band_keys(signature)):
            table.setdefault(band, []).append(key)


class NearDedup(Step):
    """MinHash + LSH near-duplicate removal (``near_duplicate``); see the module docstring."""

    name = "near_dedup"

    def __init__(
        self,
        num_perm: int = 128,
        bands: int = 16,
        rows: int = 8,
        threshold: float = 0.8,
        shingle_size: int = 5,
        seed: int = 1,
    ) -> None:
        validate_near_dedup(num_perm, bands, rows, threshold, shingle_size)
        self.threshold = threshold
        self.shingle_size = shingle_size
        self._hasher = MinHasher(num_perm, seed)
        self._lsh = BandIndex(bands, rows)
        self._kept: list[Document] = []
        self._signatures = np.zeros((64, num_perm), dtype=np.uint32)  # [capacity, num_perm]
        self._queued: deque[np.ndarray | None] = deque()  # signatures of the current batch
        self.batch_bytes = BATCH_BYTES
        self.duplicates: list[DuplicateRecord] = []

    def signatures(self, texts: Sequence[str]) -> list[np.ndarray | None]:
        """MinHash signatures of documents (None for one without tokens), computed together."""
        sources = [text.encode("utf-8", "surrogatepass") for text in texts]
        hashes, offsets = shingle_hashes_batch(sources, self.shingle_size)
        signatures = self._hasher.signatures(hashes, offsets)
        return [sig if n else None for sig, n in zip(signatures, np.diff(offsets))]

    def run(self, docs: Iterable[Document], stats: StageStats) -> Iterator[Document]:
        """Like :meth:`Step.run`, but signatures are computed a batch of documents at a time
        (one set of numpy calls per batch, not per file); decisions stay in stream order."""
        for batch in _batches(docs, self.batch_bytes):
            texts = [require_text(doc, self.name) for doc in batch]
            self._queued.extend(self.signatures(texts))
            try:
                yield from super().run(batch, stats)  # process() takes them in order
            finally:  # a consumer that stops early must not leave stale signatures
                self._queued.clear()

    def process(self, doc: Document, stats: StageStats) -> Document | Drop:
        if self._queued:
            signature = self._queued.popleft()
        else:
            signature = self.signatures([require_text(doc, self.name)])[0]
        if signature is None:
            stats.notes["no_tokens"] += 1
            return doc
        match = self._best_match(signature)
        if match is not None:
            kept, similarity = match
            doc.meta["near_duplicate_of"] = kept.doc_id
            doc.meta["near_duplicate_similarity"] = similarity
            self.duplicates.append(
                DuplicateRecord(_location(doc), _location(kept), kept.doc_id, similarity)
            )
            return Drop("near_duplicate")
        self._remember(doc, signature)
        return doc

    def _best_match(self, signature: np.ndarray) -> tuple[Document, float] | None:
        found = self._lsh.query(signature)
        if not found:
            return None
        candidates = np.array(sorted(found), dtype=np.int64)
        similarity = (self._signatures[candidates] == signature).mean(axis=1)  # [candidates]
        best = int(np.argmax(similarity))  # first (earliest kept) among equals
        if similarity[best] < self.threshold:
            return None
        return self._kept[int(candidates[best])], float(similarity[best])

    def _remember(self, doc: Document, signature: np.ndarray) -> None:
        key = len(self._kept)
        if key == self._signatures.shape[0]:
            self._signatures = np.concatenate((self._signatures, np.zeros_like(self._signatures)))
        self._signatures[key] = signature
        self._kept.append(_provenance(doc))
        self._lsh.insert(key, signature)
