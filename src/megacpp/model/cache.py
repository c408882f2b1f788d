"""The decoding cache: *paged* per-layer pools with an explicit layout.

Attention layers keep their cache in fixed-size *blocks* of ``block_size`` tokens
(``PagedPool``); a row's positions ``[i*bs, (i+1)*bs)`` live in block ``block_tables[row, i]``.
The tensors are the layer's ``paged_layout()``:

* A:gqa -- keys/values ``k``, ``v`` [.., n_kv_heads, head_dim] (after RoPE);
* A:mla -- the compressed ``latent`` and the shared RoPE key ``k_rope`` (see ``model/mla.py``);
* A:dsa -- MLA's two plus the indexer keys ``index_k`` (see ``model/dsa.py``).

M (Mamba-3) and R (gated delta rule) keep their fixed-size recurrent state in *slots* (the
mixer's own state object with one row per slot); a forward gathers its rows' slots into a
small state object, runs the mixer, and scatters the new state back. E and D are stateless.

The serving engine (``megacpp.infer``) owns allocation there: blocks and slots come and go
with requests. :class:`LockstepCache` is the fixed allocation for rows decoded together
(``HybridLM.generate_greedy``, transformers' ``generate()``): the same layout and mixer code.
Nothing here reads a tensor value on the host, so a paged decode step can be captured.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from megacpp.model.rope import rope_cos_sin

if TYPE_CHECKING:
    from megacpp.model.model import HybridLM


@dataclass
class PagedBatch:
    """Where the tokens of one paged forward live: ``B`` rows of ``L`` tokens each.

    positions:    [B, L] int64 absolute position of each input token in its sequence.
    slot_mapping: [B * L] int64 flat pool row (``block * block_size + offset``) each token's
                  cache entries are written to (padding tokens point into a scratch block).
    block_tables: [B, n_blocks] int64 pool block holding each row's positions
                  ``[i * block_size, (i + 1) * block_size)``; unused entries point anywhere
                  (the scratch block): keys past a query's position are masked out.
    state_slots:  [B] int64 state slot of each row in the M and R pools.
    last_index:   [B] int64 index in ``L`` of each row's last real token, or None (L - 1).
                  Tokens after it are right padding (the continuation graphs): their
                  logits are not read, their cache entries go to the scratch block
                  (``slot_mapping``), and M and R keep the state the last real token left.
    structure_ids: [B, L] int64 structure id of each input token, for a model with a
                  structure-id embedding (else None).
    ngram_context: [B, max order - 1] int64 the tokens before each row's first input token,
                  oldest first (``NO_TOKEN`` = -1 before the sequence's start), for a model
                  with a hashed n-gram branch (else None). See ``model/features.py``.
    doc_ids:      [B, L] int64 document index of each input token, or None (one document):
                  where it changes, M and R start from the empty state and the conv drops
                  earlier inputs. Left padding (the prefill graphs) is document 0, the prompt
                  document 1, so the recurrences never carry padding into a row's state.
    fresh:        every row starts from the empty state (a first prefill chunk): M and R
                  neither read nor check their slots' contents (no host sync), they only
                  write the new state.
    continues:    every row continues its slot's state (a continuation chunk): M and R read
                  the slots without first checking them for zeros (Mamba-3's check is a host
                  sync), so the forward can be captured.
    """

    positions: Tensor
    slot_mapping: Tensor
    block_tables: Tensor
    state_slots: Tensor
    last_index: Tensor | None = None
    structure_ids: Tensor | None = None
    ngram_context: Tensor | None = None
    doc_ids: Tensor | None = None
    fresh: bool = False
    continues: bool = False
    _memo: dict = field(default_factory=dict, repr=False)  # tables shared by the layers

    def forget(self) -> None:
        """Drop the tables computed from ``positions`` (call when a forward starts)."""
        self._memo.clear()

    def allowed_keys(self, n_keys: int) -> Tensor:
        """[B, L, n_keys] bool: key position <= the query's position (causal, per row)."""
        if ("allowed", n_keys) not in self._memo:
            key_pos = torch.arange(n_keys, device=self.positions.device)
            self._memo["allowed", n_keys] = key_pos[None, None, :] <= self.positions[:, :, None]
        return self._memo["allowed", n_keys]

    def rope(self, dim: int, base: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos/sin [B, L, dim/2] at ``positions`` (computed once per forward, not per layer)."""
        key = ("rope", dim, base, dtype)
        if key not in self._memo:
            self._memo[key] = rope_cos_sin(self.positions, dim, base, dtype)
        return self._memo[key]


@dataclass
class PagedPool:
    """The paged cache of one attention layer: each tensor [num_blocks, block_size, *feature].

    The tensors are the layer's ``paged_layout()``: ``k``/``v`` for A:gqa, ``latent``/``k_rope``
    for A:mla, plus ``index_k`` for A:dsa (all stored after norm and RoPE, so never
    re-rotated).
    """

    tensors: dict[str, Tensor]

    @property
    def num_blocks(self) -> int:
        return next(iter(self.tensors.values())).shape[0]

    @property
    def block_size(self) -> int:
        return next(iter(self.tensors.values())).shape[1]

    def write(self, batch: PagedBatch, **values: Tensor) -> None:
        """Store ``values[name]`` [B, L, *feature] at ``batch.slot_mapping``."""
        for name, new in values.items():
            pool = self.tensors[name]
            flat = pool.view(-1, *pool.shape[2:])  # [num_blocks * block_size, *feature]
            flat.index_copy_(0, batch.slot_mapping, new.reshape(-1, *pool.shape[2:]).to(pool.dtype))

    def read(self, name: str, batch: PagedBatch) -> Tensor:
        """Every row's cached ``name`` -> [B, n_blocks * block_size, *feature]."""
        pool = self.tensors[name]
        return pool[batch.block_tables].flatten(1, 2)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass
class PagedView:
    """What a mixer's ``forward_paged`` receives as ``cache``: its layer's pool (a
    :class:`PagedPool` for attention, the state pool for M and R, None for E and D) and the
    batch."""

    pool: Any
    batch: PagedBatch

    def append(self, **values: Tensor) -> list[Tensor]:
        """Write this forward's entries into the (attention) pool, then read back every row's
        cache, in ``values``' order: each [B, T, *feature] with T = n_blocks * block_size."""
        self.pool.write(self.batch, **values)
        return [self.pool.read(name, self.batch) for name in values]


def paged_pool(
    layout: dict[str, tuple[int, ...]],
    num_blocks: int,
    block_size: int,
    device: torch.device | str,
    dtype: torch.dtype,
) -> PagedPool:
    """A zeroed pool of ``num_blocks`` blocks for a layer's ``paged_layout()``."""
    return PagedPool(
        {
            name: torch.zeros(num_blocks, block_size, *shape, device=device, dtype=dtype)
            for name, shape in layout.items()
        }
    )


def gather_state(pool: Any, slots: Tensor) -> Any:
    """The rows ``slots`` [B] of a state pool (a mixer cache dataclass) as a new cache object."""
    return type(pool)(**{f.name: getattr(pool, f.name).index_select(0, slots)
                         for f in fields(pool)})


def scatter_state(pool: Any, slots: Tensor, state: Any) -> None:
    """Write a gathered cache object back into rows ``slots`` of ``pool``."""
    for f in fields(pool):
        getattr(pool, f.name).index_copy_(0, slots, getattr(state, f.name))


def zero_state_slots(pool: Any, slots: Tensor) -> None:
    """Reset rows ``slots`` of a state pool to the empty-prefix state (zeros)."""
    for f in fields(pool):
        getattr(pool, f.name).index_fill_(0, slots, 0)


def lockstep_batch(block_tables: Tensor, block_size: int, start: int, n_tokens: int) -> PagedBatch:
    """The :class:`PagedBatch` of positions ``[start, start + n_tokens)`` of every row of
    ``block_tables`` [B, W] (rows in lockstep, row r in state slot r)."""
    B, device = block_tables.shape[0], block_tables.device
    pos = torch.arange(start, start + n_tokens, device=device)  # [L]
    slot_mapping = block_tables[:, pos // block_size] * block_size + pos % block_size  # [B, L]
    width = -(-(start + n_tokens) // block_size)
    return PagedBatch(
        positions=pos.expand(B, n_tokens).contiguous(),
        slot_mapping=slot_mapping.flatten(),
        block_tables=block_tables[:, :width],
        state_slots=torch.arange(B, device=device),
    )


class LockstepCache:
    """Paged caches for ``batch_size`` rows decoded together, every row at the same length:
    row r owns blocks ``[r * W, (r + 1) * W)`` of every attention pool (W blocks hold
    ``capacity`` tokens) and slot r of every state pool. Attention caches use ``dtype``;
    recurrent states at least float32. The MTP modules are not cached (they only run in
    ``HybridLM.forward``)."""

    def __init__(self, model: HybridLM, batch_size: int, capacity: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 block_size: int = 16) -> None:
        width = -(-capacity // block_size)
        state_dtype = torch.promote_types(dtype, torch.float32)
        self.layers: list[Any] = []
        for i, layout in enumerate(model.paged_layouts()):
            if layout is not None:
                self.layers.append(
                    paged_pool(layout, batch_size * width, block_size, device, dtype))
            else:
                self.layers.append(model.init_state_pool(i, batch_size, device, state_dtype))
        self.block_tables = torch.arange(batch_size * width, device=device).view(batch_size, width)
        self.block_size, self.capacity, self.length = block_size, capacity, 0
        # a hashed n-gram branch reads each row's previous tokens: kept here, oldest first
        self.ngram = model.ngram_embed
        self.ngram_context = None
        if self.ngram is not None:
            self.ngram_context = torch.full((batch_size, self.ngram.context_len), -1,
                                            dtype=torch.int64, device=device)

    def advance(self, tokens: Tensor | int) -> PagedBatch:
        """The batch of every row's next tokens ``tokens`` [B, n] (cached once it has run).
        A model without a hashed n-gram branch may pass just their number n."""
        n_tokens = tokens if isinstance(tokens, int) else tokens.shape[1]
        if self.length + n_tokens > self.capacity:
            raise ValueError(f"{n_tokens} more tokens do not fit the cache ({self.length} used "
                             f"of {self.capacity})")
        batch = lockstep_batch(self.block_tables, self.block_size, self.length, n_tokens)
        if self.ngram is not None:
            if isinstance(tokens, int):
                raise ValueError("this model hashes n-grams of the previous tokens: "
                                 "advance() needs the tokens [B, n], not their number")
            batch.ngram_context = self.ngram_context
            self.ngram_context = self.ngram.next_context(self.ngram_context, tokens)
        self.length += n_tokens
        return batch

    def nbytes(self) -> int:
        return sum(pool.nbytes() for pool in self.layers if pool is not None)
