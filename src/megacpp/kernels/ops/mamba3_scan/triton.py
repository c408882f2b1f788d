"""Mamba-3 SISO chunked scan in Triton, forward and backward, chunk-parallel.

Same contract as :func:`mamba3_scan_chunked` (reference.py; equations in docs/mamba3.md) for
the training path, with these limits (the caller uses the reference outside them):
``initial_state`` must be ``None`` (a cached prefill runs the reference; the mixer picks it),
``chunk_size`` 16, 32 or 64, headdim <= 64, d_state <= 128, no float64, and no gradient
through the returned final state. ``reset`` [B, L] bool packs documents into one row.
Operands may be bf16/fp16/fp32; everything accumulates in float32. Matmul operands are bf16
unless ``v`` is float32 (then float32 with IEEE products). The kernels run chunks of
``min(chunk_size, TUNING["max_chunk"])`` = 32 tokens: any chunking computes the same function
(only rounding differs), and 32 measured faster than 64 on an H100 (fp32 operands also need
it to fit shared memory).

Chunk-local rotation frames. Only angle differences between tokens matter, so each chunk
rotates its q/k by the angle accumulated *inside the chunk* (``ell``, starting at 0), and the
state passed between chunks is re-expressed in the next chunk's frame by rotating it by
``-phi_c`` (phi_c = the chunk's total angle). No long cumulative angle is ever formed, and
the angle backward is chunk-local too (``d phi_c`` comes from the state's rotation).

Pairs. ``rot`` turns pairs ``(n = 2j, n = 2j+1)``; the kernels hold every [*, N] operand as its
even and odd halves [*, N/2] (pairs j >= R get angle 0), so a rotation is elementwise.

Kernels (grid):
  forward   _fwd_state  (P tiles, H, B)  walks the chunks: S_in[c] (stored), S_final, phi
            _fwd_out    (H, C, B)        y = (intra + exp(a) q S_in^T + D x) * silu(z)
  backward  _bwd_dstate (P tiles, H, B)  walks the chunks backwards: G_c = dL/dU_c (stored),
                                         and the boundary term of each chunk's first token
            _bwd_intra  (H, C, B)        dx, dz, dD, do, d(q.k) [T, T], the intra-chunk
                                         parts of the scalar grads, <G, S_in> terms
            _bwd_qk     (head blocks*G, C, B)  dq, dk (a program loops over a block of heads
                                         that share q/k, summing dq, dk in registers), the
                                         bias grads, and the adt / dt / trap / angles grads
Saved for backward: the inputs and S_in [B, H, C, P, N] (bf16; float32 for float32 ``v``).
Backward scratch: G (as S_in), do [B, L, H, P], d(q.k) [B, H, C, T, T], fp32 partials.

A fused sequential forward lives in ``triton_seq.py`` (_fwd_seq: one program per (head, row)
walking the chunks with the state in registers; it saves the same S_in), chosen by
``TUNING["fwd"] = "seq"``. The default is still the two-kernel forward above; the H100 sweep
that compared them is in benchmarks/results/kernels/mamba3_h100_s2.log.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from megacpp.errors import MegaCppError
from megacpp.kernels.ops.mamba3_scan.reference import Mamba3ScanState, _check_inputs, _rotate

CHUNK_SIZES = (16, 32, 64)
# launch settings per kernel (Triton launch options), the P tile of the two sequential
# kernels, the most heads per program of _bwd_qk, the longest chunk the kernels run; the
# best of a sweep on an H100 (benchmarks/results/kernels/mamba3_h100.log)
TUNING = {
    "launch": {
        "fwd_state": {"num_warps": 4, "num_stages": 1},
        "fwd_out": {"num_warps": 8, "num_stages": 1},
        "bwd_dstate": {"num_warps": 4, "num_stages": 1},
        "bwd_intra": {"num_warps": 8, "num_stages": 1},
        "bwd_qk": {"num_warps": 8, "num_stages": 1},
        "fwd_seq": {"num_warps": 4, "num_stages": 1},
    },
    "fwd": "chunked",  # "chunked": _fwd_state + _fwd_out; "seq": triton_seq._fwd_seq
    "state_bp": 64,
    "main_heads": 8,
    "max_chunk": 32,
}
MAX_HEADDIM = 64
MAX_D_STATE = 128


# -- shared per-chunk pieces -----------------------------------------------------------------
@triton.jit
def _mm(a, b, DOT: tl.constexpr):
    """a @ b with DOT operands, float32 result (IEEE products when DOT is float32)."""
    return tl.dot(a.to(DOT), b.to(DOT), input_precision="ieee")


@triton.jit
def _tanh(x):
    """tanh(x) = 1 - 2 / (exp(2x) + 1) (exact at +-inf), with a fast division."""
    return 1.0 - tl.fdiv(2.0, tl.exp(2.0 * x) + 1.0)


@triton.jit
def _cos_sin(x, FAST: tl.constexpr):
    """cos(x), sin(x); FAST: the hardware approximations after reduction to [-pi, pi]
    (absolute error ~1e-6, used with bf16 operands), else the accurate library calls."""
    if FAST:
        r = x - 6.283185307179586 * tl.floor(x * 0.15915494309189535 + 0.5)
        c = tl.inline_asm_elementwise("cos.approx.f32 $0, $1;", "=f,f", [r], dtype=tl.float32,
                                      is_pure=True, pack=1)
        s = tl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=f,f", [r], dtype=tl.float32,
                                      is_pure=True, pack=1)
    else:
        c = tl.cos(x)
        s = tl.sin(x)
    return c, s


@triton.jit
def _chunk_scalars(ADT, DT, TRAP, b, h, t0, L, sa_b, sa_l, sa_h, sd_b, sd_l, sd_h,
                   st_b, st_l, st_h, T: tl.constexpr):
    """[T] per-token scalars of one chunk and head: a (in-chunk cumsum of adt), dt, lambda,
    gamma = lambda dt, scale = gamma + (1 - lambda_next) dt_next (0 past the end)."""
    tok = t0 + tl.arange(0, T)
    live = tok < L
    nxt = tok + 1 < L
    adt = tl.load(ADT + b * sa_b + tok * sa_l + h * sa_h, mask=live, other=0.0).to(tl.float32)
    dt = tl.load(DT + b * sd_b + tok * sd_l + h * sd_h, mask=live, other=0.0).to(tl.float32)
    trap = tl.load(TRAP + b * st_b + tok * st_l + h * st_h, mask=live, other=0.0)
    dt_n = tl.load(DT + b * sd_b + (tok + 1) * sd_l + h * sd_h, mask=nxt, other=0.0)
    trap_n = tl.load(TRAP + b * st_b + (tok + 1) * st_l + h * st_h, mask=nxt, other=0.0)
    lam = tl.sigmoid(trap.to(tl.float32))
    lam_n = tl.sigmoid(trap_n.to(tl.float32))
    gamma = lam * dt
    scale = gamma + (1.0 - lam_n) * dt_n.to(tl.float32)
    return tl.cumsum(adt, axis=0), dt, lam, gamma, scale


@triton.jit
def _segments(RESET, b, t0, L, T: tl.constexpr, HAS_RESET: tl.constexpr):
    """[T] int32: resets seen so far inside the chunk (0 everywhere without resets)."""
    tok = t0 + tl.arange(0, T)
    if HAS_RESET:
        r = tl.load(RESET + b * L + tok, mask=tok < L, other=0).to(tl.int32)
    else:
        r = tl.zeros([T], dtype=tl.int32)
    return tl.cumsum(r, axis=0)


@triton.jit
def _angle_tanh(ANG, b, h, t0, L, R, sg_b, sg_l, sg_h, sg_r, T: tl.constexpr,
                N2B: tl.constexpr):
    """[T, N2B] tanh of the angle logits (0 for pairs >= R and past the end)."""
    tok = t0 + tl.arange(0, T)
    j = tl.arange(0, N2B)
    m = (tok < L)[:, None] & (j < R)[None, :]
    ptr = ANG + b * sg_b + tok[:, None] * sg_l + h * sg_h + j[None, :] * sg_r
    return _tanh(tl.load(ptr, mask=m, other=0.0).to(tl.float32))


@triton.jit
def _local_angle(ANG, dt, b, h, t0, L, R, sg_b, sg_l, sg_h, sg_r,
                 T: tl.constexpr, N2B: tl.constexpr):
    """[T, N2B] in-chunk cumulative angle ell of each pair (0 for pairs >= R), and tanh(angles)."""
    th = _angle_tanh(ANG, b, h, t0, L, R, sg_b, sg_l, sg_h, sg_r, T, N2B)
    ell = tl.cumsum(3.141592653589793 * th * dt[:, None], axis=0)
    return ell, th


@triton.jit
def _pairs(X, row, live, N, s_n, N2B: tl.constexpr, PAIRED: tl.constexpr):
    """Even and odd columns [T, N2B] (float32, 0 outside) of the rows at offsets ``row``.
    PAIRED (N == 2 * N2B, unit stride): one contiguous [T, N] load split in two."""
    if PAIRED:
        n = tl.arange(0, 2 * N2B)
        x = tl.load(X + row[:, None] + n[None, :], mask=live[:, None], other=0.0)
        e, o = tl.split(tl.reshape(x.to(tl.float32), [x.shape[0], N2B, 2]))
    else:
        j = tl.arange(0, N2B)
        ptr = X + row[:, None] + (2 * j)[None, :] * s_n
        e = tl.load(ptr, mask=live[:, None] & (2 * j < N)[None, :], other=0.0).to(tl.float32)
        o = tl.load(ptr + s_n, mask=live[:, None] & (2 * j + 1 < N)[None, :], other=0.0)
        o = o.to(tl.float32)
    return e, o


@triton.jit
def _bias_pairs(BIAS, h, N, sb_h, sb_n, N2B: tl.constexpr):
    j = tl.arange(0, N2B)
    e = tl.load(BIAS + h * sb_h + 2 * j * sb_n, mask=2 * j < N, other=0.0).to(tl.float32)
    o = tl.load(BIAS + h * sb_h + (2 * j + 1) * sb_n, mask=2 * j + 1 < N, other=0.0)
    return e, o.to(tl.float32)


@triton.jit
def _biased_rotated(raw_e, raw_o, bias_e, bias_o, live, cos, sin):
    """rot(raw + bias, ell) on the even/odd halves; rows past the end are 0."""
    e = tl.where(live[:, None], raw_e + bias_e[None, :], 0.0)
    o = tl.where(live[:, None], raw_o + bias_o[None, :], 0.0)
    return e * cos - o * sin, e * sin + o * cos


@triton.jit
def _load_rotated(X, row, live, N, s_n, bias_e, bias_o, cos, sin, N2B: tl.constexpr,
                  PAIRED: tl.constexpr):
    """rot(x + bias, ell) of q or k rows ``row`` [T], as even/odd halves [T, N2B]."""
    raw_e, raw_o = _pairs(X, row, live, N, s_n, N2B, PAIRED)
    return _biased_rotated(raw_e, raw_o, bias_e, bias_o, live, cos, sin)


@triton.jit
def _decay_matrix(a, seg, T: tl.constexpr):
    """[T, T] exp(a_t - a_s) for s < t in the same document, else 0 (masked before exp)."""
    t = tl.arange(0, T)
    valid = (t[:, None] > t[None, :]) & (seg[:, None] == seg[None, :])
    return tl.exp(tl.where(valid, a[:, None] - a[None, :], float("-inf")))


@triton.jit
def _last(v, T: tl.constexpr):
    """The last element of a [T] vector."""
    return tl.sum(tl.where(tl.arange(0, T) == T - 1, v, 0.0), axis=0)


@triton.jit
def _advance_state(s_e, s_o, x, a, seg, scale, k_e, k_o, ell, t, T: tl.constexpr,
                   DOT: tl.constexpr, FAST: tl.constexpr):
    """The state [BP, N2B] (even/odd halves) at a chunk's end from the state at its start,
    the chunk's x [T, BP] and biased, rotated k halves [T, N2B], rotated by -phi (the chunk's
    total angle) into the next chunk's frame. Returns (s_e, s_o, phi [N2B])."""
    a_last = _last(a, T)
    seg_last = tl.max(seg, axis=0)
    to_end = tl.where(seg == seg_last, tl.exp(a_last - a), 0.0)  # [T]
    xw = tl.trans(x * (to_end * scale)[:, None])  # [BP, T]
    decay = tl.where(seg_last == 0, tl.exp(a_last), 0.0)
    u_e = decay * s_e + _mm(xw, k_e, DOT)  # [BP, N2B]
    u_o = decay * s_o + _mm(xw, k_o, DOT)
    phi = tl.sum(tl.where((t == T - 1)[:, None], ell, 0.0), axis=0)  # [N2B]
    cp, sp = _cos_sin(phi, FAST)
    cp, sp = cp[None, :], sp[None, :]
    return u_e * cp + u_o * sp, u_o * cp - u_e * sp, phi


