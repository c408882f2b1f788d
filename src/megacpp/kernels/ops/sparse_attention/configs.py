"""Launch settings of the sparse latent attention kernels, by device (read-only; no tuner
writes them). Not yet swept on a GPU: the default is a starting point (64 keys a block keeps
the [BK, r] latent tile at 16 KiB of bf16 for r = 128)."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from megacpp.kernels.launch import DEFAULT


@dataclass(frozen=True)
class SparseAttentionConfig:
    """Each program is one query of one row; it walks the query's selected keys ``block_k``
    at a time (a power of two >= 16, the MMA's minimum) at ``num_warps``."""

    block_k: int
    num_warps: int


CONFIGS = MappingProxyType({
    DEFAULT: SparseAttentionConfig(block_k=64, num_warps=4),
})
