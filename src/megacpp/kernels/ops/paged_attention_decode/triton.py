"""Decode attention read straight from the paged K/V pool (the ``paged_attention_decode``
surface's fast row).

The reference (``reference.py``) gathers every row's blocks into a dense [B, T, Hkv, hd] copy
of K and V, builds a [B, T] mask and runs the grouped attention as einsum / softmax / einsum:
about a dozen kernels per layer and two extra passes over the gathered K/V. Here one program
per (row, K/V head, key split) loads its row's keys and values in place through the block
table (token t of row b lives at ``pool[block_tables[b, t // block_size], t % block_size]``),
scores the G = H // Hkv query heads of its group against them with ``tl.dot``, and keeps an
online softmax in float32 (running max, running sum, rescaled accumulator). A row attends to
keys 0..pos; its keys past pos (the rest of the bucket's width) are masked, and splits that
start past pos write an empty partial. With more than one split a second kernel combines the
partials (flash-decoding). The grid depends only on the shapes (batch, table width), never
on the positions, and nothing syncs with the host, so both launches are captured in the
engine's decode graphs.

Rounding: scores and softmax in float32 (the reference rounds the q.k products to q's dtype
first), probabilities rounded to the values' dtype for the second product (as the
reference's ``probs.to(values.dtype)``), float32 accumulation, output in q's dtype. float32
inputs multiply in full float32 (``input_precision="ieee"``, no TF32). Forward only.
"""

from __future__ import annotations

from types import MappingProxyType

import torch
import triton
import triton.language as tl
from torch import Tensor

from megacpp.errors import MegaCppError
from megacpp.kernels.device import next_power_of_2
from megacpp.kernels.launch import for_device
from megacpp.kernels.ops.paged_attention_decode.configs import CONFIGS, DecodeConfig, split_keys
from megacpp.kernels.ops.paged_attention_decode.reference import check_decode_inputs

# tl.dot's input precision by dtype: full float32 for float32 (no TF32), the default for halves
_DTYPES = MappingProxyType({torch.float32: "ieee", torch.bfloat16: None, torch.float16: None})