@triton.jit
def _state_ptrs(S, bhc, p, N2B: tl.constexpr):
    """Pointers of the even half of a [P, 2, N2B] state tile (the odd half is + N2B)."""
    j = tl.arange(0, N2B)
    return S + bhc.to(tl.int64) * (2 * N2B) + p[:, None] * (2 * N2B) + j[None, :]


# -- forward ---------------------------------------------------------------------------------
@triton.jit
def _fwd_state(K, V, ADT, DT, TRAP, ANG, KBIAS, RESET, SIN, SFIN, PHI,
               sk_b, sk_l, sk_g, sk_n, sv_b, sv_l, sv_h, sv_p,
               sa_b, sa_l, sa_h, sd_b, sd_l, sd_h, st_b, st_l, st_h,
               sg_b, sg_l, sg_h, sg_r, skb_h, skb_n,
               L, H, G, NC, P, N, R,
               T: tl.constexpr, BP: tl.constexpr, N2B: tl.constexpr,
               HAS_RESET: tl.constexpr, DOT: tl.constexpr, FAST: tl.constexpr,
               PAIRED: tl.constexpr):
    pid_p, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g = h // (H // G)
    t = tl.arange(0, T)
    j = tl.arange(0, N2B)
    p = pid_p * BP + tl.arange(0, BP)
    mp = (p < P)[:, None]  # [BP, 1]
    kb_e, kb_o = _bias_pairs(KBIAS, h, N, skb_h, skb_n, N2B)
    s_e = tl.zeros([BP, N2B], dtype=tl.float32)  # state entering the chunk, in its frame
    s_o = tl.zeros([BP, N2B], dtype=tl.float32)
    for c in range(NC):
        ptr = _state_ptrs(SIN, ((b * H + h) * NC + c) * P, p, N2B)
        tl.store(ptr, s_e.to(SIN.dtype.element_ty), mask=mp)
        tl.store(ptr + N2B, s_o.to(SIN.dtype.element_ty), mask=mp)
        t0 = c * T
        tok = t0 + t
        live = tok < L
        a, dt, _lam, _gamma, scale = _chunk_scalars(ADT, DT, TRAP, b, h, t0, L, sa_b, sa_l, sa_h,
                                                  sd_b, sd_l, sd_h, st_b, st_l, st_h, T)
        seg = _segments(RESET, b, t0, L, T, HAS_RESET)
        ell, _th = _local_angle(ANG, dt, b, h, t0, L, R, sg_b, sg_l, sg_h, sg_r, T, N2B)
        cos, sin = _cos_sin(ell, FAST)
        k_e, k_o = _load_rotated(K, b * sk_b + tok * sk_l + g * sk_g, live, N, sk_n,
                                 kb_e, kb_o, cos, sin, N2B, PAIRED)
        x = tl.load(V + b * sv_b + tok[:, None] * sv_l + h * sv_h + p[None, :] * sv_p,
                    mask=live[:, None] & (p < P)[None, :], other=0.0).to(tl.float32)
        s_e, s_o, phi = _advance_state(s_e, s_o, x, a, seg, scale, k_e, k_o, ell, t, T, DOT,
                                       FAST)
        if pid_p == 0:
            tl.store(PHI + ((b * H + h) * NC + c) * N2B + j, phi)
    ptr = _state_ptrs(SFIN, (b * H + h) * P, p, N2B)
    tl.store(ptr, s_e, mask=mp)
    tl.store(ptr + N2B, s_o, mask=mp)


