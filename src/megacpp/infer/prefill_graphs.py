"""Prefill chunks as replayed CUDA graphs: first chunks one per (batch, length) bucket
(:class:`PrefillGraphs`), continuation chunks one per (batch, length, width) bucket
(:class:`ContinuationGraphs`).

Eager prefill of a short prompt is launch-bound: each of the model's blocks launches tens of
small kernels whatever the chunk's length, so a 128-token prompt costs about as much host
time as a 2k-token one. Capturing the prefill forward for fixed shapes turns those thousands
of launches into one graph replay. CUDA graphs, not ``torch.compile``: the catalog's Triton
kernels (scans, grouped MoE GEMMs) already fuse the heavy work, the remaining cost is launch
overhead, and graphs remove it without compile time or recompiles across bucket shapes.

Which chunks: a chunk that starts a sequence (``start == 0``: a prompt's first chunk, or a
preempted sequence's recompute) of at most ``max_len`` tokens. Chunks of any lengths share
one replay: ``B`` chunks whose longest has ``L`` tokens run the graph of the smallest bucket
``(b >= B, l >= L)`` -- batch sizes as the decode graphs' (1, 2, 4, 8, then multiples of 8),
lengths powers of two from 16 -- while ``b * l <= max_tokens`` (longer work is
compute-bound, so it runs eagerly). Continuation chunks (``start > 0``) take the
:class:`ContinuationGraphs` (right padding, below).

Padding goes *before* each row's tokens (left padding), so every row's last token sits at
the last index (its logits are read there) and:

* padding tokens feed token 0 at position 0 and write their cache entries into the scratch
  block; a row's real tokens keep positions ``0..n-1`` and their own blocks, so attention
  never sees a padding key (causal mask by position over the row's block table);
* padding is document 0 and the prompt document 1 (``PagedBatch.doc_ids``): M and R reset
  at the prompt's first token (state, trapezoid term and conv inputs dropped), so no
  padding reaches a row's final state; every row starts from the empty state
  (``PagedBatch.fresh``), so the slots are not read or checked. Mamba-3's cumulative
  rotation angle does advance over the padding: a common offset of every later token's
  angle, which cancels in each interaction (they depend only on angle differences);
* padding rows (batch up to the bucket) write into the scratch block and scratch slot.

Graphs are captured lazily on first use (:meth:`PrefillGraphs.capture_all` captures every
bucket up front) and share one memory pool with the continuation graphs (the model runner
gives both one; the two never replay at once), apart from the decode graphs' pool.

The eager path (unpadded, grouped by equal length, :meth:`HybridLM.forward_paged`) is the
reference the padded replay is tested against (``tests/infer/test_prefill_graphs.py``, CPU
and CUDA; ``tests/infer/test_prefill_graphs_continuation.py`` for continuations). A model
with a hashed n-gram branch prefills its first chunks eagerly (its n-gram windows would span
the left padding; right padding does not enter them, so its continuations take the graphs).
The model runner keeps chunks that want prompt logprobs (every position's logits) or an MTP
draft (speculative decoding reads the main stack's hidden states) on the eager path, and so
are chunks longer than the largest length bucket.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from megacpp.errors import MegaCppError
from megacpp.infer.cache_manager import CacheManager
from megacpp.infer.graphs import (
    StaticInputs,
    batch_buckets,
    bucket,
    capture_step,
    width_buckets,
)
from megacpp.infer.scheduler import ScheduledRequest
from megacpp.model.cache import PagedBatch
from megacpp.model.model import HybridLM

MIN_LENGTH = 16  # the smallest length bucket


def length_buckets(max_len: int) -> list[int]:
    """16, 32, 64, ... below ``max_len``, then ``max_len``."""
    sizes, n = [], MIN_LENGTH
    while n < max_len:
        sizes.append(n)
        n *= 2
    return [*sizes, max_len]


def supports_prefill_graphs(model: HybridLM) -> bool:
    """Whether a model's first chunks can be left-padded (not with a hashed n-gram branch)."""
    return model.ngram_embed is None


