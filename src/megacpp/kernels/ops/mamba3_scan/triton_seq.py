"""Mamba-3 SISO scan in Triton: the fused sequential forward (one program per head and row).

Same math as ``_fwd_state`` + ``_fwd_out`` in ``triton.py`` (chunk-local rotation frames,
even/odd pair halves, the same helpers) in one kernel, so the [P, N] state stays in
registers between chunks and q/k are rotated once:

  _fwd_seq (H, B)  walks the chunks: y of each chunk (intra + carried state + D x, gated),
                   then the state update; stores S_in[c] (what the chunk-parallel backward
                   reads), phi per chunk and S_final, exactly as the two-kernel forward does.

A fused sequential backward was tried too (2026-11-22) and measured 1.4-3x slower than the
chunk-parallel backward on an H100 (benchmarks/results/kernels/mamba3_h100_s2.log); it is not
kept.
"""

from __future__ import annotations

import triton
import triton.language as tl

from megacpp.kernels.ops.mamba3_scan.triton import (
    _advance_state,
    _bias_pairs,
    _chunk_scalars,
    _cos_sin,
    _decay_matrix,
    _load_rotated,
    _local_angle,
    _mm,
    _segments,
    _state_ptrs,
)


@triton.jit
def _fwd_seq(Q, K, V, Z, Y, ADT, DT, TRAP, ANG, QBIAS, KBIAS, DSKIP, RESET, SIN, SFIN, PHI,
             sq_b, sq_l, sq_g, sq_n, sk_b, sk_l, sk_g, sk_n,
             sv_b, sv_l, sv_h, sv_p, sz_b, sz_l, sz_h, sz_p,
             sa_b, sa_l, sa_h, sd_b, sd_l, sd_h, st_b, st_l, st_h,
             sg_b, sg_l, sg_h, sg_r, sqb_h, sqb_n, skb_h, skb_n,
             L, H, G, NC, P, N, R,
             T: tl.constexpr, BP: tl.constexpr, N2B: tl.constexpr, HAS_D: tl.constexpr,
             HAS_Z: tl.constexpr, HAS_RESET: tl.constexpr, DOT: tl.constexpr,
             FAST: tl.constexpr, PAIRED: tl.constexpr):
    h, b = tl.program_id(0), tl.program_id(1)
    g = h // (H // G)
    t = tl.arange(0, T)
    j = tl.arange(0, N2B)
    p = tl.arange(0, BP)
    mp = (p < P)[:, None]  # [BP, 1]
    qb_e, qb_o = _bias_pairs(QBIAS, h, N, sqb_h, sqb_n, N2B)
    kb_e, kb_o = _bias_pairs(KBIAS, h, N, skb_h, skb_n, N2B)
    d_skip = 0.0
    if HAS_D:
        d_skip = tl.load(DSKIP + h).to(tl.float32)
    s_e = tl.zeros([BP, N2B], dtype=tl.float32)  # state entering the chunk, in its frame
    s_o = tl.zeros([BP, N2B], dtype=tl.float32)
    for c in range(NC):
        bhc = (b * H + h) * NC + c
        ptr = _state_ptrs(SIN, bhc * P, p, N2B)
        sr_e = s_e.to(SIN.dtype.element_ty)  # the read-out and the backward use S_in rounded
        sr_o = s_o.to(SIN.dtype.element_ty)
        tl.store(ptr, sr_e, mask=mp)
        tl.store(ptr + N2B, sr_o, mask=mp)
        t0 = c * T
        tok = t0 + t
        live = tok < L
        mask = live[:, None] & (p < P)[None, :]
        a, dt, _lam, gamma, scale = _chunk_scalars(ADT, DT, TRAP, b, h, t0, L, sa_b, sa_l, sa_h,
                                                  sd_b, sd_l, sd_h, st_b, st_l, st_h, T)
        seg = _segments(RESET, b, t0, L, T, HAS_RESET)
        ell, _th = _local_angle(ANG, dt, b, h, t0, L, R, sg_b, sg_l, sg_h, sg_r, T, N2B)
        cos, sin = _cos_sin(ell, FAST)
        q_e, q_o = _load_rotated(Q, b * sq_b + tok * sq_l + g * sq_g, live, N, sq_n,
                                 qb_e, qb_o, cos, sin, N2B, PAIRED)
        k_e, k_o = _load_rotated(K, b * sk_b + tok * sk_l + g * sk_g, live, N, sk_n,
                                 kb_e, kb_o, cos, sin, N2B, PAIRED)
        q_e, q_o, k_e, k_o = q_e.to(DOT), q_o.to(DOT), k_e.to(DOT), k_o.to(DOT)
        x = tl.load(V + b * sv_b + tok[:, None] * sv_l + h * sv_h + p[None, :] * sv_p,
                    mask=mask, other=0.0).to(tl.float32)

        # y: intra-chunk pairs + the carried state's read-out (+ D x, gated)
        w = _decay_matrix(a, seg, T) * scale[None, :] + tl.where(
            t[:, None] == t[None, :], gamma[:, None], 0.0)
        scores = (_mm(q_e, tl.trans(k_e), DOT) + _mm(q_o, tl.trans(k_o), DOT)) * w  # [T, T]
        carry = tl.where(seg == 0, tl.exp(a), 0.0)
        inter = _mm(q_e, tl.trans(sr_e), DOT) + _mm(q_o, tl.trans(sr_o), DOT)  # [T, BP]
        y = _mm(scores, x, DOT) + carry[:, None] * inter + d_skip * x
        if HAS_Z:
            z = tl.load(Z + b * sz_b + tok[:, None] * sz_l + h * sz_h + p[None, :] * sz_p,
                        mask=mask, other=0.0).to(tl.float32)
            y = y * z * tl.sigmoid(z)
        out = Y + ((b * L + tok[:, None]).to(tl.int64) * H + h) * P + p[None, :]
        tl.store(out, y.to(Y.dtype.element_ty), mask=mask)

        # the state at the chunk's end, rotated by -phi into the next chunk's frame
        s_e, s_o, phi = _advance_state(s_e, s_o, x, a, seg, scale, k_e, k_o, ell, t, T, DOT,
                                       FAST)
        tl.store(PHI + bhc * N2B + j, phi)
    ptr = _state_ptrs(SFIN, (b * H + h) * P, p, N2B)
    tl.store(ptr, s_e, mask=mp)
    tl.store(ptr + N2B, s_o, mask=mp)