@triton.jit
def _fwd_out(Q, K, V, Z, Y, ADT, DT, TRAP, ANG, QBIAS, KBIAS, DSKIP, RESET, SIN,
             sq_b, sq_l, sq_g, sq_n, sk_b, sk_l, sk_g, sk_n,
             sv_b, sv_l, sv_h, sv_p, sz_b, sz_l, sz_h, sz_p,
             sa_b, sa_l, sa_h, sd_b, sd_l, sd_h, st_b, st_l, st_h,
             sg_b, sg_l, sg_h, sg_r, sqb_h, sqb_n, skb_h, skb_n,
             L, H, G, NC, P, N, R,
             T: tl.constexpr, BP: tl.constexpr, N2B: tl.constexpr, HAS_D: tl.constexpr,
             HAS_Z: tl.constexpr, HAS_RESET: tl.constexpr, DOT: tl.constexpr, FAST: tl.constexpr,
               PAIRED: tl.constexpr):
    h, c, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g = h // (H // G)
    t0 = c * T
    tok = t0 + tl.arange(0, T)
    live = tok < L
    p = tl.arange(0, BP)
    mask = live[:, None] & (p < P)[None, :]
    a, dt, _lam, gamma, scale = _chunk_scalars(ADT, DT, TRAP, b, h, t0, L, sa_b, sa_l, sa_h,
                                              sd_b, sd_l, sd_h, st_b, st_l, st_h, T)
    seg = _segments(RESET, b, t0, L, T, HAS_RESET)
    ell, _th = _local_angle(ANG, dt, b, h, t0, L, R, sg_b, sg_l, sg_h, sg_r, T, N2B)
    cos, sin = _cos_sin(ell, FAST)
    qb_e, qb_o = _bias_pairs(QBIAS, h, N, sqb_h, sqb_n, N2B)
    kb_e, kb_o = _bias_pairs(KBIAS, h, N, skb_h, skb_n, N2B)
    q_e, q_o = _load_rotated(Q, b * sq_b + tok * sq_l + g * sq_g, live, N, sq_n,
                             qb_e, qb_o, cos, sin, N2B, PAIRED)
    k_e, k_o = _load_rotated(K, b * sk_b + tok * sk_l + g * sk_g, live, N, sk_n,
                             kb_e, kb_o, cos, sin, N2B, PAIRED)

    t = tl.arange(0, T)
    w = _decay_matrix(a, seg, T) * scale[None, :] + tl.where(
        t[:, None] == t[None, :], gamma[:, None], 0.0)
    scores = (_mm(q_e, tl.trans(k_e), DOT) + _mm(q_o, tl.trans(k_o), DOT)) * w  # [T, T]
    x = tl.load(V + b * sv_b + tok[:, None] * sv_l + h * sv_h + p[None, :] * sv_p,
                mask=mask, other=0.0).to(tl.float32)
    ptr = _state_ptrs(SIN, ((b * H + h) * NC + c) * P, p, N2B)
    s_e = tl.load(ptr, mask=(p < P)[:, None], other=0.0)
    s_o = tl.load(ptr + N2B, mask=(p < P)[:, None], other=0.0)
    carry = tl.where(seg == 0, tl.exp(a), 0.0)
    inter = _mm(q_e, tl.trans(s_e), DOT) + _mm(q_o, tl.trans(s_o), DOT)  # [T, BP]
    y = _mm(scores, x, DOT) + carry[:, None] * inter
    if HAS_D:
        y += tl.load(DSKIP + h).to(tl.float32) * x
    if HAS_Z:
        z = tl.load(Z + b * sz_b + tok[:, None] * sz_l + h * sz_h + p[None, :] * sz_p,
                    mask=mask, other=0.0).to(tl.float32)
        y = y * z * tl.sigmoid(z)
    out = Y + ((b * L + tok[:, None]).to(tl.int64) * H + h) * P + p[None, :]
    tl.store(out, y.to(Y.dtype.element_ty), mask=mask)


