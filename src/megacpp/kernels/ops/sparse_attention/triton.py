"""Sparse latent attention over each query's selected keys in Triton, forward and backward
(the ``sparse_attention`` surface): DSA's absorbed (MQA) attention, every head of a query over
the same k selected latents, with the selected rows loaded by index inside the kernel.

The reference gathers the selected rows first, ``[B, C, k, r + dr]`` per chunk of C queries,
and keeps them for backward; at the nam56r-cut13 shape (r 128, dr 32, k 512) that is 160 KiB
of bf16 a query, ~1.3 GB for 8k tokens, written once and read three times. Here nothing of
that size exists: one program per (query, row) walks its k indices in blocks of BK and loads
those latent and RoPE-key rows straight from ``latent`` [B, T, r] / ``k_rope`` [B, T, dr]
(neighbouring queries pick overlapping keys, so most of those reads hit L2).

Forward, per query t (H heads padded to BH >= 16 rows, the MMA's minimum)::

    s[h, j]  = scale * (q_latent[h] . latent[idx_j] + q_rope[h] . k_rope[idx_j])  (-inf if invalid)
    o[h]     = softmax_j(s[h]) @ latent[idx]        online softmax over key blocks, float32
    lse[h]   = log-sum-exp of s[h]                  saved for backward
    probs[j] = mean_h exp(s[h, j] - lse[h])         optional second pass (the indexer's KL target)

Backward, per query t, the scores recomputed from lse (nothing [k]-sized saved)::

    p = exp(s - lse);  dp = do @ latent[idx]^T;  ds = p * (dp - delta),  delta[h] = do[h] . o[h]
    dq_latent = scale * ds @ latent[idx];  dq_rope = scale * ds @ k_rope[idx]
    dlatent[idx] += p^T @ do + scale * ds^T @ q_latent;  dk_rope[idx] += scale * ds^T @ q_rope

The key gradients are scattered with float32 atomic adds into [B, T, r] / [B, T, dr] buffers
(many queries pick one key), so their summation order -- and the last bits of dlatent and
dk_rope -- vary from run to run. Launch settings: ``configs.py``.

Saved for backward: the inputs (views of the caller's tensors, made contiguous), the int32
indices (-1 for an invalid slot), the output and lse [B, C, H] -- no gathered rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from megacpp.errors import MegaCppError
from megacpp.kernels.amp import autocast_operands
from megacpp.kernels.device import next_power_of_2
from megacpp.kernels.launch import for_device
from megacpp.kernels.ops.sparse_attention.configs import CONFIGS, SparseAttentionConfig


@triton.jit
def _load_rows(IDX, LAT, KR, row_q, b, T, K, j0, r, dr, R: tl.constexpr, DR: tl.constexpr,
               BK: tl.constexpr):
    """Block j0..j0+BK of query row_q's indices and the latent [BK, BR] / RoPE-key [BK, BDR]
    rows they name (zeros for an invalid or padded slot)."""
    j = j0 + tl.arange(0, BK)
    idx = tl.load(IDX + row_q * K + j, mask=j < K, other=-1)
    ok = idx >= 0
    key = (b * T + tl.where(ok, idx, 0)).to(tl.int64)
    lat = tl.load(LAT + key[:, None] * R + r[None, :], mask=ok[:, None] & (r < R)[None, :],
                  other=0.0)
    kr = tl.load(KR + key[:, None] * DR + dr[None, :], mask=ok[:, None] & (dr < DR)[None, :],
                 other=0.0)
    return j, idx, ok, key, lat, kr


@triton.jit
def _scores(ql, qr, lat, kr, ok, scale, PREC: tl.constexpr):
    """[BH, BK] float32 scores of the block, -inf where the slot is invalid."""
    s = tl.dot(ql, tl.trans(lat), input_precision=PREC)
    s += tl.dot(qr, tl.trans(kr), input_precision=PREC)
    return tl.where(ok[None, :], s * scale, float("-inf"))


@triton.jit
def _sparse_fwd(QL, QR, LAT, KR, IDX, O, LSE, PROBS, scale, L, T, K, H: tl.constexpr,
                R: tl.constexpr, DR: tl.constexpr, BH: tl.constexpr, BR: tl.constexpr,
                BDR: tl.constexpr, BK: tl.constexpr, WRITE_PROBS: tl.constexpr,
                PREC: tl.constexpr):
    t = tl.program_id(0)
    b = tl.program_id(1)
    row_q = (b * L + t).to(tl.int64)
    h = tl.arange(0, BH)
    r = tl.arange(0, BR)
    dr = tl.arange(0, BDR)
    hm = h < H
    ql = tl.load(QL + (row_q * H + h[:, None]) * R + r[None, :],
                 mask=hm[:, None] & (r < R)[None, :], other=0.0)  # [BH, BR]
    qr = tl.load(QR + (row_q * H + h[:, None]) * DR + dr[None, :],
                 mask=hm[:, None] & (dr < DR)[None, :], other=0.0)  # [BH, BDR]
    # running max from a finite stand-in for -inf: exp(-inf - m) is 0, the first rescale is 1
    m_i = tl.full([BH], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BH, BR], dtype=tl.float32)
    for j0 in range(0, K, BK):
        _j, _idx, ok, _key, lat, kr = _load_rows(IDX, LAT, KR, row_q, b, T, K, j0, r, dr, R,
                                                  DR, BK)
        s = _scores(ql, qr, lat, kr, ok, scale, PREC)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat, input_precision=PREC)
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(O + (row_q * H + h[:, None]) * R + r[None, :], o.to(O.dtype.element_ty),
             mask=hm[:, None] & (r < R)[None, :])
    lse = m_i + tl.log(l_i)
    tl.store(LSE + row_q * H + h, lse, mask=hm)
    if WRITE_PROBS:
        lse_h = tl.where(hm, lse, float("inf"))  # padded heads: p = 0
        for j0 in range(0, K, BK):
            j, _idx, ok, _key, lat, kr = _load_rows(IDX, LAT, KR, row_q, b, T, K, j0, r, dr, R,
                                                    DR, BK)
            p = tl.exp(_scores(ql, qr, lat, kr, ok, scale, PREC) - lse_h[:, None])
            tl.store(PROBS + row_q * K + j, tl.sum(p, axis=0) / H, mask=j < K)


@triton.jit
def _sparse_bwd(QL, QR, LAT, KR, IDX, DO, LSE, DELTA, DQL, DQR, DLAT, DKR, scale, L, T, K,
                H: tl.constexpr, R: tl.constexpr, DR: tl.constexpr, BH: tl.constexpr,
                BR: tl.constexpr, BDR: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    t = tl.program_id(0)
    b = tl.program_id(1)
    row_q = (b * L + t).to(tl.int64)
    h = tl.arange(0, BH)
    r = tl.arange(0, BR)
    dr = tl.arange(0, BDR)
    hm = h < H
    q_mask, qr_mask = hm[:, None] & (r < R)[None, :], hm[:, None] & (dr < DR)[None, :]
    ql = tl.load(QL + (row_q * H + h[:, None]) * R + r[None, :], mask=q_mask, other=0.0)
    qr = tl.load(QR + (row_q * H + h[:, None]) * DR + dr[None, :], mask=qr_mask, other=0.0)
    do = tl.load(DO + (row_q * H + h[:, None]) * R + r[None, :], mask=q_mask, other=0.0)
    lse = tl.load(LSE + row_q * H + h, mask=hm, other=float("inf"))  # padded heads: p = 0
    delta = tl.load(DELTA + row_q * H + h, mask=hm, other=0.0)
    dql = tl.zeros([BH, BR], dtype=tl.float32)
    dqr = tl.zeros([BH, BDR], dtype=tl.float32)
    for j0 in range(0, K, BK):
        _j, _idx, ok, key, lat, kr = _load_rows(IDX, LAT, KR, row_q, b, T, K, j0, r, dr, R,
                                                 DR, BK)
        p = tl.exp(_scores(ql, qr, lat, kr, ok, scale, PREC) - lse[:, None])  # [BH, BK]
        dp = tl.dot(do, tl.trans(lat), input_precision=PREC)
        ds = p * (dp - delta[:, None]) * scale  # [BH, BK], 0 where invalid
        ds_in = ds.to(lat.dtype)
        dql += tl.dot(ds_in, lat, input_precision=PREC)
        dqr += tl.dot(ds_in, kr, input_precision=PREC)
        dlat = tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PREC)
        dlat += tl.dot(tl.trans(ds_in), ql, input_precision=PREC)  # [BK, BR]
        dkr = tl.dot(tl.trans(ds_in), qr, input_precision=PREC)  # [BK, BDR]
        tl.atomic_add(DLAT + key[:, None] * R + r[None, :], dlat,
                      mask=ok[:, None] & (r < R)[None, :])
        tl.atomic_add(DKR + key[:, None] * DR + dr[None, :], dkr,
                      mask=ok[:, None] & (dr < DR)[None, :])
    tl.store(DQL + (row_q * H + h[:, None]) * R + r[None, :], dql.to(DQL.dtype.element_ty),
             mask=q_mask)
    tl.store(DQR + (row_q * H + h[:, None]) * DR + dr[None, :], dqr.to(DQR.dtype.element_ty),
             mask=qr_mask)


def _meta(q_latent: Tensor, q_rope: Tensor, config: SparseAttentionConfig) -> dict:
    """Block sizes: heads, latent and RoPE widths padded to powers of two >= 16; the key
    block capped so the backward's float32 [BK, BR] key-gradient tile stays at 8192 values
    (64 keys at r 128, 16 at r 512) instead of spilling registers."""
    H, R, DR = q_latent.shape[2], q_latent.shape[3], q_rope.shape[3]
    BR = max(16, next_power_of_2(R))
    return {"H": H, "R": R, "DR": DR, "BH": max(16, next_power_of_2(H)),
            "BR": BR, "BDR": max(16, next_power_of_2(DR)),
            "BK": min(config.block_k, max(16, 8192 // BR)), "num_warps": config.num_warps,
            "PREC": "ieee" if q_latent.dtype == torch.float32 else "tf32"}


class _SparseLatentAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_latent: Tensor, q_rope: Tensor, latent: Tensor, k_rope: Tensor,
                idx: Tensor, scale: float, with_probs: bool, config: SparseAttentionConfig):
        B, C, H, _ = q_latent.shape
        T, K = latent.shape[1], idx.shape[-1]
        ql, qr, lat, kr = (t.contiguous() for t in (q_latent, q_rope, latent, k_rope))
        o = torch.empty_like(ql)
        lse = torch.empty(B, C, H, device=ql.device, dtype=torch.float32)
        probs = torch.empty(B, C, K, device=ql.device, dtype=torch.float32) if with_probs else lse
        meta = _meta(ql, qr, config)
        _sparse_fwd[(C, B)](ql, qr, lat, kr, idx, o, lse, probs, scale, C, T, K,
                            WRITE_PROBS=with_probs, **meta)
        ctx.save_for_backward(ql, qr, lat, kr, idx, o, lse)
        ctx.scale, ctx.config = scale, config
        if not with_probs:
            return o
        ctx.mark_non_differentiable(probs)
        return o, probs

    @staticmethod
    def backward(ctx, do: Tensor, *_dprobs):
        ql, qr, lat, kr, idx, o, lse = ctx.saved_tensors
        B, C, _, R = ql.shape
        T, K = lat.shape[1], idx.shape[-1]
        do = do.contiguous()
        delta = (do.float() * o.float()).sum(-1)  # [B, C, H]
        dql, dqr = torch.empty_like(ql), torch.empty_like(qr)
        dlat = torch.zeros(B, T, R, device=ql.device, dtype=torch.float32)
        dkr = torch.zeros(B, T, qr.shape[-1], device=ql.device, dtype=torch.float32)
        _sparse_bwd[(C, B)](ql, qr, lat, kr, idx, do, lse, delta, dql, dqr, dlat, dkr,
                            ctx.scale, C, T, K, **_meta(ql, qr, ctx.config))
        return dql, dqr, dlat.to(lat.dtype), dkr.to(kr.dtype), None, None, None, None


def _checked(q_latent: Tensor, q_rope: Tensor, latent: Tensor, k_rope: Tensor, indices: Tensor,
             valid: Tensor) -> Tensor:
    """The int32 indices with -1 in invalid slots, after checking the shapes."""
    B, C, H, R = q_latent.shape
    k = indices.shape[-1]
    ok = (q_rope.shape[:3] == (B, C, H) and latent.shape[::2] == (B, R)
          and k_rope.shape[:2] == latent.shape[:2] and k_rope.shape[2] == q_rope.shape[3]
          and indices.shape == valid.shape == (B, C, k) and not indices.is_floating_point())
    if not ok:
        raise MegaCppError(
            "sparse_attention triton: expected q_latent [B, C, H, r], q_rope [B, C, H, dr], "
            "latent [B, T, r], k_rope [B, T, dr], indices and valid [B, C, k]; got "
            f"{[list(t.shape) for t in (q_latent, q_rope, latent, k_rope, indices, valid)]}")
    if q_latent.dtype == torch.float64:
        raise MegaCppError("sparse_attention triton: float64 is not supported (use the reference)")
    if len({t.dtype for t in (q_latent, q_rope, latent, k_rope)}) != 1:
        raise MegaCppError("sparse_attention triton: q_latent, q_rope, latent and k_rope must "
                           "share one dtype, got "
                           f"{[str(t.dtype) for t in (q_latent, q_rope, latent, k_rope)]}")
    if max(latent.numel(), q_latent.numel(), indices.numel()) >= 2**31:
        raise MegaCppError("sparse_attention triton: tensors of 2**31 elements or more are not "
                           "supported (32-bit offsets); split the batch")
    return torch.where(valid, indices, -1).to(torch.int32).contiguous()


def sparse_latent_attention_triton(
    q_latent: Tensor, q_rope: Tensor, latent: Tensor, k_rope: Tensor, indices: Tensor,
    valid: Tensor, scale: float, with_probs: bool = False,
    config: SparseAttentionConfig | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Same contract as :func:`megacpp.kernels.ops.sparse_attention.reference.
    sparse_latent_attention` (bf16, fp16 or fp32 operands). ``config``: the launch setting
    (default: ``configs.CONFIGS`` for the device). Under autocast, float32 operands run in
    the autocast dtype, as the reference's einsums do."""
    q_latent, q_rope, latent, k_rope = autocast_operands(q_latent, q_rope, latent, k_rope)
    idx = _checked(q_latent, q_rope, latent, k_rope, indices, valid)
    config = config or for_device(CONFIGS, q_latent.device)
    out = _SparseLatentAttentionFn.apply(q_latent, q_rope, latent, k_rope, idx, float(scale),
                                         bool(with_probs), config)
    return (out[0], out[1]) if with_probs else (out, None)