class _ChunkGraphs:
    """What the first-chunk and continuation graphs share: the batch and length buckets
    (``b * l <= max_tokens``), grouping chunks into buckets, and capturing one forward."""

    what = "prefill"  # the graphs' name in error messages

    def __init__(self, model: HybridLM, cache: CacheManager, max_batch: int, max_len: int,
                 max_tokens: int, capture: bool) -> None:
        self.model, self.cache, self.capture = model, cache, capture
        self.max_tokens = max_tokens
        self.lengths = [n for n in length_buckets(max_len) if n <= max_tokens]
        if not self.lengths:
            raise MegaCppError(f"{self.what} graphs: max_tokens {max_tokens} is below the "
                               f"smallest length bucket {MIN_LENGTH}")
        self.max_len = self.lengths[-1]
        self.batches = batch_buckets(max_batch)
        self.uses_structure = model.structure_embed is not None
        self.pool = None  # the graphs' memory pool (the runner gives both families one)

    def groups(self, chunks: Iterable[ScheduledRequest]) -> list[list[ScheduledRequest]]:
        """``chunks`` (all ``takes``), shortest first, cut into groups whose bucket holds at
        most ``max_tokens`` tokens (similar lengths together: little padding)."""
        return _groups_within(chunks, self._fits)

    def _fits(self, rows: int, n: int) -> bool:
        if rows > self.batches[-1]:
            return False
        return bucket(self.batches, rows) * bucket(self.lengths, n) <= self.max_tokens

    @torch.no_grad()
    def _capture_forward(self, ids: torch.Tensor, batch: PagedBatch, bucket_name: str
                         ) -> tuple[object, torch.Tensor]:
        """Capture the paged forward of ``ids`` over the static ``batch`` -> (graph, logits)."""
        layers = self.cache.layers
        try:
            graph, out, self.pool = capture_step(
                lambda: self.model.forward_paged(ids, layers, batch), self.cache.device,
                self.pool, self.capture)
        except RuntimeError as exc:  # a host sync in the forward (e.g. a reference kernel)
            raise MegaCppError(
                f"capturing the {self.what} forward of bucket {bucket_name} failed ({exc}); "
                "serve with --no-prefill-graphs, or with kernels that do not sync the host"
            ) from exc
        return graph, out


