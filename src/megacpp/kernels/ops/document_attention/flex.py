"""Causal attention inside the documents of packed rows with FlexAttention, over a block
mask that skips every tile outside a document (the contract: ``reference.py``).

The dense mask costs the masked SDPA kernel every [L, L] tile (cuDNN's masked kernel on an
H100 at the nam56r-350m step's shape: 1.53 ms fwd+bwd per layer, against 0.61 for the causal
kernel with no document mask). The block mask marks each [128, 128] tile empty (skipped),
full (no mask evaluated) or partial from the minimum and maximum document id of its query
and key blocks, in a handful of ops on [B, L/128, L/128] tensors (torch's
``create_block_mask`` evaluates the whole [B, L, L] mask: 0.58 ms there); on CUDA in one
Triton launch (:mod:`megacpp.kernels.ops.document_attention.triton`).
The flex backend is the catalog's chosen row on CUDA (sm80+) and the model's path for packed
rows; the reference serves everywhere else. Where ``configs.FLEX_OPTIONS`` has launch
settings for the device and head dim (an H100 at head dim 64), it runs them
(:func:`flex_kernel_options`) instead of Inductor's defaults.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from megacpp.kernels.ops.document_attention.configs import FLEX_OPTIONS

BLOCK = 128  # FlexAttention's default tile on both sides


def _block_ranges(doc_ids: Tensor, length: int) -> tuple[Tensor, Tensor]:
    """Per [B, L/BLOCK] block: the smallest and largest document id of its tokens (the tail
    past L padded with the row's last id, which only widens the last block's range)."""
    pad = (-length) % BLOCK
    ids = torch.cat([doc_ids, doc_ids[:, -1:].expand(-1, pad)], dim=1) if pad else doc_ids
    blocks = ids.reshape(ids.shape[0], -1, BLOCK)
    return blocks.amin(-1), blocks.amax(-1)


@torch.library.custom_op("megacpp::document_block_tiles", mutates_args=())
def document_block_tiles(doc_ids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor,
                                                     Tensor, Tensor, Tensor, Tensor]:
    """The eight int32 tensors of :func:`document_block_mask` (``FlexAttention``'s kv-side and
    q-side counts [B, 1, NB] and indices [B, 1, NB, NB], partial then full), contiguous.

    An operator of its own, opaque to torch.compile. Traced op by op into a compiled graph on
    an H100, with the head axis added as ``x[:, None]``, Inductor gave that axis the stride 0
    and FlexAttention's kernel read row 0's tiles for every row; made [B, 1, ...] from the
    start, the mask was right with gradients but a compiled no-grad forward hit an illegal
    memory access. As an operator its outputs are real tensors with the layout its fake
    declares (tests: torch.library.opcheck).

    On CUDA (rows of at most ``TilesConfig.max_blocks`` tiles) one Triton launch computes the
    same tensors (:mod:`megacpp.kernels.ops.document_attention.triton`); the torch code below
    is its truth."""
    if doc_ids.is_cuda:
        from megacpp.kernels.ops.document_attention import triton as kernels

        if kernels.tiles_triton_ok(doc_ids):
            return kernels.document_block_tiles_triton(doc_ids)
    return document_block_tiles_torch(doc_ids)


def document_block_tiles_torch(doc_ids: Tensor) -> tuple[Tensor, ...]:
    """:func:`document_block_tiles` in plain PyTorch (any device; the Triton kernel's truth)."""
    length = doc_ids.shape[1]
    lo, hi = _block_ranges(doc_ids, length)  # [B, NB]
    nb = lo.shape[1]
    q_lo, q_hi = lo[:, None, :, None], hi[:, None, :, None]  # [B, 1, NB(q), NB(kv)] below
    k_lo, k_hi = lo[:, None, None, :], hi[:, None, None, :]
    blk = torch.arange(nb, device=doc_ids.device)
    q_blk, k_blk = blk[:, None], blk[None, :]
    whole = length // BLOCK  # blocks inside L: a partial last tile is never full
    meets = (k_hi >= q_lo) & (k_lo <= q_hi) & (k_blk <= q_blk)
    full = ((k_blk < q_blk) & (q_blk < whole) & (q_lo == q_hi) & (k_lo == k_hi)
            & (q_lo == k_lo))
    partial = meets & ~full

    def indexed(keep: Tensor) -> tuple[Tensor, Tensor]:
        # the kept blocks of each row first, then the others, each in ascending order (torch's
        # own order): an argsort of keys unique per block (kept: its index; else: index + NB),
        # so no tie is left to a sort's stability
        order = torch.where(keep, blk, blk + nb).argsort(dim=-1)
        # contiguous as declared (the q side's argsort keeps its transposed input's layout)
        return (keep.sum(-1, dtype=torch.int32).contiguous(),
                order.to(torch.int32, memory_format=torch.contiguous_format))

    # kv side: per q block its kv blocks; q side (the backward's dk/dv loop): the transpose
    return (*indexed(partial), *indexed(full),
            *indexed(partial.transpose(-2, -1)), *indexed(full.transpose(-2, -1)))


@document_block_tiles.register_fake
def _document_block_tiles_fake(doc_ids: Tensor):
    batch, nb = doc_ids.shape[0], -(-doc_ids.shape[1] // BLOCK)
    return tuple(doc_ids.new_empty(shape, dtype=torch.int32)
                 for _ in range(4) for shape in ((batch, 1, nb), (batch, 1, nb, nb)))


def document_block_mask(doc_ids: Tensor) -> BlockMask:
    """The document-causal :class:`BlockMask` of ``doc_ids`` [B, L]: a [q block, kv block] tile
    is empty when it lies above the diagonal or the two blocks' id ranges do not meet, full
    when it lies below the diagonal and both blocks hold one and the same document and end
    inside L, else partial (the mask is evaluated per element): the tensors torch's
    ``create_block_mask`` makes, from a handful of ops on [B, NB, NB] tensors instead of the
    whole [B, L, L] mask. Sound for any ids, not only sorted ones; no host sync, static shapes
    (capturable in a CUDA graph); right built eagerly or inside a compiled function
    (:func:`document_block_tiles`)."""
    length = doc_ids.shape[1]
    kv_num, kv_idx, full_num, full_idx, q_num, q_idx, full_q_num, full_q_idx = (
        document_block_tiles(doc_ids))
    last = length - 1

    def mask_mod(b, h, q_idx, kv_idx):
        # indices past L (a partial last tile) read the last token's id: kv_idx <= q_idx < L
        # already excludes such keys, and such queries are dropped
        same = doc_ids[b, q_idx.clamp(max=last)] == doc_ids[b, kv_idx.clamp(max=last)]
        return (kv_idx <= q_idx) & same

    return BlockMask(seq_lengths=(length, length), kv_num_blocks=kv_num, kv_indices=kv_idx,
                     full_kv_num_blocks=full_num, full_kv_indices=full_idx,
                     q_num_blocks=q_num, q_indices=q_idx, full_q_num_blocks=full_q_num,
                     full_q_indices=full_q_idx, BLOCK_SIZE=(BLOCK, BLOCK), mask_mod=mask_mod)


@functools.cache
def _compiled_flex():
    # FlexAttention's fused kernels come from compiling it; called eagerly it runs a slow
    # reference over the whole score matrix
    return torch.compile(flex_attention, dynamic=False)


def flex_kernel_options(q: Tensor) -> dict | None:
    """FlexAttention's ``kernel_options`` for queries like ``q``: the entry of
    ``configs.FLEX_OPTIONS`` for this GPU and head dim in bf16 / fp16, else None (Inductor's
    defaults). Constant under torch.compile (Dynamo folds the device properties)."""
    if not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16):
        return None
    props = torch.cuda.get_device_properties(q.device)
    for entry in FLEX_OPTIONS:
        if entry.capability == (props.major, props.minor) and entry.head_dim == q.shape[-1]:
            return entry.as_dict()
    return None


def document_attention_flex(q: Tensor, k: Tensor, v: Tensor, doc_ids: Tensor) -> Tensor:
    """FlexAttention over :func:`document_block_mask`: the same function as the reference.
    On CUDA compiled (inside a compiled function, as the model's compiled blocks call it, the
    enclosing compile traces it), with :func:`flex_kernel_options`; eager on CPU, as the CPU
    tests run it (torch has no CPU backward)."""
    flex = (_compiled_flex() if q.is_cuda and not torch.compiler.is_compiling()
            else flex_attention)
    return flex(q, k, v, block_mask=document_block_mask(doc_ids), enable_gqa=True,
                kernel_options=flex_kernel_options(q))