# -- backward --------------------------------------------------------------------------------
@triton.jit
def _bwd_dstate(Q, K, V, Z, DY, ADT, DT, TRAP, ANG, QBIAS, KBIAS, RESET, GST, BND,
                sq_b, sq_l, sq_g, sq_n, sk_b, sk_l, sk_g, sk_n,
                sv_b, sv_l, sv_h, sv_p, sz_b, sz_l, sz_h, sz_p, sy_b, sy_l, sy_h, sy_p,
                sa_b, sa_l, sa_h, sd_b, sd_l, sd_h, st_b, st_l, st_h,
                sg_b, sg_l, sg_h, sg_r, sqb_h, sqb_n, skb_h, skb_n,
                L, H, G, NC, NPT, P, N, R,
                T: tl.constexpr, BP: tl.constexpr, N2B: tl.constexpr,
                HAS_Z: tl.constexpr, HAS_RESET: tl.constexpr, DOT: tl.constexpr, FAST: tl.constexpr,
               PAIRED: tl.constexpr):
    """dS[c] = dL/dS_in[c] walking backwards; stores G_c = dL/dU_c = rot(dS[c+1], +phi_c)
    and, per P tile, the first token's boundary term x_prev^T dS[c] kb_prev."""
    pid_p, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g = h // (H // G)
    t = tl.arange(0, T)
    j = tl.arange(0, N2B)
    p = pid_p * BP + tl.arange(0, BP)
    mp = p < P
    qb_e, qb_o = _bias_pairs(QBIAS, h, N, sqb_h, sqb_n, N2B)
    kb_e, kb_o = _bias_pairs(KBIAS, h, N, skb_h, skb_n, N2B)
    ds_e = tl.zeros([BP, N2B], dtype=tl.float32)  # dL/dS_in[c + 1]
    ds_o = tl.zeros([BP, N2B], dtype=tl.float32)
    for i in range(NC):
        c = NC - 1 - i
        t0 = c * T
        tok = t0 + t
        live = tok < L
        mask = live[:, None] & mp[None, :]
        a, dt, _lam, _gamma, _scale = _chunk_scalars(ADT, DT, TRAP, b, h, t0, L, sa_b, sa_l, sa_h,
                                                  sd_b, sd_l, sd_h, st_b, st_l, st_h, T)
        seg = _segments(RESET, b, t0, L, T, HAS_RESET)
        ell, _th = _local_angle(ANG, dt, b, h, t0, L, R, sg_b, sg_l, sg_h, sg_r, T, N2B)
        phi = tl.sum(tl.where((t == T - 1)[:, None], ell, 0.0), axis=0)
        cp, sp = _cos_sin(phi, FAST)
        cp, sp = cp[None, :], sp[None, :]
        g_e = ds_e * cp - ds_o * sp  # the transpose of the forward's rotation by -phi
        g_o = ds_e * sp + ds_o * cp
        ptr = _state_ptrs(GST, ((b * H + h) * NC + c) * P, p, N2B)
        tl.store(ptr, g_e.to(GST.dtype.element_ty), mask=mp[:, None])
        tl.store(ptr + N2B, g_o.to(GST.dtype.element_ty), mask=mp[:, None])

        cos, sin = _cos_sin(ell, FAST)
        q_e, q_o = _load_rotated(Q, b * sq_b + tok * sq_l + g * sq_g, live, N, sq_n,
                                 qb_e, qb_o, cos, sin, N2B, PAIRED)
        dy = tl.load(DY + b * sy_b + tok[:, None] * sy_l + h * sy_h + p[None, :] * sy_p,
                     mask=mask, other=0.0).to(tl.float32)
        if HAS_Z:
            z = tl.load(Z + b * sz_b + tok[:, None] * sz_l + h * sz_h + p[None, :] * sz_p,
                        mask=mask, other=0.0).to(tl.float32)
            dy = dy * z * tl.sigmoid(z)
        carry = tl.where(seg == 0, tl.exp(a), 0.0)
        do_t = tl.trans(dy * carry[:, None])  # [BP, T]
        decay = tl.where(tl.max(seg, axis=0) == 0, tl.exp(_last(a, T)), 0.0)
        ds_e = decay * g_e + _mm(do_t, q_e, DOT)
        ds_o = decay * g_o + _mm(do_t, q_o, DOT)
        # boundary: the previous chunk's last token enters S_in[c] with scale_prev, whose
        # (1 - lambda) dt part belongs to this chunk's first token (0 for the first chunk)
        prev = t0 - 1
        has_prev = prev >= 0
        x_prev = tl.load(V + b * sv_b + prev * sv_l + h * sv_h + p * sv_p,
                         mask=mp & has_prev, other=0.0).to(tl.float32)
        kp_e = tl.load(K + b * sk_b + prev * sk_l + g * sk_g + 2 * j * sk_n,
                       mask=(2 * j < N) & has_prev, other=0.0).to(tl.float32) + kb_e
        kp_o = tl.load(K + b * sk_b + prev * sk_l + g * sk_g + (2 * j + 1) * sk_n,
                       mask=(2 * j + 1 < N) & has_prev, other=0.0).to(tl.float32) + kb_o
        part = tl.sum(x_prev[:, None] * (ds_e * kp_e[None, :] + ds_o * kp_o[None, :]))
        tl.store(BND + ((b * H + h) * NC + c) * NPT + pid_p, part)


