"""The serving engine's cache memory: paged blocks for attention, state slots for M and R.

Layout per layer family (one pool per layer, allocated once at engine start):

* ``A:gqa``  -- ``k``, ``v``: [num_blocks + 1, block_size, n_kv_heads, head_dim]
* ``A:mla``  -- ``latent`` [.., kv_lora_rank] and ``k_rope`` [.., qk_rope_head_dim]
* ``A:dsa``  -- MLA's two, plus the indexer keys ``index_k`` [.., index_head_dim] (MLA's two
  alone in a layer that reuses another layer's top-k indices, ``[dsa] index_from``)
* ``M``      -- the Mamba-3 state (angle, ssm, k, v), one row per slot: [max_num_seqs + 1, ...]
* ``R``      -- the gated-delta state and conv tail, one row per slot
* ``E``, ``D`` -- nothing

One :class:`IdAllocator` hands out block ids (the same id in every attention layer's pool)
and one hands out state slots (the same slot in every M/R layer). The extra block and slot
at the end are scratch space for padding rows; they are never handed out. A sequence owns a
block table (its blocks, in position order) and one slot from admission until it finishes,
is aborted or is preempted.

With prefix caching (:mod:`megacpp.infer.prefix_cache`) the block ids come from a
reference-counted pool instead: a block can sit in several tables (a shared prompt prefix)
and stays cached after its last holder finishes, until an allocation evicts it; a fixed pool
of snapshot rows per M/R layer holds recurrent states at block boundaries.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch

from megacpp.errors import MegaCppError
from megacpp.infer.memory import check_fits
from megacpp.infer.prefix_cache import NO_HIT, BlockPool, PrefixCache, PrefixHit
from megacpp.model.cache import PagedPool, paged_pool, zero_state_slots
from megacpp.model.model import HybridLM


class IdAllocator:
    """A free list of integer ids ``0..total-1`` with counters."""

    def __init__(self, total: int, what: str) -> None:
        self.total, self.what = total, what
        self._free: deque[int] = deque(range(total))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int = 1) -> list[int]:
        if n > len(self._free):
            raise MegaCppError(f"out of {self.what}: asked for {n}, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, ids: list[int]) -> None:
        self._free.extend(ids)


def pool_bytes(model: HybridLM, num_blocks: int, block_size: int, max_num_seqs: int,
               dtype: torch.dtype, snapshots: int = 0) -> int:
    """Bytes of the pools a :class:`CacheManager` allocates (scratch block and slot included,
    and ``snapshots`` prefix-cache snapshot rows), sized on the meta device, so nothing is
    allocated to find out."""
    state_dtype = torch.promote_types(dtype, torch.float32)
    need = 0
    for i, layout in enumerate(model.paged_layouts()):
        if layout is not None:
            need += paged_pool(layout, num_blocks + 1, block_size, "meta", dtype).nbytes()
        else:
            pool = model.init_state_pool(i, max_num_seqs + 1 + snapshots, "meta", state_dtype)
            need += pool.nbytes() if pool is not None else 0
    return need


def _check_pools_fit(model: HybridLM, num_blocks: int, block_size: int, max_num_seqs: int,
                     device: torch.device, dtype: torch.dtype, snapshots: int) -> None:
    """Refuse pools larger than the device's available memory."""
    need = pool_bytes(model, num_blocks, block_size, max_num_seqs, dtype, snapshots)
    extra = f" and {snapshots} prefix-cache snapshots" if snapshots else ""
    check_fits(need, torch.device(device), f"the KV cache ({num_blocks} blocks of {block_size} "
               f"tokens), {max_num_seqs} state slots{extra}", "lower --max-num-seqs, "
               "--max-model-len, --num-blocks or --prefix-snapshots")


