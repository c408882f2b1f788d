"""The whole-model decoding cache: one object per layer, each with an explicit layout.

* A:gqa: :class:`~megacpp.model.attention.KVCache` -- keys/values [B, Hkv, capacity, hd].
* A:mla / A:dsa: :class:`~megacpp.model.mla.MLACache` (compressed latent + shared RoPE key;
  DSA also caches its indexer keys) -- see ``model/mla.py`` and ``model/dsa.py``.
* M (Mamba-3) and R (gated delta rule): the mixer's own fixed-size recurrent state.
* E and D: stateless (``None``).

The serving engine uses a *paged* layout instead (see the second half of this file).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import Tensor

from megacpp.model.rope import rope_cos_sin


@dataclass
class ModelCache:
    layers: list[Any]  # per-layer cache objects, None for stateless sublayers
    capacity: int  # max tokens per row (bounds the attention caches)
    length: int = 0  # tokens already consumed per row
    families: list[str] = field(default_factory=list)

    def nbytes(self) -> int:
        return sum(c.nbytes() for c in self.layers if c is not None)

    def bytes_by_family(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for fam, c in zip(self.families, self.layers, strict=True):
            if c is not None:
                out[fam] = out.get(fam, 0) + c.nbytes()
        return out


# -- paged caches (the serving engine's layout) -----------------------------------------------
#
# The engine (``megacpp.infer``) owns allocation; the model only reads and writes through the
# objects below. Attention layers keep their cache in fixed-size *blocks* of ``block_size``
# tokens shared by all sequences (``PagedPool``); a row's positions ``[i*bs, (i+1)*bs)`` live
# in block ``block_tables[row, i]``. M and R layers keep their fixed-size state in *slots*
# (the mixer's own cache object with ``max_num_seqs + 1`` rows); a forward gathers its rows'
# slots into a small cache object, runs the mixer, and scatters the new state back.
# Nothing here reads a tensor value on the host, so a paged decode step can be captured.


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
    """

    positions: Tensor
    slot_mapping: Tensor
    block_tables: Tensor
    state_slots: Tensor
    last_index: Tensor | None = None
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
    for A:mla, plus ``index_k`` for A:dsa (all stored after norm and RoPE, as the contiguous
    caches store them).
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
    """What an attention mixer receives as ``cache`` in a paged forward."""

    pool: PagedPool
    batch: PagedBatch

    def append(self, **values: Tensor) -> list[Tensor]:
        """Write this forward's entries, then read back every row's cache, in ``values``'
        order: each [B, T, *feature] with T = n_blocks * block_size."""
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
    return type(pool)(**{f.name: getattr(pool, f.name).index_select(0, slots) for f in fields(pool)})


def scatter_state(pool: Any, slots: Tensor, state: Any) -> None:
    """Write a gathered cache object back into rows ``slots`` of ``pool``."""
    for f in fields(pool):
        getattr(pool, f.name).index_copy_(0, slots, getattr(state, f.name))


def zero_state_slots(pool: Any, slots: Tensor) -> None:
    """Reset rows ``slots`` of a state pool to the empty-prefix state (zeros)."""
    for f in fields(pool):
        getattr(pool, f.name).index_fill_(0, slots, 0)