@triton.jit
def _decode_kernel(
    Q, K, V, TABLES, POS, O, M_PART, L_PART, ACC_PART,
    stride_qb, stride_qh, stride_kblk, stride_ktok, stride_kh, stride_vblk, stride_vtok,
    stride_vh, stride_tb, stride_tw, stride_pos, stride_ob, stride_oh,
    n_table, G, D, keys_per_split, scale,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    N_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
):
    """One program per (row b, K/V head kh, split s): keys [s * keys_per_split, ...) of row b
    up to its position, against the G query heads of group kh."""
    b = tl.program_id(0).to(tl.int64)
    kh = tl.program_id(1)
    split = tl.program_id(2)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_g = offs_g < G
    mask_d = offs_d < D
    heads = kh * G + offs_g  # [BLOCK_G] query heads of the group

    pos = tl.load(POS + b * stride_pos).to(tl.int32)
    n_keys = tl.minimum(pos + 1, n_table * PAGE)  # keys 0..pos, within the table's width
    start = split * keys_per_split
    stop = tl.minimum(start + keys_per_split, n_keys)

    q_ptrs = Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_g[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = TABLES + b * stride_tb
    for t0 in range(start, stop, BLOCK_N):
        offs_t = t0 + offs_n  # [BLOCK_N] key positions
        mask_t = offs_t < stop
        block = tl.load(table + (offs_t // PAGE) * stride_tw, mask=mask_t, other=0).to(tl.int64)
        token = (offs_t % PAGE).to(tl.int64)
        mask_td = mask_t[:, None] & mask_d[None, :]
        k = tl.load(K + block[:, None] * stride_kblk + token[:, None] * stride_ktok
                    + kh * stride_kh + offs_d[None, :], mask=mask_td, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [G, N] float32
        scores = tl.where(mask_t[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # finite: key t0 is valid
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(V + block[:, None] * stride_vblk + token[:, None] * stride_vtok
                    + kh * stride_vh + offs_d[None, :], mask=mask_td, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    mask_gd = mask_g[:, None] & mask_d[None, :]
    if N_SPLITS == 1:  # key 0 is always attended, so l_i > 0
        out = acc / l_i[:, None]
        o_ptrs = O + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=mask_gd)
    else:  # partials [B, H, N_SPLITS] (m, l) and [B, H, N_SPLITS, BLOCK_D] (acc), float32
        H = tl.num_programs(1) * G
        part = (b * H + heads) * N_SPLITS + split  # [BLOCK_G]
        tl.store(M_PART + part, m_i, mask=mask_g)
        tl.store(L_PART + part, l_i, mask=mask_g)
        tl.store(ACC_PART + part[:, None] * BLOCK_D + offs_d[None, :], acc, mask=mask_gd)


@triton.jit
def _combine_kernel(
    M_PART, L_PART, ACC_PART, O, stride_ob, stride_oh, D,
    N_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per (row b, query head h): the splits' partial softmaxes combined. Splits
    with no keys carry m = -inf, l = 0 and weigh nothing; split 0 always has key 0."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    H = tl.num_programs(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < N_SPLITS
    part = (b * H + h) * N_SPLITS + offs_s  # [BLOCK_S]
    m = tl.load(M_PART + part, mask=mask_s, other=float("-inf"))
    l_s = tl.load(L_PART + part, mask=mask_s, other=0.0)
    acc = tl.load(ACC_PART + part[:, None] * BLOCK_D + offs_d[None, :], mask=mask_s[:, None],
                  other=0.0)  # [BLOCK_S, BLOCK_D]
    m_max = tl.max(m, axis=0)
    weight = tl.exp(m - m_max)  # 0 for empty splits
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(l_s * weight, axis=0)
    tl.store(O + b * stride_ob + h * stride_oh + offs_d, out.to(O.dtype.element_ty),
             mask=offs_d < D)


def paged_attention_decode_triton(
    q: Tensor, k_pool: Tensor, v_pool: Tensor, block_tables: Tensor, positions: Tensor,
    *, config: DecodeConfig | None = None,
) -> Tensor:
    """:func:`~megacpp.kernels.ops.paged_attention_decode.reference.paged_attention_decode_reference`
    in one launch (two with a key split): same arguments and result. Needs unit-stride last
    dims of q and the pools (any other strides, e.g. a bucket's slice of the block table).
    ``config``: the launch settings (default: ``configs.CONFIGS`` for q's device)."""
    check_decode_inputs(q, k_pool, v_pool, block_tables, positions)
    if q.dtype not in _DTYPES:
        raise MegaCppError(f"paged_attention_decode triton: q must be one of "
                           f"{sorted(str(d) for d in _DTYPES)}, got {q.dtype}")
    for name, t in (("q", q), ("k_pool", k_pool), ("v_pool", v_pool)):
        if t.stride(-1) != 1:
            raise MegaCppError(f"paged_attention_decode triton: {name}'s last dim must be "
                               f"unit-stride")
    config = config or for_device(CONFIGS, q.device)
    if config.block_n < 16:
        raise MegaCppError(f"paged_attention_decode triton: block_n must be >= 16, got "
                           f"{config.block_n}")
    batch, heads, head_dim = q.shape
    _, page, kv_heads, _ = k_pool.shape
    group = heads // kv_heads
    out = torch.empty(batch, heads, head_dim, device=q.device, dtype=q.dtype)
    if batch == 0:
        return out
    n_table = block_tables.shape[1]
    splits, keys_per_split = split_keys(batch, kv_heads, n_table * page, config)
    block_d = max(16, next_power_of_2(head_dim))
    if splits > 1:
        f32 = {"device": q.device, "dtype": torch.float32}
        m_part = torch.empty(batch, heads, splits, **f32)
        l_part = torch.empty(batch, heads, splits, **f32)
        acc_part = torch.empty(batch, heads, splits, block_d, **f32)
    else:
        m_part = l_part = acc_part = out  # unused
    _decode_kernel[(batch, kv_heads, splits)](
        q, k_pool, v_pool, block_tables, positions, out, m_part, l_part, acc_part,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        block_tables.stride(0), block_tables.stride(1), positions.stride(0),
        out.stride(0), out.stride(1),
        n_table, group, head_dim, keys_per_split, head_dim**-0.5,
        PAGE=page, BLOCK_N=config.block_n, BLOCK_G=max(16, next_power_of_2(group)),
        BLOCK_D=block_d, N_SPLITS=splits, PRECISION=_DTYPES[q.dtype],
        num_warps=config.num_warps_f32 if q.dtype == torch.float32 else config.num_warps,
    )
    if splits > 1:
        _combine_kernel[(batch, heads)](
            m_part, l_part, acc_part, out, out.stride(0), out.stride(1), head_dim,
            N_SPLITS=splits, BLOCK_S=next_power_of_2(splits), BLOCK_D=block_d,
        )
    return out
