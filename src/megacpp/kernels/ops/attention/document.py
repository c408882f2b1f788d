"""Causal attention inside documents of packed rows: the reference (SDPA with the dense mask,
what the model ran until session 27) and FlexAttention over a block mask that skips every tile
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
tensors (torch's ``create_block_mask`` evaluates the whole [B, L, L] mask: 0.58 ms there); on
CUDA in one Triton launch (:mod:`megacpp.kernels.ops.attention.triton`).
The flex backend is the catalog's chosen row on CUDA (sm80+) and the model's path for packed
rows since session 27 (benchmarks/results/train_h100_s27); the reference serves everywhere
else. On an H100 at head dim 64 it runs the launch settings of :data:`HOPPER_D64_OPTIONS`
(:func:`flex_kernel_options`) instead of Inductor's defaults.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

BLOCK = 128  # FlexAttention's default tile on both sides

# FlexAttention's launch settings on an H100 (sm90) at head dim 64 in bf16 / fp16: 64-row
# forward tiles and 64 x 64 backward tiles at 4 warps. Inductor's defaults there (forward
# 128 x 128 at 4 warps; backward M1 64, N1 128, M2 128, N2 64 at 8 warps) replayed the nam56r
# step's shape (B 8, H 12 / 2, L 2048) in 0.946 ms fwd+bwd a layer with 2 documents a row, these
# in 0.725 (8 documents a row: 0.605 -> 0.485), the forward alone 0.252 -> 0.171 ms. They walk
# the same 64-row q blocks and 64-column kv blocks in the same order as the defaults, so
# results are the defaults' bit for bit (the trainer's losses too). Sweeps with the settings that
# lost (128-row forward tiles, 32-row or 128-column backward tiles, 8 backward warps, 1 or 5
# stages, TMA loads): benchmarks/results/kernels/h100_s29, calls 4-6; megacpp train 101.3 ->
# 99.0 ms a step: benchmarks/results/train_h100_s29. Elsewhere Inductor's own choice stands.
HOPPER_D64_OPTIONS = {
    "fwd_BLOCK_M": 64, "fwd_BLOCK_N": 128, "fwd_num_stages": 3, "fwd_num_warps": 4,
    "bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_N2": 64, "bwd_BLOCK_M2": 64,
    "bwd_num_stages": 3, "bwd_num_warps": 4,
}


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


@torch.library.custom_op("megacpp::document_block_tiles", mutates_args=())
def document_block_tiles(doc_ids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor,
                                                     Tensor, Tensor, Tensor, Tensor]:
    """The eight int32 tensors of :func:`document_block_mask` (``FlexAttention``'s kv-side and
    q-side counts [B, 1, NB] and indices [B, 1, NB, NB], partial then full), contiguous.

    An operator of its own, opaque to torch.compile. Traced op by op into a compiled graph on
    an H100 (benchmarks/results/train_h100_s27): with the head axis added as ``x[:, None]``,
    Inductor gave it the stride 0 and FlexAttention's kernel read row 0's tiles for every row
    (call 2); made [B, 1, ...] from the start, the mask was right with gradients but a compiled
    no-grad forward hit an illegal memory access (calls 2-3). As an operator its outputs are
    real tensors with the layout its fake declares (tests: torch.library.opcheck).

    On CUDA (rows of at most 64 tiles) one Triton launch computes the same tensors
    (:mod:`megacpp.kernels.ops.attention.triton`); the torch code below is its truth."""
    if doc_ids.is_cuda:
        from megacpp.kernels.ops.attention import triton as kernels

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
    """FlexAttention's ``kernel_options`` for queries like ``q``: :data:`HOPPER_D64_OPTIONS` on
    an sm90 GPU for bf16 / fp16 at head dim 64, else None (Inductor's defaults). Constant under
    torch.compile (Dynamo folds the device properties)."""
    if not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16) or q.shape[-1] != 64:
        return None
    props = torch.cuda.get_device_properties(q.device)
    return HOPPER_D64_OPTIONS if (props.major, props.minor) == (9, 0) else None


def document_attention_flex(q: Tensor, k: Tensor, v: Tensor, doc_ids: Tensor) -> Tensor:
    """FlexAttention over :func:`document_block_mask`: the same function as the reference.
    On CUDA compiled (inside a compiled function, as the model's compiled blocks call it, the
    enclosing compile traces it), with :func:`flex_kernel_options`; eager on CPU, as the CPU
    tests run it (torch has no CPU backward)."""
    flex = (_compiled_flex() if q.is_cuda and not torch.compiler.is_compiling()
            else flex_attention)
    return flex(q, k, v, block_mask=document_block_mask(doc_ids), enable_gqa=True,
                kernel_options=flex_kernel_options(q))