class CacheManager:
    """Per-layer paged pools and state pools of one model, and who owns which block/slot."""

    def __init__(
        self,
        model: HybridLM,
        *,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        device: torch.device,
        dtype: torch.dtype,
        prefix_cache: bool = False,
        snapshots: int = 0,
        snapshot_interval: int = 512,
    ) -> None:
        """``prefix_cache``: reuse blocks and M/R snapshots across requests (``snapshots``
        rows, taken every ``snapshot_interval`` tokens rounded up to whole blocks; see
        :mod:`megacpp.infer.prefix_cache`)."""
        has_state = any(layout is None and model.init_state_pool(i, 1, "meta", torch.float32)
                        is not None for i, layout in enumerate(model.paged_layouts()))
        snapshots = snapshots if prefix_cache and has_state else 0
        if prefix_cache and has_state and snapshots < 1:
            raise MegaCppError("prefix caching a model with M/R layers needs at least one "
                               "snapshot row (snapshots >= 1)")
        _check_pools_fit(model, num_blocks, block_size, max_num_seqs, device, dtype, snapshots)
        self.block_size, self.num_blocks, self.max_num_seqs = block_size, num_blocks, max_num_seqs
        self.null_block, self.null_slot = num_blocks, max_num_seqs  # scratch for padding rows
        self.slots = IdAllocator(max_num_seqs, "state slots")
        self._new_slots: list[int] = []  # admitted, not yet reset (see prepare_new_slots)
        self.families = [b.family for b in model.blocks]
        self.device = device
        state_dtype = torch.promote_types(dtype, torch.float32)
        self.layers: list[object | None] = []
        for i, layout in enumerate(model.paged_layouts()):
            if layout is not None:
                self.layers.append(paged_pool(layout, num_blocks + 1, block_size, device, dtype))
            else:
                self.layers.append(model.init_state_pool(i, max_num_seqs + 1, device, state_dtype))
        self.state_pools = [p for p in self.layers if p is not None and not isinstance(p, PagedPool)]
        self.prefix: PrefixCache | None = None
        if prefix_cache:
            snapshot_pools = [model.init_state_pool(i, snapshots, device, state_dtype)
                              for i, pool in enumerate(self.layers)
                              if pool is not None and not isinstance(pool, PagedPool)]
            self.prefix = PrefixCache(
                num_blocks=num_blocks, block_size=block_size, state_pools=self.state_pools,
                snapshot_pools=snapshot_pools,
                snapshot_interval=-(-snapshot_interval // block_size) * block_size)
            self.blocks: IdAllocator | BlockPool = self.prefix.blocks
        else:
            self.blocks = IdAllocator(num_blocks, "KV blocks")
        self.tables: dict[str, list[int]] = {}  # sequence id -> its blocks, in position order
        self.slot_of: dict[str, int] = {}

    # -- ownership -------------------------------------------------------------------------------
    def blocks_needed(self, seq_id: str, n_tokens: int) -> int:
        """Blocks ``seq_id`` still lacks to hold ``n_tokens`` tokens."""
        have = len(self.tables.get(seq_id, ()))
        return max(0, -(-n_tokens // self.block_size) - have)

    def reserve(self, seq_id: str, n_tokens: int) -> bool:
        """Grow ``seq_id``'s block table to hold ``n_tokens`` tokens; False if blocks ran out
        (nothing allocated then)."""
        need = self.blocks_needed(seq_id, n_tokens)
        if need > self.blocks.num_free:
            return False
        self.tables.setdefault(seq_id, []).extend(self.blocks.allocate(need))
        return True

    # -- prefix caching --------------------------------------------------------------------------
    def match_prefix(self, token_ids: list[int], extra: list[int] | None,
                     known: Sequence[bytes] = ()) -> PrefixHit:
        """What a new sequence with these tokens can reuse (nothing without prefix caching);
        ``known``: its block hashes from an earlier lookup."""
        return NO_HIT if self.prefix is None else self.prefix.match(token_ids, extra, known)

    def can_admit(self, hit: PrefixHit, n_tokens: int) -> bool:
        """A free slot, blocks for ``n_tokens`` tokens beyond the hit's blocks, and (prefix
        caching) no running sequence computing the prompt's next uncached block."""
        if self.slots.num_free == 0:
            return False
        if self.prefix is not None and self.prefix.in_flight(hit):
            return False
        need = -(-n_tokens // self.block_size) - len(hit.blocks)
        if self.prefix is None:
            return need <= self.blocks.num_free
        return need <= self.blocks.num_free_after(list(hit.blocks))

    def admit(self, seq_id: str, hit: PrefixHit, prompt_len: int) -> None:
        """Open ``seq_id`` (after :meth:`can_admit`; :meth:`reserve` grows its table): a slot
        holding the hit's state and a table starting with the hit's blocks. The slot is made
        ready with the step's other new slots by :meth:`prepare_new_slots`, which the scheduler
        calls before the step's forward runs: reset, or given the hit's snapshot (which
        overwrites every state tensor of the row)."""
        slot = self._take_slot(seq_id)
        self.tables[seq_id] = list(hit.blocks)
        snapshot = self.prefix is not None and hit.snapshot is not None
        if not snapshot:
            self._new_slots.append(slot)
        if self.prefix is not None:
            self.prefix.admit(seq_id, hit, prompt_len, slot if snapshot else None)

    def expect_sharing(self, seq_id: str) -> None:
        """A waiting request starts like ``seq_id``: leave snapshots it can start from."""
        if self.prefix is not None:
            self.prefix.expect_sharing(seq_id)

    def chunk_end(self, seq_id: str, start: int, end: int, prefill_end: int) -> int:
        """A prefill chunk's end, cut at a snapshot boundary (see :mod:`prefix_cache`)."""
        if self.prefix is None:
            return end
        return self.prefix.chunk_end(seq_id, start, end, prefill_end)

    def computed(self, seq_id: str, token_ids: list[int], extra: list[int] | None,
                 end: int) -> None:
        """A prefill chunk of ``seq_id`` ending at token ``end`` ran: index its full blocks
        and snapshot its state on a block boundary."""
        if self.prefix is not None:
            self.prefix.computed(seq_id, self.tables[seq_id], token_ids, extra, end,
                                 self.slot_of[seq_id])

    def flush(self) -> None:
        """Take the snapshots the last step asked for (before the next forward runs)."""
        if self.prefix is not None:
            self.prefix.flush(self.device)

    def open_slot(self, seq_id: str) -> int:
        """Give ``seq_id`` a state slot, reset to the empty-prefix state."""
        slot = self._take_slot(seq_id)
        self._new_slots.append(slot)
        self.prepare_new_slots()
        return slot

    def prepare_new_slots(self) -> None:
        """Ready every slot admitted since the last call: the empty-prefix state (zeros), or
        the prefix-cache snapshot its hit starts from. One fill, or one gather and scatter,
        per state tensor for all of them (per slot it was 66 launches a request on
        nam56r-350m, most of a large batch's time to first token)."""
        if self._new_slots:
            index = torch.tensor(self._new_slots, device=self.device)
            for pool in self.state_pools:
                zero_state_slots(pool, index)
            self._new_slots.clear()
        if self.prefix is not None:
            self.prefix.restore(self.device)

    def _take_slot(self, seq_id: str) -> int:
        if seq_id in self.slot_of:
            raise AssertionError(f"sequence {seq_id!r} already holds slot {self.slot_of[seq_id]}")
        (slot,) = self.slots.allocate(1)
        self.slot_of[seq_id] = slot
        return slot

    def release(self, seq_id: str) -> None:
        """Return ``seq_id``'s blocks and slot to the free lists (no-op for unknown ids)."""
        self.blocks.free(self.tables.pop(seq_id, []))
        if self.prefix is not None:
            self.prefix.release(seq_id)
        slot = self.slot_of.pop(seq_id, None)
        if slot is not None:
            self.slots.free([slot])
            if slot in self._new_slots:
                self._new_slots.remove(slot)
            if self.prefix is not None:
                self.prefix.forget_slot(slot)

    # -- accounting ------------------------------------------------------------------------------
    def bytes_by_family(self) -> dict[str, int]:
        """Bytes allocated per layer family (``A``, ``M``, ``R``), scratch block/slot included."""
        out: dict[str, int] = {}
        for family, pool in zip(self.families, self.layers, strict=True):
            if pool is not None:
                out[family] = out.get(family, 0) + pool.nbytes()
        return out

    def nbytes(self) -> int:
        return sum(self.bytes_by_family().values())


def default_num_blocks(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """Enough blocks for every running sequence at full length."""
    return max_num_seqs * -(-max_model_len // block_size)
