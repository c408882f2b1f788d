"""Prefix caching for the hybrid model: reuse the KV blocks and recurrent-state snapshots of
earlier requests whose prompts start with the same tokens.

**Attention (A, MLA, DSA).** Every full block of a prompt gets a hash chained over the
blocks before it: ``sha256(parent hash | the block's token ids | its structure ids)``, so one
hash names a whole prefix. Once a block's tokens are computed, the hash maps to the block.
Blocks carry a reference count (the running sequences whose tables hold them); a block whose
count drops to 0 stays cached in the free queue until an allocation needs it. The free queue
is in eviction order: blocks that hold no hash go first, cached blocks are evicted least
recently freed first, and a freed sequence's blocks are queued last block first, so a chain
loses its tail before its head (a block is useless without its parent).

**Recurrent layers (M, R).** A Mamba-3 or gated-delta layer's state (its conv tail and
the trapezoid's previous k, v included) after position ``b`` cannot be rebuilt from KV blocks,
so the cache keeps *snapshots*: copies of every M/R layer's slot row, keyed by the hash of the
block that ends at ``b``. After every prefill chunk that ends on a block boundary (one that
``prefill_chunk`` ended, a prompt's end when it falls on one) the slot is copied into a
snapshot row, in one batched copy per step. A sequence whose first block was found cached or
equals a waiting request's -- it shares a prefix, so more sharing is likely -- also has its
chunks cut at a grid of ``snapshot_interval`` tokens and at its prompt's last block boundary
before its last token (when that lies in the first interval or a quarter interval or more
past the grid point before it), so later requests find snapshots where their prompts diverge
from it or repeat it.
A sequence that shares nothing is never cut: cold traffic pays no extra forward. A snapshot
per block would cut prefill into block-sized chunks. Snapshot rows are a fixed pool, evicted
least recently used; a snapshot is dropped with the block it is keyed by.

**A hit.** A new request walks its prompt's block hashes (at most up to the block boundary
before its last token, which must run to give the first token's logits) while they are
cached. A model with M/R layers then backs off to the longest of those prefixes that has a
snapshot. The request's block table starts with the hit blocks (their counts go up), its slot
starts from the snapshot, and prefill runs from there. Without M/R layers no snapshots are
needed and nothing is cut.

**Requests arriving together.** A waiting request whose first uncached block is being
computed by a running sequence (a burst of prompts with one file prefix) is not admitted until
that sequence has computed it: it then starts from the cache instead of computing the prefix
a second time in the same steps. Admission stays first come, first served.

Only prompt blocks (and the recomputed tokens of a preempted sequence) are hashed; blocks
filled while decoding are not.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from megacpp.errors import MegaCppError
from megacpp.model.cache import gather_state, scatter_state

ROOT_HASH = b""  # the parent of a prompt's first block


def block_hash(parent: bytes, tokens: list[int], extra: list[int] | None = None) -> bytes:
    """The chained hash of one full block: its parent's hash, its token ids and (a
    structure-embedding model) its tokens' structure ids."""
    digest = hashlib.sha256(parent)
    digest.update(array("q", tokens).tobytes())
    if extra is not None:
        digest.update(b"|")
        digest.update(array("q", extra).tobytes())
    return digest.digest()


def prompt_hashes(token_ids: list[int], extra: list[int] | None, block_size: int,
                  n_blocks: int, known: list[bytes] | None = None) -> list[bytes]:
    """The chained hashes of the first ``n_blocks`` full blocks of ``token_ids``; ``known``
    (hashes already computed for a prefix of them) is extended, not recomputed."""
    hashes = list(known or ())
    for i in range(len(hashes), n_blocks):
        lo, hi = i * block_size, (i + 1) * block_size
        parent = hashes[-1] if hashes else ROOT_HASH
        hashes.append(block_hash(parent, token_ids[lo:hi],
                                 None if extra is None else extra[lo:hi]))
    return hashes


