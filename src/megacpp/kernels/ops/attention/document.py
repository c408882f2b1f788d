"""Causal attention inside documents of packed rows: the reference (SDPA with the dense mask,
what the model has always run) and FlexAttention over a block mask that skips every tile
outside a document.

Contract: q [B, H, L, Dh], k, v [B, Hkv, L, Dh] (H a multiple of Hkv: grouped-query heads),
doc_ids [B, L] integer (a per-token document index) -> [B, H, L, Dh] in q.dtype, softmax scale
1/sqrt(Dh): query i sees key j iff j <= i and doc_ids[b, i] == doc_ids[b, j]. Every query sees
at least itself, so no row is empty.

The dense mask costs the masked SDPA kernel every [L, L] tile (cuDNN's masked kernel on an
H100 at the nam56r-350m step's shape: 1.53 ms fwd+bwd per layer, against 0.61 for the causal
kernel with no document mask; benchmarks/results/train_h100_s26/call5). The block mask marks
each [128, 128] tile empty (skipped), full (no mask evaluated) or partial from the minimum and
maximum document id of its query and key blocks, in a handful of ops on [B, L/128, L/128]
tensors (torch's ``create_block_mask`` evaluates the whole [B, L, L] mask: 0.58 ms there).
The flex backend is a donor row of the catalog for now, not the model's path: the registry's
row says why.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

BLOCK = 128  # FlexAttention's default tile on both sides


def document_causal_mask(doc_ids: Tensor) -> Tensor:
    """[B, L] document ids -> [B, L, L] bool: query i may see key j iff j <= i, same doc."""
    length = doc_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=doc_ids.device).tril()
    return causal & (doc_ids[:, :, None] == doc_ids[:, None, :])


def document_attention_reference(q: Tensor, k: Tensor, v: Tensor, doc_ids: Tensor) -> Tensor:
    """SDPA with the dense [B, 1, L, L] document-causal mask (grouped-query heads shared)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=document_causal_mask(doc_ids)[:, None],
                                          enable_gqa=True)


def _block_ranges(doc_ids: Tensor, length: int) -> tuple[Tensor, Tensor]:
    """Per [B, L/BLOCK] block: the smallest and largest document id of its tokens (the tail
    past L padded with the row's last id, which only widens the last block's range)."""
    pad = (-length) % BLOCK
    ids = torch.cat([doc_ids, doc_ids[:, -1:].expand(-1, pad)], dim=1) if pad else doc_ids
    blocks = ids.reshape(ids.shape[0], -1, BLOCK)
    return blocks.amin(-1), blocks.amax(-1)


def document_block_mask(doc_ids: Tensor) -> BlockMask:
    """The document-causal :class:`BlockMask` of ``doc_ids`` [B, L]: a [q block, kv block] tile
    is empty when it lies above the diagonal or the two blocks' id ranges do not meet, full
    when it lies below the diagonal and both blocks hold one and the same document and end
    inside L (torch's ``create_block_mask`` makes the same tiles), else partial (the mask is
    evaluated per element). Sound for any ids, not only sorted ones; no host sync, static
    shapes (capturable in a CUDA graph). Built inside a torch.compile'd function it came out
    wrong on an H100 (benchmarks/results/train_h100_s26, call 8): build it eagerly."""
    length = doc_ids.shape[1]
    lo, hi = _block_ranges(doc_ids, length)  # [B, NB]
    nb = lo.shape[1]
    blk = torch.arange(nb, device=doc_ids.device)
    q_lo, q_hi, k_lo, k_hi = lo[:, :, None], hi[:, :, None], lo[:, None, :], hi[:, None, :]
    below = blk[None, :, None] > blk[None, None, :]  # kv block strictly before the q block
    meets = (k_hi >= q_lo) & (k_lo <= q_hi) & (blk[None, None, :] <= blk[None, :, None])
    whole = blk < length // BLOCK  # blocks inside L: a partial last tile is never full
    full = (below & whole[None, :, None] & whole[None, None, :]
            & (q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo))
    partial = meets & ~full

    def indexed(keep: Tensor) -> tuple[Tensor, Tensor]:
        # the kept kv blocks of each q block first, in ascending order (a stable sort of the
        # flags), as FlexAttention's [B, 1, NB] counts and [B, 1, NB, NB] indices
        order = torch.sort(keep.to(torch.int8), dim=-1, descending=True, stable=True).indices
        return (keep.sum(-1, dtype=torch.int32)[:, None],
                order.to(torch.int32)[:, None])

    kv_num, kv_idx = indexed(partial)
    full_num, full_idx = indexed(full)

    last = length - 1

    def mask_mod(b, h, q_idx, kv_idx):
        # indices past L (a partial last tile) read the last token's id: kv_idx <= q_idx < L
        # already excludes such keys, and such queries are dropped
        same = doc_ids[b, q_idx.clamp(max=last)] == doc_ids[b, kv_idx.clamp(max=last)]
        return (kv_idx <= q_idx) & same

    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK,
                                    mask_mod=mask_mod, seq_lengths=(length, length))


@functools.cache
def _compiled_flex():
    # FlexAttention's fused kernels come from compiling it; called eagerly it runs a slow
    # reference over the whole score matrix
    return torch.compile(flex_attention, dynamic=False)


def document_attention_flex(q: Tensor, k: Tensor, v: Tensor, doc_ids: Tensor) -> Tensor:
    """FlexAttention over :func:`document_block_mask`: the same function as the reference.
    Compiled on CUDA; eager on CPU, as the CPU tests run it (torch has no CPU backward)."""
    flex = _compiled_flex() if q.is_cuda else flex_attention
    return flex(q, k, v, block_mask=document_block_mask(doc_ids), enable_gqa=True)
