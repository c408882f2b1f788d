"""Plain-PyTorch reference for decode attention over a paged K/V pool (one query per row).

What ``GroupedQueryAttention.forward_paged`` computes after its projections, norms and RoPE
when every row brings one token (L == 1), per row b with position ``pos = positions[b]``:

    keys, values = pool[block_tables[b]] flattened to [T, Hkv, hd]   (T = W * block_size)
    scores[h, t] = (q[b, h] . keys[t, h // G]) * hd ** -0.5   in at least float32, t <= pos
    out[b, h] = softmax(scores[h]) (rounded to the values' dtype) @ values[:, h // G]

with G = H // Hkv query heads sharing a K/V head. This is the model's gather
(``PagedPool.read``), causal mask (``PagedBatch.allowed_keys``) and ``grouped_attention``
at L == 1, written as one function of the pool so a kernel can replace it. No soft-capping.
Forward only (decode is inference).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def check_decode_inputs(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_tables: Tensor,
                        positions: Tensor) -> None:
    """Fail with a message naming the tensor, its shape and what was expected."""
    if q.ndim != 3 or k_pool.ndim != 4:
        raise ValueError(f"paged_attention_decode: q must be [B, H, hd] and k_pool "
                         f"[blocks, block_size, Hkv, hd], got {tuple(q.shape)} and "
                         f"{tuple(k_pool.shape)}")
    batch, heads, head_dim = q.shape
    kv_heads = k_pool.shape[2]
    if k_pool.shape[3] != head_dim or heads % kv_heads:
        raise ValueError(f"paged_attention_decode: q's {heads} heads of {head_dim} must be a "
                         f"multiple of k_pool's {kv_heads} heads of {k_pool.shape[3]}")
    if tuple(v_pool.shape) != tuple(k_pool.shape):
        raise ValueError(f"paged_attention_decode: v_pool has shape {tuple(v_pool.shape)}, "
                         f"expected k_pool's {tuple(k_pool.shape)}")
    if block_tables.ndim != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"paged_attention_decode: block_tables has shape "
                         f"{tuple(block_tables.shape)}, expected ({batch}, n_blocks)")
    if tuple(positions.shape) != (batch,):
        raise ValueError(f"paged_attention_decode: positions has shape "
                         f"{tuple(positions.shape)}, expected ({batch},)")
    for name, t in (("block_tables", block_tables), ("positions", positions)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"paged_attention_decode: {name} must be int32 or int64, got "
                             f"{t.dtype}")
    if len({q.dtype, k_pool.dtype, v_pool.dtype}) != 1:
        raise ValueError(f"paged_attention_decode: q, k_pool and v_pool must share a dtype, got "
                         f"{q.dtype}, {k_pool.dtype}, {v_pool.dtype}")


def paged_attention_decode_reference(
    q: Tensor, k_pool: Tensor, v_pool: Tensor, block_tables: Tensor, positions: Tensor
) -> Tensor:
    """Attention of one query token per row over its cached keys 0..pos.

    Args:
        q: [B, H, hd] each row's query (after QK-norm and RoPE).
        k_pool, v_pool: [num_blocks, block_size, Hkv, hd] the layer's paged pool (the new
            token's K/V already written); H a multiple of Hkv.
        block_tables: [B, W] int the pool block of each row's positions
            [i * block_size, (i + 1) * block_size); entries past a row's length point
            anywhere valid (the engine's scratch block).
        positions: [B] int each row's query position; keys 0..pos are attended
            (pos < W * block_size).
    Returns:
        [B, H, hd] in q's dtype.
    """
    check_decode_inputs(q, k_pool, v_pool, block_tables, positions)
    batch, heads, head_dim = q.shape
    kv_heads = k_pool.shape[2]
    keys = k_pool[block_tables].flatten(1, 2)  # [B, T, Hkv, hd]
    values = v_pool[block_tables].flatten(1, 2)
    n_keys = keys.shape[1]
    allowed = torch.arange(n_keys, device=q.device)[None, :] <= positions[:, None]  # [B, T]
    qg = q.reshape(batch, kv_heads, heads // kv_heads, head_dim)  # heads of a group adjacent
    dtype = torch.promote_types(q.dtype, torch.float32)
    scores = torch.einsum("bkgd,btkd->bkgt", qg, keys).to(dtype) * head_dim**-0.5
    scores = scores.masked_fill(~allowed[:, None, None], -math.inf)  # [B, Hkv, G, T]
    probs = scores.softmax(-1).to(values.dtype)
    out = torch.einsum("bkgt,btkd->bkgd", probs, values)  # [B, Hkv, G, hd]
    return out.reshape(batch, heads, head_dim)