@triton.jit
def _bwd_intra(Q, K, V, Z, DY, ADT, DT, TRAP, ANG, QBIAS, KBIAS, DSKIP, RESET, SIN, GST,
               DV, DZ, DO, DQK, SCAL, DDEC, DPHI, DDP,
               sq_b, sq_l, sq_g, sq_n, sk_b, sk_l, sk_g, sk_n,
               sv_b, sv_l, sv_h, sv_p, sz_b, sz_l, sz_h, sz_p, sy_b, sy_l, sy_h, sy_p,
               sa_b, sa_l, sa_h, sd_b, sd_l, sd_h, st_b, st_l, st_h,
               sg_b, sg_l, sg_h, sg_r, sqb_h, sqb_n, skb_h, skb_n,
               B, L, H, G, NC, P, N, R,
               T: tl.constexpr, BP: tl.constexpr, N2B: tl.constexpr, HAS_D: tl.constexpr,
               HAS_Z: tl.constexpr, HAS_RESET: tl.constexpr, DOT: tl.constexpr,
               FAST: tl.constexpr, PAIRED: tl.constexpr):
    """One chunk of one head: dx, dz, dD, do (kept for _bwd_qk), d(q.k) [T, T] (kept), the
    intra-chunk parts of the scalar grads, and the chunk's <G, S_in> terms."""
    h, c, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g = h // (H // G)
    t0 = c * T
    t = tl.arange(0, T)
    tok = t0 + t
    live = tok < L
    j = tl.arange(0, N2B)
    p = tl.arange(0, BP)
    mask = live[:, None] & (p < P)[None, :]
    bhc = (b * H + h) * NC + c
    a, dt, _lam, gamma, scale = _chunk_scalars(ADT, DT, TRAP, b, h, t0, L, sa_b, sa_l, sa_h,
                                               sd_b, sd_l, sd_h, st_b, st_l, st_h, T)
    seg = _segments(RESET, b, t0, L, T, HAS_RESET)
    ell, _th = _local_angle(ANG, dt, b, h, t0, L, R, sg_b, sg_l, sg_h, sg_r, T, N2B)
    cos, sin = _cos_sin(ell, FAST)
    qb_e, qb_o = _bias_pairs(QBIAS, h, N, sqb_h, sqb_n, N2B)
    q_e, q_o = _load_rotated(Q, b * sq_b + tok * sq_l + g * sq_g, live, N, sq_n,
                             qb_e, qb_o, cos, sin, N2B, PAIRED)
    q_e, q_o = q_e.to(DOT), q_o.to(DOT)
    kb_e, kb_o = _bias_pairs(KBIAS, h, N, skb_h, skb_n, N2B)
    k_e, k_o = _load_rotated(K, b * sk_b + tok * sk_l + g * sk_g, live, N, sk_n,
                             kb_e, kb_o, cos, sin, N2B, PAIRED)
    k_e, k_o = k_e.to(DOT), k_o.to(DOT)

    seg_last = tl.max(seg, axis=0)
    a_last = _last(a, T)
    carry = tl.where(seg == 0, tl.exp(a), 0.0)
    w_state = tl.where(seg == seg_last, tl.exp(a_last - a), 0.0) * scale
    decay_tt = _decay_matrix(a, seg, T)
    w = decay_tt * scale[None, :] + tl.where(t[:, None] == t[None, :], gamma[:, None], 0.0)
    qk = _mm(q_e, tl.trans(k_e), DOT) + _mm(q_o, tl.trans(k_o), DOT)  # [T, T]
    scores = (qk * w).to(DOT)

    x = tl.load(V + b * sv_b + tok[:, None] * sv_l + h * sv_h + p[None, :] * sv_p,
                mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + b * sy_b + tok[:, None] * sy_l + h * sy_h + p[None, :] * sy_p,
                 mask=mask, other=0.0).to(tl.float32)
    ptr = _state_ptrs(SIN, bhc * P, p, N2B)
    s_e = tl.load(ptr, mask=(p < P)[:, None], other=0.0)
    s_o = tl.load(ptr + N2B, mask=(p < P)[:, None], other=0.0)
    q_s = _mm(q_e, tl.trans(s_e), DOT) + _mm(q_o, tl.trans(s_o), DOT)  # [T, BP]
    d_skip = 0.0
    if HAS_D:
        d_skip = tl.load(DSKIP + h).to(tl.float32)
    if HAS_Z:
        z = tl.load(Z + b * sz_b + tok[:, None] * sz_l + h * sz_h + p[None, :] * sz_p,
                    mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(z)
        y_pre = _mm(scores, x, DOT) + carry[:, None] * q_s + d_skip * x
        row = ((b * L + tok[:, None]).to(tl.int64) * H + h) * P + p[None, :]
        tl.store(DZ + row, (dy * y_pre * sig * (1.0 + z * (1.0 - sig))).to(DZ.dtype.element_ty),
                 mask=mask)
        do = dy * z * sig
    else:
        do = dy
    if HAS_D:
        tl.store(DDP + bhc, tl.sum(do * x))
    row = ((b * L + tok[:, None]).to(tl.int64) * H + h) * P + p[None, :]
    tl.store(DO + row, do.to(DO.dtype.element_ty), mask=mask)

    # intra-chunk scalar parts: W = decay * scale (s < t) + gamma (s = t)
    d_scores = _mm(do, tl.trans(x), DOT)  # [T, T]
    tt = bhc.to(tl.int64) * T * T + t[:, None] * T + t[None, :]
    tl.store(DQK + tt, (d_scores * w).to(DQK.dtype.element_ty))
    d_w = d_scores * qk
    z_dec = d_w * decay_tt
    z_w = z_dec * scale[None, :]
    sc = (b * L + tok) * H + h
    n_sc = B * L * H
    tl.store(SCAL + sc, tl.sum(tl.where(t[:, None] == t[None, :], d_w, 0.0), axis=1), mask=live)
    tl.store(SCAL + n_sc + sc, tl.sum(z_dec, axis=0), mask=live)
    d_a = tl.sum(z_w, axis=1) - tl.sum(z_w, axis=0) + carry * tl.sum(do * q_s, axis=1)
    tl.store(SCAL + 2 * n_sc + sc, d_a, mask=live)

    # dx: intra, skip, and x's use in the chunk state (G = dL/dU of this chunk)
    ptr = _state_ptrs(GST, bhc * P, p, N2B)
    g_e = tl.load(ptr, mask=(p < P)[:, None], other=0.0)
    g_o = tl.load(ptr + N2B, mask=(p < P)[:, None], other=0.0)
    k_g = _mm(k_e, tl.trans(g_e), DOT) + _mm(k_o, tl.trans(g_o), DOT)  # [T, BP]
    dx = _mm(tl.trans(scores), do, DOT) + d_skip * do + w_state[:, None] * k_g
    tl.store(DV + row, dx.to(DV.dtype.element_ty), mask=mask)
    # <G, S_in> (the chunk decay's grad) and its pairwise cross terms (phi's grad)
    g_e, g_o = g_e.to(tl.float32), g_o.to(tl.float32)
    s_e, s_o = s_e.to(tl.float32), s_o.to(tl.float32)
    tl.store(DDEC + bhc, tl.sum(g_e * s_e + g_o * s_o))
    tl.store(DPHI + bhc * N2B + j, tl.sum(g_e * s_o - g_o * s_e, axis=0))


@triton.jit
def _bwd_qk(Q, K, V, ADT, DT, TRAP, ANG, QBIAS, KBIAS, RESET, SIN, GST, BND, DO, DQK, SCAL,
            DDEC, DPHI, DQP, DKP, DQBP, DKBP, DADT, DDT, DTRAP, DANG,
            sq_b, sq_l, sq_g, sq_n, sk_b, sk_l, sk_g, sk_n, sv_b, sv_l, sv_h, sv_p,
            sa_b, sa_l, sa_h, sd_b, sd_l, sd_h, st_b, st_l, st_h,
            sg_b, sg_l, sg_h, sg_r, sqb_h, sqb_n, skb_h, skb_n,
            B, L, H, G, NC, NPT, P, N, R, HB,
            T: tl.constexpr, BP: tl.constexpr, N2B: tl.constexpr, NPTB: tl.constexpr,
            HAS_RESET: tl.constexpr, DOT: tl.constexpr, FAST: tl.constexpr,
               PAIRED: tl.constexpr):
    """One chunk of a block of heads sharing q/k: dq, dk summed over the block in registers,
    the per-head bias grads, and the final adt / dt / trap / angles grads."""
    pid_hg, c, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    heads_per_group = H // G
    nhb = heads_per_group // HB
    g = pid_hg // nhb
    hb = pid_hg % nhb
    t0 = c * T
    t = tl.arange(0, T)
    tok = t0 + t
    live = tok < L
    j = tl.arange(0, N2B)
    p = tl.arange(0, BP)
    mask = live[:, None] & (p < P)[None, :]
    is_last = t == T - 1
    seg = _segments(RESET, b, t0, L, T, HAS_RESET)
    seg_last = tl.max(seg, axis=0)
    n_sc = B * L * H
    dq_acc_e = tl.zeros([T, N2B], dtype=tl.float32)
    dq_acc_o = tl.zeros([T, N2B], dtype=tl.float32)
    dk_acc_e = tl.zeros([T, N2B], dtype=tl.float32)
    dk_acc_o = tl.zeros([T, N2B], dtype=tl.float32)
    for i in range(HB):
        h = g * heads_per_group + hb * HB + i
        bhc = (b * H + h) * NC + c
        a, dt, lam, _gamma, scale = _chunk_scalars(ADT, DT, TRAP, b, h, t0, L, sa_b, sa_l,
                                                   sa_h, sd_b, sd_l, sd_h, st_b, st_l, st_h, T)
        ell, _th = _local_angle(ANG, dt, b, h, t0, L, R, sg_b, sg_l, sg_h, sg_r, T, N2B)
        cos, sin = _cos_sin(ell, FAST)
        qb_e, qb_o = _bias_pairs(QBIAS, h, N, sqb_h, sqb_n, N2B)
        q_e, q_o = _load_rotated(Q, b * sq_b + tok * sq_l + g * sq_g, live, N, sq_n,
                                 qb_e, qb_o, cos, sin, N2B, PAIRED)
        q_e, q_o = q_e.to(DOT), q_o.to(DOT)
        kb_e, kb_o = _bias_pairs(KBIAS, h, N, skb_h, skb_n, N2B)
        k_e, k_o = _load_rotated(K, b * sk_b + tok * sk_l + g * sk_g, live, N, sk_n,
                                 kb_e, kb_o, cos, sin, N2B, PAIRED)
        k_e, k_o = k_e.to(DOT), k_o.to(DOT)
        a_last = _last(a, T)
        carry = tl.where(seg == 0, tl.exp(a), 0.0)
        to_end = tl.where(seg == seg_last, tl.exp(a_last - a), 0.0)
        w_state = to_end * scale
        decay = tl.where(seg_last == 0, tl.exp(a_last), 0.0)
        tt = bhc.to(tl.int64) * T * T + t[:, None] * T + t[None, :]
        d_qk = tl.load(DQK + tt)  # [T, T]
        row = ((b * L + tok[:, None]).to(tl.int64) * H + h) * P + p[None, :]

        # dq (rotated frame): intra + the carried state's read-out
        do = tl.load(DO + row, mask=mask, other=0.0)
        ptr = _state_ptrs(SIN, bhc * P, p, N2B)
        s_e = tl.load(ptr, mask=(p < P)[:, None], other=0.0)
        s_o = tl.load(ptr + N2B, mask=(p < P)[:, None], other=0.0)
        dq_e = _mm(d_qk, k_e, DOT) + carry[:, None] * _mm(do, s_e, DOT)
        dq_o = _mm(d_qk, k_o, DOT) + carry[:, None] * _mm(do, s_o, DOT)
        qf_e, qf_o = q_e.to(tl.float32), q_o.to(tl.float32)
        d_ell = qf_e * dq_o - qf_o * dq_e
        dqb_e = tl.where(live[:, None], dq_e * cos + dq_o * sin, 0.0)
        dqb_o = tl.where(live[:, None], dq_o * cos - dq_e * sin, 0.0)
        bias_ptr = ((b * NC + c) * H + h) * N + 2 * j
        tl.store(DQBP + bias_ptr, tl.sum(dqb_e, axis=0), mask=2 * j < N)
        tl.store(DQBP + bias_ptr + 1, tl.sum(dqb_o, axis=0), mask=2 * j + 1 < N)
        dq_acc_e += dqb_e
        dq_acc_o += dqb_o

        # dk (rotated frame): intra + k's use in the chunk state (m = x^T G per token)
        x = tl.load(V + b * sv_b + tok[:, None] * sv_l + h * sv_h + p[None, :] * sv_p,
                    mask=mask, other=0.0)
        ptr = _state_ptrs(GST, bhc * P, p, N2B)
        m_e = _mm(x, tl.load(ptr, mask=(p < P)[:, None], other=0.0), DOT)  # [T, N2B]
        m_o = _mm(x, tl.load(ptr + N2B, mask=(p < P)[:, None], other=0.0), DOT)
        kf_e, kf_o = k_e.to(tl.float32), k_o.to(tl.float32)
        mk = tl.sum(m_e * kf_e + m_o * kf_o, axis=1)  # x_s^T G k_s
        d_phi = tl.sum(w_state[:, None] * (m_e * kf_o - m_o * kf_e), axis=0)
        d_phi += decay * tl.load(DPHI + bhc * N2B + j)
        d_qk_t = tl.trans(d_qk)
        dk_e = _mm(d_qk_t, q_e, DOT) + w_state[:, None] * m_e
        dk_o = _mm(d_qk_t, q_o, DOT) + w_state[:, None] * m_o
        d_ell += kf_e * dk_o - kf_o * dk_e
        dkb_e = tl.where(live[:, None], dk_e * cos + dk_o * sin, 0.0)
        dkb_o = tl.where(live[:, None], dk_o * cos - dk_e * sin, 0.0)
        tl.store(DKBP + bias_ptr, tl.sum(dkb_e, axis=0), mask=2 * j < N)
        tl.store(DKBP + bias_ptr + 1, tl.sum(dkb_o, axis=0), mask=2 * j + 1 < N)
        dk_acc_e += dkb_e
        dk_acc_o += dkb_o

        # scalars: a (-> adt), gamma and scale (-> dt, trap); intra parts from _bwd_intra
        sc = (b * L + tok) * H + h
        wmk = w_state * mk
        d_scale = tl.load(SCAL + n_sc + sc, mask=live, other=0.0) + to_end * mk
        d_gamma = tl.load(SCAL + sc, mask=live, other=0.0) + d_scale
        d_a = tl.load(SCAL + 2 * n_sc + sc, mask=live, other=0.0) - wmk
        d_a += tl.where(is_last, tl.sum(wmk, axis=0) + tl.load(DDEC + bhc) * decay, 0.0)
        tl.store(DADT + sc, tl.cumsum(d_a, axis=0, reverse=True), mask=live)
        # d(1 - lambda_t) dt_t = d scale_{t-1}; the first token's comes from the state pass
        bnd_i = tl.arange(0, NPTB)
        bnd = tl.sum(tl.load(BND + bhc * NPT + bnd_i, mask=bnd_i < NPT, other=0.0), axis=0)
        d_prev = tl.sum(tl.where(t[None, :] == t[:, None] - 1, d_scale[None, :], 0.0), axis=1)
        d_prev = tl.where(t == 0, bnd, d_prev)
        # angles: d ell from the rotations, d phi (the state's rotation) at the chunk's end
        d_ell += tl.where(is_last[:, None], d_phi[None, :], 0.0)
        d_rate_dt = tl.cumsum(d_ell, axis=0, reverse=True)  # d(pi tanh(angle) dt)
        th = _angle_tanh(ANG, b, h, t0, L, R, sg_b, sg_l, sg_h, sg_r, T, N2B)  # (reloaded)
        d_dt = d_gamma * lam + d_prev * (1.0 - lam)
        d_dt += tl.sum(d_rate_dt * 3.141592653589793 * th, axis=1)
        tl.store(DDT + sc, d_dt, mask=live)
        tl.store(DTRAP + sc, (d_gamma - d_prev) * dt * lam * (1.0 - lam), mask=live)
        d_ang = d_rate_dt * dt[:, None] * 3.141592653589793 * (1.0 - th * th)
        tl.store(DANG + sc[:, None].to(tl.int64) * R + j[None, :],
                 d_ang.to(DANG.dtype.element_ty), mask=live[:, None] & (j < R)[None, :])
    rows = ((hb * B + b) * L + tok).to(tl.int64) * G + g
    ptr = rows[:, None] * N + 2 * j[None, :]
    me = live[:, None] & (2 * j < N)[None, :]
    mo = live[:, None] & (2 * j + 1 < N)[None, :]
    tl.store(DQP + ptr, dq_acc_e, mask=me)
    tl.store(DQP + ptr + 1, dq_acc_o, mask=mo)
    tl.store(DKP + ptr, dk_acc_e, mask=me)
    tl.store(DKP + ptr + 1, dk_acc_o, mask=mo)


# -- host side -------------------------------------------------------------------------------
class _Geometry(NamedTuple):
    B: int
    L: int
    H: int
    G: int
    P: int
    N: int
    R: int
    T: int  # chunk length
    NC: int  # chunks
    BP: int  # P padded to a power of two (>= 16)
    N2B: int  # N / 2 pairs padded to a power of two (>= 16)
    BPS: int  # P tile of the two sequential kernels
    NPT: int  # P tiles of the sequential kernels
    HB: int  # heads per program of _bwd_qk


def _geometry(q: Tensor, v: Tensor, angles: Tensor, chunk_size: int) -> _Geometry:
    B, L, H, P = v.shape
    G, N, R = q.shape[2], q.shape[3], angles.shape[-1]
    if chunk_size not in CHUNK_SIZES:
        raise MegaCppError(f"mamba3_scan triton: chunk_size must be one of {CHUNK_SIZES}, "
                           f"got {chunk_size} (use the reference for other chunk sizes)")
    if P > MAX_HEADDIM or N > MAX_D_STATE:
        raise MegaCppError(f"mamba3_scan triton: needs headdim <= {MAX_HEADDIM} and d_state <= "
                           f"{MAX_D_STATE}, got {P} and {N} (use the reference)")
    if max(v.numel(), angles.numel(), q.numel()) >= 2**31:
        raise MegaCppError("mamba3_scan triton: tensors of 2**31 elements or more are not "
                           "supported (32-bit offsets); split the batch")
    BP = max(16, triton.next_power_of_2(P))
    N2B = max(16, triton.next_power_of_2((N + 1) // 2))
    BPS = min(BP, TUNING["state_bp"])
    per_group = H // G
    HB = max(d for d in range(1, min(per_group, TUNING["main_heads"]) + 1) if per_group % d == 0)
    T = min(chunk_size, TUNING["max_chunk"])  # any chunking computes the same function
    if v.dtype == torch.float32:
        T = min(T, 32)  # float32 operands of 64-token chunks overflow shared memory
    return _Geometry(B, L, H, G, P, N, R, T, triton.cdiv(L, T), BP, N2B, BPS,
                     triton.cdiv(P, BPS), HB)


def _paired(geo: _Geometry, q: Tensor, k: Tensor) -> bool:
    """Whether q/k rows load as one contiguous [T, N] block (N fills the pair tile)."""
    return geo.N == 2 * geo.N2B and q.stride(-1) == 1 and k.stride(-1) == 1


def _launch(kernel: str) -> dict[str, int]:
    return {k: v for k, v in TUNING["launch"][kernel].items() if v is not None}


def _precision(v: Tensor) -> tuple[torch.dtype, tl.dtype, bool]:
    """(state storage dtype, matmul operand dtype, fast trig): float32 with accurate trig for
    float32 v; else bf16 with the hardware sin/cos (not in the CPU interpreter)."""
    if v.dtype == torch.float32:
        return torch.float32, tl.float32, False
    return torch.bfloat16, tl.bfloat16, v.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"


def _strides(t: Tensor | None, ndim: int) -> tuple[int, ...]:
    return tuple(t.stride()) if t is not None else (0,) * ndim


def _common_strides(q, k, v, z, adt, dt, trap, angles, q_bias, k_bias) -> dict[str, tuple]:
    return {"q": _strides(q, 4), "k": _strides(k, 4), "v": _strides(v, 4), "z": _strides(z, 4),
                "adt": _strides(adt, 3), "dt": _strides(dt, 3), "trap": _strides(trap, 3),
                "ang": _strides(angles, 4), "qb": _strides(q_bias, 2), "kb": _strides(k_bias, 2)}


def _final_state(geo: _Geometry, k: Tensor, v: Tensor, k_bias: Tensor, s_fin: Tensor,
                 phi: Tensor) -> Mamba3ScanState:
    """The reference's final state in its global frame (angle mod 2 pi), without gradient."""
    L, H, G, N, R = geo.L, geo.H, geo.G, geo.N, geo.R
    total = torch.remainder(phi.double().sum(2), 2 * math.pi).float()  # [B, H, N2B]
    cos, sin = torch.cos(total)[:, :, None], torch.sin(total)[:, :, None]
    s_e, s_o = s_fin[..., 0, :], s_fin[..., 1, :]  # [B, H, P, N2B]
    ssm = torch.stack([s_e * cos - s_o * sin, s_e * sin + s_o * cos], dim=-1)
    ssm = ssm.flatten(-2)[..., :N].contiguous()
    k_last = k[:, L - 1].float().repeat_interleave(H // G, dim=1) + k_bias.float()  # [B, H, N]
    angle = total[..., :R].contiguous()
    return Mamba3ScanState(angle, ssm, _rotate(k_last, angle), v[:, L - 1].float())


def _forward_chunked(geo: _Geometry, args: tuple, st: dict, y: Tensor, s_in: Tensor,
                     s_fin: Tensor, phi: Tensor, dot, fast: bool) -> None:
    """_fwd_state then _fwd_out (the chunk-parallel forward)."""
    q, k, v, adt, dt, trap, angles, q_bias, k_bias, D, z, rst = args
    B, L, H, G, P, N, R, T, NC = geo[:9]
    _fwd_state[(geo.NPT, H, B)](
        k, v, adt, dt, trap, angles, k_bias, rst, s_in, s_fin, phi,
        *st["k"], *st["v"], *st["adt"], *st["dt"], *st["trap"], *st["ang"], *st["kb"],
        L, H, G, NC, P, N, R, T=T, BP=geo.BPS, N2B=geo.N2B,
        HAS_RESET=rst is not None, DOT=dot, FAST=fast, PAIRED=_paired(geo, q, k), **_launch("fwd_state"))
    _fwd_out[(H, NC, B)](
        q, k, v, z, y, adt, dt, trap, angles, q_bias, k_bias, D, rst, s_in,
        *st["q"], *st["k"], *st["v"], *st["z"], *st["adt"], *st["dt"], *st["trap"],
        *st["ang"], *st["qb"], *st["kb"],
        L, H, G, NC, P, N, R, T=T, BP=geo.BP, N2B=geo.N2B, HAS_D=D is not None,
        HAS_Z=z is not None, HAS_RESET=rst is not None, DOT=dot, FAST=fast, PAIRED=_paired(geo, q, k),
        **_launch("fwd_out"))


def _forward_seq(geo: _Geometry, args: tuple, st: dict, y: Tensor, s_in: Tensor,
                 s_fin: Tensor, phi: Tensor, dot, fast: bool) -> None:
    """One fused sequential kernel per (head, row): triton_seq._fwd_seq."""
    from megacpp.kernels.ops.mamba3_scan.triton_seq import _fwd_seq

    q, k, v, adt, dt, trap, angles, q_bias, k_bias, D, z, rst = args
    B, L, H, G, P, N, R, T, NC = geo[:9]
    _fwd_seq[(H, B)](
        q, k, v, z, y, adt, dt, trap, angles, q_bias, k_bias, D, rst, s_in, s_fin, phi,
        *st["q"], *st["k"], *st["v"], *st["z"], *st["adt"], *st["dt"], *st["trap"],
        *st["ang"], *st["qb"], *st["kb"],
        L, H, G, NC, P, N, R, T=T, BP=geo.BP, N2B=geo.N2B, HAS_D=D is not None,
        HAS_Z=z is not None, HAS_RESET=rst is not None, DOT=dot, FAST=fast,
        PAIRED=_paired(geo, q, k), **_launch("fwd_seq"))


def _backward_chunked(geo: _Geometry, args: tuple, st: dict, dy: Tensor, s_in: Tensor, dot,
                      fast: bool) -> tuple:
    """_bwd_dstate, _bwd_intra, _bwd_qk (the chunk-parallel backward); the input grads."""
    q, k, v, adt, dt, trap, angles, q_bias, k_bias, D, z, rst = args
    B, L, H, G, P, N, R, T, NC = geo[:9]
    dev = v.device
    g_st = torch.empty_like(s_in)
    bnd = torch.zeros(B, H, NC, geo.NPT, device=dev, dtype=torch.float32)
    _bwd_dstate[(geo.NPT, H, B)](
        q, k, v, z, dy, adt, dt, trap, angles, q_bias, k_bias, rst, g_st, bnd,
        *st["q"], *st["k"], *st["v"], *st["z"], *dy.stride(), *st["adt"], *st["dt"],
        *st["trap"], *st["ang"], *st["qb"], *st["kb"],
        L, H, G, NC, geo.NPT, P, N, R, T=T, BP=geo.BPS, N2B=geo.N2B,
        HAS_Z=z is not None, HAS_RESET=rst is not None, DOT=dot, FAST=fast, PAIRED=_paired(geo, q, k),
        **_launch("bwd_dstate"))

    state_dtype = s_in.dtype
    f32 = {"device": dev, "dtype": torch.float32}
    dv = torch.empty(B, L, H, P, device=dev, dtype=v.dtype)
    dz = torch.empty(B, L, H, P, device=dev, dtype=z.dtype) if z is not None else None
    do = torch.empty(B, L, H, P, device=dev, dtype=state_dtype)
    d_qk = torch.empty(B, H, NC, T, T, device=dev, dtype=state_dtype)
    scal = torch.empty(3, B, L, H, **f32)  # intra parts: d gamma, d scale, d a
    d_dec = torch.empty(B, H, NC, **f32)
    d_phi = torch.empty(B, H, NC, geo.N2B, **f32)
    dd_part = torch.empty(B, H, NC, **f32)
    _bwd_intra[(H, NC, B)](
        q, k, v, z, dy, adt, dt, trap, angles, q_bias, k_bias, D, rst, s_in, g_st,
        dv, dz, do, d_qk, scal, d_dec, d_phi, dd_part,
        *st["q"], *st["k"], *st["v"], *st["z"], *dy.stride(), *st["adt"], *st["dt"],
        *st["trap"], *st["ang"], *st["qb"], *st["kb"],
        B, L, H, G, NC, P, N, R, T=T, BP=geo.BP, N2B=geo.N2B, HAS_D=D is not None,
        HAS_Z=z is not None, HAS_RESET=rst is not None, DOT=dot, FAST=fast, PAIRED=_paired(geo, q, k),
        **_launch("bwd_intra"))

    nhb = H // G // geo.HB
    dq_part = torch.empty(nhb, B, L, G, N, **f32)
    dk_part = torch.empty(nhb, B, L, G, N, **f32)
    dqb_part = torch.empty(B, NC, H, N, **f32)
    dkb_part = torch.empty(B, NC, H, N, **f32)
    dadt = torch.empty(B, L, H, **f32)
    ddt = torch.empty(B, L, H, **f32)
    dtrap = torch.empty(B, L, H, **f32)
    dang = torch.empty(B, L, H, R, device=dev, dtype=angles.dtype)
    _bwd_qk[(G * nhb, NC, B)](
        q, k, v, adt, dt, trap, angles, q_bias, k_bias, rst, s_in, g_st, bnd, do, d_qk,
        scal, d_dec, d_phi, dq_part, dk_part, dqb_part, dkb_part, dadt, ddt, dtrap, dang,
        *st["q"], *st["k"], *st["v"],
        *st["adt"], *st["dt"], *st["trap"], *st["ang"], *st["qb"], *st["kb"],
        B, L, H, G, NC, geo.NPT, P, N, R, geo.HB,
        T=T, BP=geo.BP, N2B=geo.N2B, NPTB=max(2, triton.next_power_of_2(geo.NPT)),
        HAS_RESET=rst is not None, DOT=dot, FAST=fast, PAIRED=_paired(geo, q, k), **_launch("bwd_qk"))
    dq = dq_part.sum(0).to(q.dtype)
    dk = dk_part.sum(0).to(k.dtype)
    dD = dd_part.sum((0, 2)).to(D.dtype) if D is not None else None
    return (dq, dk, dv, dadt.to(adt.dtype), ddt.to(dt.dtype), dtrap.to(trap.dtype),
            dqb_part.sum((0, 1)).to(q_bias.dtype), dkb_part.sum((0, 1)).to(k_bias.dtype),
            dang, dD, dz, None, None)




class _Mamba3ScanFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, reset, chunk_size):
        geo = _geometry(q, v, angles, chunk_size)
        B, L, H, P, NC = geo.B, geo.L, geo.H, geo.P, geo.NC
        state_dtype, dot, fast = _precision(v)
        dev = v.device
        s_in = torch.empty(B, H, NC, P, 2, geo.N2B, device=dev, dtype=state_dtype)
        s_fin = torch.empty(B, H, P, 2, geo.N2B, device=dev, dtype=torch.float32)
        phi = torch.empty(B, H, NC, geo.N2B, device=dev, dtype=torch.float32)
        rst = reset.to(torch.int8).contiguous() if reset is not None else None
        st = _common_strides(q, k, v, z, adt, dt, trap, angles, q_bias, k_bias)
        y = torch.empty(B, L, H, P, device=dev, dtype=v.dtype)
        args = (q, k, v, adt, dt, trap, angles, q_bias, k_bias, D, z, rst)
        if TUNING["fwd"] == "seq":
            _forward_seq(geo, args, st, y, s_in, s_fin, phi, dot, fast)
        else:
            _forward_chunked(geo, args, st, y, s_in, s_fin, phi, dot, fast)
        final = _final_state(geo, k, v, k_bias, s_fin, phi)
        ctx.save_for_backward(q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, rst, s_in)
        ctx.geo = geo
        ctx.mark_non_differentiable(*final)
        return (y, *final)

    @staticmethod
    def backward(ctx, dy, *_state_grads):
        q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, rst, s_in = ctx.saved_tensors
        geo = ctx.geo
        _, dot, fast = _precision(v)
        st = _common_strides(q, k, v, z, adt, dt, trap, angles, q_bias, k_bias)
        args = (q, k, v, adt, dt, trap, angles, q_bias, k_bias, D, z, rst)
        return _backward_chunked(geo, args, st, dy, s_in, dot, fast)


def mamba3_scan_triton(
    q: Tensor, k: Tensor, v: Tensor, adt: Tensor, dt: Tensor, trap: Tensor,
    q_bias: Tensor, k_bias: Tensor, angles: Tensor,
    D: Tensor | None = None, z: Tensor | None = None, reset: Tensor | None = None,
    initial_state: Mamba3ScanState | None = None, chunk_size: int = 64,
) -> tuple[Tensor, Mamba3ScanState]:
    """The chunked Mamba-3 SISO scan on the GPU (arguments as :func:`mamba3_scan_chunked`).

    Returns y [B, L, H, P] in v.dtype and the final state (float32, no gradient).
    ``initial_state`` is not supported (a cached prefill must call the reference); neither
    is float64 (the reference is the float64 path).
    """
    _check_inputs(q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, reset)
    if initial_state is not None:
        raise MegaCppError("mamba3_scan triton: initial_state is not supported; a prefill that "
                           "continues a cache runs the reference (mamba3_scan_chunked)")
    if v.dtype == torch.float64:
        raise MegaCppError("mamba3_scan triton: float64 is not supported (use the reference)")
    y, *final = _Mamba3ScanFn.apply(q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z,
                                    reset, chunk_size)
    return y, Mamba3ScanState(*final)