class PrefillGraphs(_ChunkGraphs):
    """Captures and replays first prefill chunks; see the module docstring."""

    def __init__(
        self,
        model: HybridLM,
        cache: CacheManager,
        max_batch: int,
        max_len: int,
        max_tokens: int,
        capture: bool = True,
    ) -> None:
        if not supports_prefill_graphs(model):
            raise MegaCppError("prefill graphs: a model with a hashed n-gram branch prefills "
                               "eagerly (its n-gram windows would span the padding)")
        super().__init__(model, cache, max_batch, max_len, max_tokens, capture)
        self.graphs: dict[tuple[int, int], tuple[object, torch.Tensor]] = {}
        self.inputs: dict[tuple[int, int], StaticInputs] = {}  # one per bucket
        self.buckets_used: set[tuple[int, int]] = set()

    # -- which chunks ----------------------------------------------------------------------------
    def takes(self, chunk: ScheduledRequest) -> bool:
        """A chunk that starts its sequence and fits the largest length bucket."""
        return chunk.start == 0 and len(chunk.token_ids) <= self.max_len

    # -- replay ----------------------------------------------------------------------------------
    def run(self, chunks: list[ScheduledRequest]) -> torch.Tensor:
        """Logits [len(chunks), V] at each chunk's last token (a view into the graph's output
        buffer, valid until the next call)."""
        B, L = len(chunks), max(len(c.token_ids) for c in chunks)
        if not all(self.takes(c) for c in chunks) or not self._fits(B, L):
            raise ValueError(f"prefill graphs: {B} chunks of up to {L} tokens (or a chunk that "
                             "does not start its sequence) fit no bucket")
        b, n = bucket(self.batches, B), bucket(self.lengths, L)
        graph, out = self._graph(b, n)  # capture first: it fills the buffers with padding
        self.buckets_used.add((b, n))
        self._stage(self.inputs[(b, n)], n, chunks)
        graph.replay()
        return out[:B]

    def _stage(self, inputs: StaticInputs, n: int, chunks: list[ScheduledRequest]) -> None:
        """Write the chunks, left-padded to ``n`` tokens, into the bucket's buffers (padding
        elsewhere)."""
        inputs.pad()
        bs, width = self.cache.block_size, self._width(n)
        ids, positions, doc_ids, slots, structure = (
            inputs.host(name).reshape(-1, n)
            for name in ("ids", "positions", "doc_ids", "slot_mapping", "structure"))
        tables, state_slots = inputs.host("tables").reshape(-1, width), inputs.host("state_slots")
        for i, chunk in enumerate(chunks):
            k = len(chunk.token_ids)
            pad = n - k
            table = np.asarray(chunk.block_table[:width], dtype=np.int64)
            pos = np.arange(k, dtype=np.int64)
            ids[i, pad:] = chunk.token_ids
            positions[i, pad:] = pos
            doc_ids[i, pad:] = 1
            slots[i, pad:] = table[pos // bs] * bs + pos % bs
            tables[i, : len(table)] = table
            state_slots[i] = chunk.state_slot
            if self.uses_structure:
                structure[i, pad:] = chunk.structure_ids
        inputs.upload()

    def _width(self, n: int) -> int:
        """Blocks in a row's table for an ``n``-token bucket."""
        return -(-n // self.cache.block_size)

    def _new_inputs(self, b: int, n: int) -> StaticInputs:
        """A (b, n) bucket's static inputs: padding is token 0 at position 0 in document 0
        (structure OTHER), writing into the scratch block and slot."""
        c, width = self.cache, self._width(n)
        sizes = {"ids": b * n, "positions": b * n, "doc_ids": b * n, "slot_mapping": b * n,
                 "tables": b * width, "state_slots": b,
                 "structure": b * n if self.uses_structure else 0}
        pads = {"ids": 0, "positions": 0, "doc_ids": 0, "structure": 0,
                "slot_mapping": c.null_block * c.block_size, "tables": c.null_block,
                "state_slots": c.null_slot}
        return StaticInputs(sizes, pads, c.device)

    def _batch(self, inputs: StaticInputs, n: int) -> PagedBatch:
        dev = inputs.dev
        return PagedBatch(
            positions=dev("positions").view(-1, n),
            slot_mapping=dev("slot_mapping"),
            block_tables=dev("tables").view(-1, self._width(n)),
            state_slots=dev("state_slots"),
            structure_ids=dev("structure").view(-1, n) if self.uses_structure else None,
            doc_ids=dev("doc_ids").view(-1, n),
            fresh=True,
        )

    # -- capture ---------------------------------------------------------------------------------
    def capture_all(self) -> None:
        """Capture every bucket now (largest first, so smaller ones reuse its memory)."""
        for b in reversed(self.batches):
            for n in reversed(self.lengths):
                if b * n <= self.max_tokens:
                    self._graph(b, n)

    def _graph(self, b: int, n: int) -> tuple[object, torch.Tensor]:
        if (b, n) not in self.graphs:
            self.inputs[(b, n)] = self._new_inputs(b, n)
            self.graphs[(b, n)] = self._capture(b, n)
        return self.graphs[(b, n)]

    def _capture(self, b: int, n: int) -> tuple[object, torch.Tensor]:
        inputs = self.inputs[(b, n)]
        inputs.pad()  # warm-up and capture runs touch only the scratch block/slot
        inputs.upload(blocking=True)
        return self._capture_forward(inputs.dev("ids").view(b, n), self._batch(inputs, n),
                                     f"{b} x {n}")


class ContinuationGraphs(_ChunkGraphs):
    """Captures and replays continuation chunks (``start > 0``): the chunk after a prefix-cache
    hit, after a snapshot cut, a later chunk of a long prompt.

    ``B`` chunks whose longest has ``L`` tokens and whose furthest ends in block ``W`` run the
    graph of the smallest bucket ``(b >= B, l >= L, w >= W)`` -- the prefill graphs' batch and
    length buckets, the decode graphs' width buckets (:mod:`megacpp.infer.graphs`) -- while
    ``b * l <= max_tokens``. The attention reads each row's earlier KV blocks through its
    block table (masked by position), and M/R continue from the row's slot
    (``PagedBatch.continues``: no host-side zero check).

    Padding goes *after* each row's tokens (right padding): a row's real tokens keep their
    positions ``start..end-1`` and their blocks, and the logits are read at its last real
    token (``PagedBatch.last_index``). Padding tokens are token 0 at the row's last real
    position (their queries see the real token's keys: finite), writing their cache entries
    into the scratch block; M and R keep the state the last real token left (Mamba-3: step
    size 0 and the last real k, v; gated delta: no decay, no write, the conv tail taken at the
    last real token). Padding rows write into the scratch block and scratch slot.

    All buckets share one :class:`~megacpp.infer.graphs.StaticInputs` (``max_tokens``
    tokens, ``max_batch`` block tables of ``max_width`` blocks) and one memory pool (the
    first-chunk graphs' when the runner passes it). A graph holds its output and its share of
    the pool: the largest bucket's activations, about an eager forward of ``max_tokens``
    tokens against ``max_width * block_size`` keys.
    """

    what = "continuation"

    def __init__(
        self,
        model: HybridLM,
        cache: CacheManager,
        max_batch: int,
        max_len: int,
        max_tokens: int,
        capture: bool = True,
    ) -> None:
        super().__init__(model, cache, max_batch, max_len, max_tokens, capture)
        self.max_width = -(-max_len // cache.block_size)
        self.widths = width_buckets(self.max_width)
        self.context_len = 0 if model.ngram_embed is None else model.ngram_embed.context_len
        n, T, C = max_batch, max_tokens, self.context_len
        sizes = {"ids": T, "positions": T, "slot_mapping": T, "structure": T if
                 self.uses_structure else 0, "tables": n * self.max_width, "state_slots": n,
                 "last_index": n, "ngram": n * C}
        pads = {"ids": 0, "positions": 0,  # token 0 at position 0
                "slot_mapping": cache.null_block * cache.block_size,  # the scratch block
                "structure": 0, "tables": cache.null_block, "state_slots": cache.null_slot,
                "last_index": 0, "ngram": -1}  # no previous tokens
        self.inputs = StaticInputs(sizes, pads, cache.device)
        self.graphs: dict[tuple[int, int, int], tuple[object, torch.Tensor]] = {}
        self.buckets_used: set[tuple[int, int, int]] = set()

    # -- which chunks ----------------------------------------------------------------------------
    def takes(self, chunk: ScheduledRequest) -> bool:
        """A chunk that continues its sequence and fits the largest length bucket."""
        return chunk.start > 0 and len(chunk.token_ids) <= self.max_len

    def _width(self, chunks: list[ScheduledRequest]) -> int:
        return -(-max(c.end for c in chunks) // self.cache.block_size)

    # -- replay ----------------------------------------------------------------------------------
    def run(self, chunks: list[ScheduledRequest]) -> torch.Tensor:
        """Logits [len(chunks), V] at each chunk's last token (a view into the graph's output
        buffer, valid until the next call)."""
        B, L, W = len(chunks), max(len(c.token_ids) for c in chunks), self._width(chunks)
        if not all(self.takes(c) for c in chunks) or not self._fits(B, L) or W > self.max_width:
            raise ValueError(f"continuation graphs: {B} chunks of up to {L} tokens over {W} "
                             "blocks (or a chunk that starts its sequence) fit no bucket")
        b, n, w = bucket(self.batches, B), bucket(self.lengths, L), bucket(self.widths, W)
        graph, out = self._graph(b, n, w)  # capture first: it fills the buffers with padding
        self.buckets_used.add((b, n, w))
        self._stage(chunks, n)
        graph.replay()
        return out[:B]

    def _stage(self, chunks: list[ScheduledRequest], n: int) -> None:
        """Write the chunks, right-padded to ``n`` tokens, into the static buffers."""
        inputs, bs = self.inputs, self.cache.block_size
        inputs.pad()
        ids, positions = inputs.host("ids")[: len(chunks) * n], inputs.host("positions")
        slots, structure = inputs.host("slot_mapping"), inputs.host("structure")
        tables = inputs.host("tables").reshape(-1, self.max_width)
        for i, chunk in enumerate(chunks):
            k, lo = len(chunk.token_ids), i * n
            pos = np.arange(chunk.start, chunk.end, dtype=np.int64)
            table = np.asarray(chunk.block_table[: self.max_width], dtype=np.int64)
            ids[lo : lo + k] = chunk.token_ids
            positions[lo : lo + k] = pos
            positions[lo + k : lo + n] = chunk.end - 1  # padding: the last real position
            slots[lo : lo + k] = table[pos // bs] * bs + pos % bs
            tables[i, : len(table)] = table
            if self.uses_structure:
                structure[lo : lo + k] = chunk.structure_ids
        B = len(chunks)
        inputs.host("state_slots")[:B] = [c.state_slot for c in chunks]
        inputs.host("last_index")[:B] = [len(c.token_ids) - 1 for c in chunks]
        if self.context_len:
            context = inputs.host("ngram").reshape(-1, self.context_len)
            for i, chunk in enumerate(chunks):
                before = chunk.history[max(0, chunk.start - self.context_len) : chunk.start]
                context[i] = [-1] * (self.context_len - len(before)) + before
        inputs.upload()

    def _batch(self, b: int, n: int, w: int) -> PagedBatch:
        """The (b, n, w) bucket's view of the static buffers."""
        dev, C = self.inputs.dev, self.context_len
        return PagedBatch(
            positions=dev("positions")[: b * n].view(b, n),
            slot_mapping=dev("slot_mapping")[: b * n],
            block_tables=dev("tables").view(-1, self.max_width)[:b, :w],
            state_slots=dev("state_slots")[:b],
            last_index=dev("last_index")[:b],
            structure_ids=dev("structure")[: b * n].view(b, n) if self.uses_structure else None,
            ngram_context=dev("ngram").view(-1, C)[:b] if C else None,
            continues=True,
        )

    # -- capture ---------------------------------------------------------------------------------
    def capture_all(self) -> None:
        """Capture every bucket now (largest first, so smaller ones reuse its memory): batch x
        length x width buckets, as many as fit ``max_tokens``."""
        for b in reversed(self.batches):
            for n in reversed(self.lengths):
                for w in reversed(self.widths):
                    if b * n <= self.max_tokens:
                        self._graph(b, n, w)

    def _graph(self, b: int, n: int, w: int) -> tuple[object, torch.Tensor]:
        if (b, n, w) not in self.graphs:
            self.graphs[(b, n, w)] = self._capture(b, n, w)
        return self.graphs[(b, n, w)]

    def _capture(self, b: int, n: int, w: int) -> tuple[object, torch.Tensor]:
        self.inputs.pad()  # warm-up and capture runs touch only the scratch block/slot
        self.inputs.upload(blocking=True)
        return self._capture_forward(self.inputs.dev("ids")[: b * n].view(b, n),
                                     self._batch(b, n, w), f"{b} x {n} x {w} blocks")


def _groups_within(chunks: Iterable[ScheduledRequest], fits) -> list[list[ScheduledRequest]]:
    """``chunks`` shortest first, cut into groups for which ``fits(rows, longest)`` holds
    (similar lengths together: little padding)."""
    out: list[list[ScheduledRequest]] = []
    group: list[ScheduledRequest] = []
    longest = 0
    for chunk in sorted(chunks, key=lambda c: len(c.token_ids)):
        n = max(longest, len(chunk.token_ids))
        if group and not fits(len(group) + 1, n):
            out.append(group)
            group, n = [], len(chunk.token_ids)
        group.append(chunk)
        longest = n
    if group:
        out.append(group)
    return out
