"""The document block mask's eight tensors in one Triton launch (one program per row).

:func:`megacpp.kernels.ops.document_attention.flex.document_block_tiles` in plain PyTorch is
about 25 small kernels (block minima and maxima, the [NB, NB] comparisons, two argsorts per
side), ~70 us per attention layer in `megacpp train`'s step on an H100, 14 layers: ~1 ms a
step. Here each program loads its row's ids as
[NB, 128] tiles, takes each block's smallest and largest id, forms the partial and full
[q block, kv block] tiles as the torch code does, and writes each side's counts and block
indices: the kept blocks first, then the others, each ascending -- the torch code's order
(its argsort keys are unique per block), computed as positions from a running count instead
of a sort. Same outputs, bit for bit (GPU test against the torch code).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from megacpp.kernels.device import cdiv, next_power_of_2
from megacpp.kernels.launch import for_device
from megacpp.kernels.ops.document_attention.configs import TILES_CONFIGS, TilesConfig
from megacpp.kernels.ops.document_attention.flex import BLOCK


@triton.jit
def _indexed(kept, q_ok, k, NUM, IDX, nb, NB_PAD: tl.constexpr):
    """Counts [NB] and indices [NB, NB] of one side from ``kept`` [NB_PAD, NB_PAD] (int32, 1
    where the tile is kept): per row the kept columns in ascending order, then the others
    ascending."""
    n = tl.sum(kept, axis=1)  # [NB_PAD]
    upto = tl.cumsum(kept, axis=1)  # kept columns up to and including this one
    pos = tl.where(kept != 0, upto - 1, n[:, None] + k - upto)
    rows = tl.arange(0, NB_PAD)
    tl.store(NUM + rows, n, mask=rows < nb)
    k_full = k + tl.zeros_like(pos)
    tl.store(IDX + rows[:, None] * nb + pos, k_full, mask=q_ok & (k < nb))


@triton.jit
def _tiles_kernel(IDS, stride_b, length, nb, whole, KV_NUM, KV_IDX, FULL_NUM, FULL_IDX,
                  Q_NUM, Q_IDX, FULL_Q_NUM, FULL_Q_IDX, NB_PAD: tl.constexpr,
                  BLOCK: tl.constexpr):
    b = tl.program_id(0)
    row = IDS + b.to(tl.int64) * stride_b
    blocks = tl.arange(0, NB_PAD)
    pos = blocks[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # [NB_PAD, BLOCK]
    last = tl.load(row + length - 1)
    # past L the row's last id (only widens the last block's range, as _block_ranges does)
    ids = tl.load(row + pos, mask=pos < length, other=last)
    lo = tl.min(ids, axis=1)
    hi = tl.max(ids, axis=1)
    q = blocks[:, None]
    k = blocks[None, :]
    q_lo, q_hi = lo[:, None], hi[:, None]
    k_lo, k_hi = lo[None, :], hi[None, :]
    ok = (q < nb) & (k < nb)
    meets = ((k_hi >= q_lo) & (k_lo <= q_hi) & (k <= q) & ok).to(tl.int32)
    full = ((k < q) & (q < whole) & (q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo)
            & ok).to(tl.int32)
    partial = meets * (1 - full)
    out = b.to(tl.int64)
    q_ok = q < nb
    _indexed(partial, q_ok, k, KV_NUM + out * nb, KV_IDX + out * nb * nb, nb, NB_PAD)
    _indexed(full, q_ok, k, FULL_NUM + out * nb, FULL_IDX + out * nb * nb, nb, NB_PAD)
    # the q side: the transposed tiles (per kv block, its q blocks)
    _indexed(tl.trans(partial), q_ok, k, Q_NUM + out * nb, Q_IDX + out * nb * nb, nb, NB_PAD)
    _indexed(tl.trans(full), q_ok, k, FULL_Q_NUM + out * nb, FULL_Q_IDX + out * nb * nb, nb,
             NB_PAD)


def tiles_triton_ok(doc_ids: Tensor, config: TilesConfig | None = None) -> bool:
    """A CUDA [B, L] integer tensor (B, L > 0) of rows of at most ``config.max_blocks`` tiles
    (``configs.TILES_CONFIGS`` for the device by default)."""
    if not doc_ids.is_cuda:
        return False
    config = config or for_device(TILES_CONFIGS, doc_ids.device)
    return (doc_ids.dim() == 2 and min(doc_ids.shape) > 0 and not doc_ids.is_floating_point()
            and cdiv(doc_ids.shape[1], BLOCK) <= config.max_blocks)


def document_block_tiles_triton(doc_ids: Tensor, config: TilesConfig | None = None
                                ) -> tuple[Tensor, ...]:
    """As :func:`~megacpp.kernels.ops.document_attention.flex.document_block_tiles` (kv side
    partial counts and indices, full, then the q side's), one launch; ``doc_ids`` must pass
    :func:`tiles_triton_ok`."""
    config = config or for_device(TILES_CONFIGS, doc_ids.device)
    batch, length = doc_ids.shape
    ids = doc_ids if doc_ids.stride(1) == 1 else doc_ids.contiguous()
    nb = cdiv(length, BLOCK)
    # (counts [B, 1, NB], indices [B, 1, NB, NB]) per tile kind, each a tensor of its own (a
    # custom operator's outputs must not alias one another)
    parts = [torch.empty(shape, device=ids.device, dtype=torch.int32)
             for _ in range(4) for shape in ((batch, 1, nb), (batch, 1, nb, nb))]
    _tiles_kernel[(batch,)](ids, ids.stride(0), length, nb, length // BLOCK, *parts,
                            NB_PAD=max(16, next_power_of_2(nb)), BLOCK=BLOCK,
                            num_warps=config.num_warps)
    return tuple(parts)