class BlockPool:
    """Block ids ``0..total-1`` with reference counts and a free queue in eviction order (see
    the module docstring). ``on_evict(block)`` runs when a cached block is handed out again."""

    def __init__(self, total: int, on_evict: Callable[[int], None]) -> None:
        self.total, self.what = total, "KV blocks"
        self.refs = [0] * total
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(total))
        self.cached: set[int] = set()  # blocks whose hash is in the index
        self.on_evict = on_evict
        self.evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int = 1) -> list[int]:
        if n > len(self._free):
            raise MegaCppError(f"out of {self.what}: asked for {n}, {len(self._free)} free")
        out = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            if block in self.cached:
                self.cached.discard(block)
                self.evictions += 1
                self.on_evict(block)
            self.refs[block] = 1
            out.append(block)
        return out

    def touch(self, blocks: list[int]) -> None:
        """Take another reference to each of ``blocks`` (a prefix hit)."""
        for block in blocks:
            if self.refs[block] == 0:
                del self._free[block]
            self.refs[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each of ``blocks`` (a table in position order); blocks no one
        holds go to the free queue: uncached ones first in line, cached ones last, the
        table's last block before its first."""
        for block in reversed(blocks):
            self.refs[block] -= 1
            if self.refs[block] < 0:
                raise AssertionError(f"block {block} freed more often than taken")
            if self.refs[block] == 0:
                self._free[block] = None
                if block not in self.cached:
                    self._free.move_to_end(block, last=False)

    def num_free_after(self, blocks: list[int]) -> int:
        """Free blocks left once ``blocks`` are touched (those among them now free leave)."""
        return len(self._free) - sum(1 for b in set(blocks) if self.refs[b] == 0)


@dataclass(frozen=True)
class PrefixHit:
    """What a new sequence reuses: its first ``num_tokens`` tokens' cache entries live in
    ``blocks``, and (a model with M/R layers) their recurrent state in snapshot row
    ``snapshot`` (None: the empty prefix, or a model without M/R layers)."""

    num_tokens: int
    blocks: tuple[int, ...]
    snapshot: int | None
    hashes: tuple[bytes, ...]  # the prompt's full-block hashes computed for the lookup
    cached_blocks: int = 0  # leading blocks found cached (before backing off to a snapshot)


NO_HIT = PrefixHit(0, (), None, ())


class PrefixCache:
    """The hash index over a :class:`BlockPool`, the snapshot pool, and per-sequence
    bookkeeping; see the module docstring."""

    def __init__(self, *, num_blocks: int, block_size: int, state_pools: list[Any],
                 snapshot_pools: list[Any], snapshot_interval: int) -> None:
        self.block_size, self.snapshot_interval = block_size, snapshot_interval
        self.blocks = BlockPool(num_blocks, self._evicted)
        self.block_of: dict[bytes, int] = {}  # hash -> the cached block holding it
        self.hash_of: dict[int, bytes] = {}
        self.state_pools, self.snapshot_pools = state_pools, snapshot_pools
        self.recurrent = bool(state_pools)
        n_rows = _rows(snapshot_pools[0]) if snapshot_pools else 0
        self._free_rows = list(range(n_rows))
        self.snapshot_of: OrderedDict[bytes, int] = OrderedDict()  # LRU: oldest first
        self._to_copy: dict[int, int] = {}  # snapshot row -> the slot to copy at flush()
        self._to_restore: dict[int, int] = {}  # slot -> the snapshot row it starts from
        self.seq_hashes: dict[str, list[bytes]] = {}  # running sequence -> its block hashes
        self.sharing: set[str] = set()  # running sequences whose first block was cached
        self.in_progress: dict[bytes, int] = {}  # hash -> running sequences yet to compute it
        self._in_progress_span: dict[str, list[int]] = {}  # sequence -> [first, end) of its blocks
        #                                                  counted in ``in_progress``
        self.queried_tokens = self.hit_tokens = 0
        self.snapshot_evictions = 0

    # -- lookup ----------------------------------------------------------------------------------
    def match(self, token_ids: list[int], extra: list[int] | None,
              known: Sequence[bytes] = ()) -> PrefixHit:
        """The longest reusable prefix of a prompt (at most up to the block boundary before its
        last token; with M/R layers, one that has a snapshot). ``known``: the hashes of this
        prompt's first blocks from an earlier lookup (a waiting request is looked up every
        step until admitted; its tokens only grow, so they stay valid)."""
        limit = (len(token_ids) - 1) // self.block_size
        hashes = prompt_hashes(token_ids, extra, self.block_size, limit, list(known[:limit]))
        blocks = []
        for h in hashes:
            block = self.block_of.get(h)
            if block is None:
                break
            blocks.append(block)
        n = len(blocks)
        snapshot = None
        if self.recurrent:
            while n > 0 and hashes[n - 1] not in self.snapshot_of:
                n -= 1
            snapshot = self.snapshot_of[hashes[n - 1]] if n else None
        return PrefixHit(n * self.block_size, tuple(blocks[:n]), snapshot, tuple(hashes),
                         len(blocks))

    def admit(self, seq_id: str, hit: PrefixHit, prompt_len: int, slot: int | None) -> None:
        """Start ``seq_id`` from ``hit``: its blocks are referenced, its state slot ``slot``
        is to get the snapshot (``slot`` is needed only where ``hit`` has one; the copy runs
        in :meth:`restore`, with the step's other admissions), the lookup is counted."""
        self.blocks.touch(list(hit.blocks))
        if hit.snapshot is not None:
            if slot is None:
                raise AssertionError("a hit with a snapshot needs the sequence's slot")
            self.snapshot_of.move_to_end(hit.hashes[hit.num_tokens // self.block_size - 1])
            self._to_restore[slot] = hit.snapshot
        self.seq_hashes[seq_id] = list(hit.hashes)
        if hit.cached_blocks:
            self.sharing.add(seq_id)
        first = hit.num_tokens // self.block_size
        for h in hit.hashes[first:]:
            self.in_progress[h] = self.in_progress.get(h, 0) + 1
        self._in_progress_span[seq_id] = [first, len(hit.hashes)]
        self.queried_tokens += prompt_len
        self.hit_tokens += hit.num_tokens

    def in_flight(self, hit: PrefixHit) -> bool:
        """The first block of the prompt that is not cached is being computed by a running
        sequence: admitting now would compute it twice, waiting gives a longer hit."""
        n = hit.cached_blocks
        return n < len(hit.hashes) and hit.hashes[n] in self.in_progress

    def _progressed(self, seq_id: str, upto: int) -> None:
        """``seq_id``'s counted blocks before ``upto`` are computed (or never will be)."""
        span = self._in_progress_span.get(seq_id)
        if span is None:
            return
        hashes = self.seq_hashes[seq_id]
        while span[0] < min(upto, span[1]):
            h = hashes[span[0]]
            self.in_progress[h] -= 1
            if not self.in_progress[h]:
                del self.in_progress[h]
            span[0] += 1

    # -- filling ---------------------------------------------------------------------------------
    def expect_sharing(self, seq_id: str) -> None:
        """A waiting request starts with the same block as ``seq_id``: cut its chunks at
        snapshot boundaries (:meth:`chunk_end`) so the waiting one can start from a snapshot."""
        if seq_id in self.seq_hashes:
            self.sharing.add(seq_id)

    def chunk_end(self, seq_id: str, start: int, end: int, prefill_end: int) -> int:
        """``end`` cut at the first snapshot boundary after ``start``, for a sequence that
        shares its first block with a cached prompt or a waiting request (more sharing is
        likely), of a model with M/R layers: a multiple of ``snapshot_interval``, or the
        prompt's last block boundary before its last token when that lies in the first
        interval or a quarter interval or more past the grid point before it (closer, the
        grid's snapshot serves a repeat almost as well as an extra forward would). Other
        sequences are not cut: they pay no extra forward for snapshots nobody may ask for, and
        still leave one at each chunk end that falls on a block boundary."""
        if not self.recurrent or seq_id not in self.sharing:
            return end
        interval = self.snapshot_interval
        cuts = [(start // interval + 1) * interval]
        last = (prefill_end - 1) // self.block_size * self.block_size
        if last < interval or last % interval >= interval // 4:
            cuts.append(last)
        return min([c for c in cuts if start < c < end], default=end)

    def computed(self, seq_id: str, table: list[int], token_ids: list[int],
                 extra: list[int] | None, end: int, slot: int) -> None:
        """Tokens up to ``end`` of ``seq_id`` are in the caches (a prefill chunk ran): index
        its newly full blocks; on a block boundary, snapshot its state slot ``slot``."""
        n_full = end // self.block_size
        hashes = prompt_hashes(token_ids, extra, self.block_size, n_full,
                               self.seq_hashes.get(seq_id))
        self.seq_hashes[seq_id] = hashes
        self._progressed(seq_id, n_full)
        for i in range(n_full):
            h, block = hashes[i], table[i]
            if h not in self.block_of and block not in self.hash_of:
                self.block_of[h], self.hash_of[block] = block, h
                self.blocks.cached.add(block)
        if self.recurrent and n_full and end % self.block_size == 0:
            self._snapshot(hashes[n_full - 1], slot)

    def _snapshot(self, key: bytes, slot: int) -> None:
        """Keep slot ``slot``'s state as the snapshot of prefix ``key`` (copied at the next
        :meth:`flush`, before any forward changes the slot)."""
        if key not in self.block_of or not self.snapshot_pools:
            return
        if key in self.snapshot_of:
            self.snapshot_of.move_to_end(key)
            return
        if not self._free_rows:
            _, row = self.snapshot_of.popitem(last=False)
            self._to_copy.pop(row, None)
            self.snapshot_evictions += 1
            self._free_rows.append(row)
        row = self._free_rows.pop()
        self.snapshot_of[key] = row
        self._to_copy[row] = slot

    def flush(self, device: torch.device) -> None:
        """Copy the step's new snapshots out of their slots: one copy per state tensor."""
        if not self._to_copy:
            return
        rows = torch.tensor(list(self._to_copy), device=device)
        slots = torch.tensor(list(self._to_copy.values()), device=device)
        for state, snaps in zip(self.state_pools, self.snapshot_pools, strict=True):
            scatter_state(snaps, rows, gather_state(state, slots))
        self._to_copy.clear()

    def restore(self, device: torch.device) -> None:
        """Copy the snapshots the step's admissions start from into their slots: one gather
        and one scatter per state tensor for all of them (after :meth:`flush`, so a snapshot
        asked for by the last step is in its row). The hits' blocks are referenced, so their
        snapshot rows cannot be evicted before this runs."""
        if not self._to_restore:
            return
        self.flush(device)
        slots = torch.tensor(list(self._to_restore), device=device)
        rows = torch.tensor(list(self._to_restore.values()), device=device)
        for state, snaps in zip(self.state_pools, self.snapshot_pools, strict=True):
            scatter_state(state, slots, gather_state(snaps, rows))
        self._to_restore.clear()

    def forget_slot(self, slot: int) -> None:
        """``slot`` was released before :meth:`restore` ran: nothing to copy into it."""
        self._to_restore.pop(slot, None)

    def release(self, seq_id: str) -> None:
        self._progressed(seq_id, len(self.seq_hashes.get(seq_id, ())))
        self._in_progress_span.pop(seq_id, None)
        self.seq_hashes.pop(seq_id, None)
        self.sharing.discard(seq_id)

    def _evicted(self, block: int) -> None:
        """A cached block is reused: its hash and the snapshot keyed by it go."""
        h = self.hash_of.pop(block)
        del self.block_of[h]
        row = self.snapshot_of.pop(h, None)
        if row is not None:
            self._to_copy.pop(row, None)
            self._free_rows.append(row)

    # -- accounting ------------------------------------------------------------------------------
    @property
    def cached_blocks(self) -> int:
        return len(self.block_of)

    @property
    def snapshots(self) -> int:
        return len(self.snapshot_of)


def _rows(pool: Any) -> int:
    return getattr(pool, fields(pool)[0].name).shape[0]
