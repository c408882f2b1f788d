"""Mamba-3 SISO chunked scan in Triton, forward and backward, chunk-parallel.

Same contract as :func:`mamba3_scan_chunked` (reference.py; equations in docs/mamba3.md) for
the training path, with these limits (the caller uses the reference outside them):
``initial_state`` must be ``None`` (a cached prefill runs the reference; the mixer picks it),
``chunk_size`` 16, 32 or 64, headdim <= 64, d_state <= 128, no float64, and no gradient
through the returned final state. ``reset`` [B, L] bool packs documents into one row.
Operands may be bf16/fp16/fp32; everything accumulates in float32. Matmul operands are bf16
unless ``v`` is float32 (then float32 with IEEE products, and chunks of at most 32 tokens to
fit shared memory). The kernels run chunks of ``min(chunk_size, TUNING["max_chunk"])``
tokens: any chunking computes the same function (only rounding differs).

Chunk-local rotation frames. Only angle differences between tokens matter, so each chunk
rotates its q/k by the angle accumulated *inside the chunk* (``ell``, starting at 0), and the
state passed between chunks is re-expressed in the next chunk's frame by rotating it by
``-phi_c`` (phi_c = the chunk's total angle). No long cumulative angle is ever formed, and
the angle backward is chunk-local too (``d phi_c`` comes from the state's rotation).

Rotation on the fly. Every kernel that needs a head's q or k forms it from the group's q/k
rows (shared by the group's heads, so mostly L2 hits), the head's bias and its angle logits
(ell = cumsum(pi tanh(angles) dt) over the chunk, hardware sin/cos): no per-head rotated copy
of q/k ([B, H, L, N], 16x the group's rows at the benchmark's shape) is written or read, and
nothing per head but the states and the per-token grads is saved for the backward.

Halves layout. ``rot`` turns pairs ``(n = 2j, n = 2j+1)``. A rotated [*, N] operand is held
as its even components and its odd ones (pairs j >= R get angle 0, padding is 0), so a
rotation is elementwise on the two halves and a dot product over N is the sum of one dot per
half; the state buffers store the halves one after the other, ``[*, 2, N2B]``.

Kernels (grid; C = chunks, J = tiles of pairs):
  forward    _state_fwd  (J, H, B)  walks the chunks: S_in[c] (stored), the final state and
                                    angle
             _out_fwd    (H, C, B)  y = (intra + exp(a) q S_in^T + D x) * silu(z)
  backward   _state_bwd  (J, H, B)  walks the chunks backwards: G_c = dL/dU_c (stored)
             _bwd_dx     (H, C, B)  dx, dz, dD
             _bwd_qk     (C, J', B * G * head blocks)  for a tile of pairs, each head of a
                                    block of one q/k group in turn: d(q, k) in the rotated
                                    frame (float32, in registers), d ell, the angle grads and
                                    dt's angle part, d(q, k) rotated back and summed over the
                                    block's heads, the bias grads, and the tile's shares of
                                    the adt grad and of d scale / d gamma
  host       dt and trap grads from d scale / d gamma (the first token of a chunk takes the
             previous chunk's last d scale), sums of the per-tile and per-block partials
The sequential kernels only carry a [P, pairs-tile] state through a short per-chunk update;
all T x T and T x N work is in the chunk-parallel kernels.
Saved for backward: the inputs, S_in [B, H, C, P, N] (bf16; float32 for float32 ``v``) and
(``TUNING["save_y_pre"]``, with z) y before the gate.
Backward scratch: G (as S_in), float32 per-token and per-block partials.
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
# launch settings per kernel (Triton launch options) and tile sizes, chosen by H100 sweeps
# (benchmarks/results/kernels/h100_s10)
TUNING = {
    "launch": {
        "state_fwd": {"num_warps": 4, "num_stages": 2},
        "out_fwd": {"num_warps": 4, "num_stages": 1},
        "state_bwd": {"num_warps": 4, "num_stages": 2},
        "bwd_dx": {"num_warps": 4, "num_stages": 1},
        "bwd_qk": {"num_warps": 8, "num_stages": 1},
    },
    "pairs": 16,  # state tile of the sequential kernels
    "qk_pairs": 32,  # pairs per program of _bwd_qk
    "qk_heads": 8,  # heads per program of _bwd_qk (a divisor of the heads per group)
    "max_chunk": 64,
    # the smallest headdim tile with 64-token chunks (a 32-wide one faulted on an H100)
    "min_bp": 64,
    # with a gate z: keep y before the gate (y_pre, [B, L, H, P] in v's dtype) from _out_fwd for
    # dz, instead of _bwd_dx forming it again from S_in (a [T, N] x [N, P] and a [T, T] x [T, P]
    # product and S_in's read per chunk)
    "save_y_pre": True,
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
def _chunk_start(ADT, DT, TRAP, RESET, b, h, c, L, sa_b, sa_l, sa_h, sd_b, sd_l, sd_h,
                 st_b, st_l, st_h, T: tl.constexpr, HAS_RESET: tl.constexpr):
    """Chunk c of head h: its tokens [T] and their live mask, the per-token scalars a (in-chunk
    cumsum of adt), dt, gamma = lambda dt, scale = gamma + (1 - lambda_next) dt_next (0 past
    the end), and seg, the resets seen so far inside the chunk (0 without resets)."""
    tok = c * T + tl.arange(0, T)
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
    if HAS_RESET:
        seg = tl.cumsum(tl.load(RESET + b * L + tok, mask=live, other=0).to(tl.int32), axis=0)
    else:
        seg = tl.zeros([T], dtype=tl.int32)
    return tok, live, tl.cumsum(adt, axis=0), dt, gamma, scale, seg


@triton.jit
def _frame(ANG, b, h, tok, live, j, R, dt, sg_b, sg_l, sg_h, sg_r, FAST: tl.constexpr):
    """Head h's chunk frame for pairs j, [T, len(j)]: tanh of the angle logits (0 for pairs
    >= R and past the end), the in-chunk angle ell = cumsum(pi tanh(angles) dt), its cos, sin."""
    m = live[:, None] & (j < R)[None, :]
    ptr = ANG + b * sg_b + tok[:, None] * sg_l + h * sg_h + j[None, :] * sg_r
    th = _tanh(tl.load(ptr, mask=m, other=0.0).to(tl.float32))
    ell = tl.cumsum(3.141592653589793 * th * dt[:, None], axis=0)
    cos, sin = _cos_sin(ell, FAST)
    return th, ell, cos, sin


@triton.jit
def _rotated(X, BIAS, h, row, live, j0, N, s_n, sb_h, sb_n, cos, sin, JB: tl.constexpr):
    """rot(x + bias_h, ell) for pairs j0 .. j0 + JB of the q or k rows at offsets ``row``: the
    even and odd halves [T, JB] in float32 (0 past the end and past N). One [T, 2 JB] load."""
    n = 2 * j0 + tl.arange(0, 2 * JB)
    x = tl.load(X + row[:, None] + n[None, :] * s_n, mask=live[:, None] & (n < N)[None, :],
                other=0.0)
    raw_e, raw_o = tl.split(tl.reshape(x.to(tl.float32), [x.shape[0], JB, 2]))
    bias = tl.load(BIAS + h * sb_h + n * sb_n, mask=n < N, other=0.0).to(tl.float32)
    bias_e, bias_o = tl.split(tl.reshape(bias, [JB, 2]))
    e = tl.where(live[:, None], raw_e + bias_e[None, :], 0.0)
    o = tl.where(live[:, None], raw_o + bias_o[None, :], 0.0)
    return e * cos - o * sin, e * sin + o * cos


@triton.jit
def _last_row(x, T: tl.constexpr):
    """The last row of a [T, J] tile."""
    return tl.sum(tl.where((tl.arange(0, T) == T - 1)[:, None], x, 0.0), axis=0)


@triton.jit
def _decay_matrix(a, seg, t):
    """[T, T] exp(a_t - a_s) for s < t in the same document, else 0 (masked before exp);
    t = arange(T) (see _bwd_qk)."""
    valid = (t[:, None] > t[None, :]) & (seg[:, None] == seg[None, :])
    return tl.exp(tl.where(valid, a[:, None] - a[None, :], float("-inf")))


@triton.jit
def _weights(a, scale, seg, T: tl.constexpr):
    """Per-token weights of one chunk from a (in-chunk cumsum) and scale:
    carry_t = exp(a_t) (0 after a reset), to_end_s = exp(a_last - a_s) (0 before the last
    reset), w_state = to_end * scale, and the chunk's decay exp(a_last) (0 with a reset)."""
    a_last = tl.sum(tl.where(tl.arange(0, T) == T - 1, a, 0.0), axis=0)
    seg_last = tl.max(seg, axis=0)
    carry = tl.where(seg == 0, tl.exp(a), 0.0)
    to_end = tl.where(seg == seg_last, tl.exp(a_last - a), 0.0)
    decay = tl.where(seg_last == 0, tl.exp(a_last), 0.0)
    return carry, to_end, to_end * scale, decay


@triton.jit
def _intra_weights(a, scale, gamma, seg, t):
    """[T, T] W = exp(a_t - a_s) scale_s (s < t, same document) + gamma_t (s = t), and the
    decay part exp(a_t - a_s) alone; t = arange(T)."""
    decay_tt = _decay_matrix(a, seg, t)
    w = decay_tt * scale[None, :] + tl.where(t[:, None] == t[None, :], gamma[:, None], 0.0)
    return w, decay_tt


@triton.jit
def _state_offsets(bhc, p, cols, P, NW: tl.constexpr):
    """Offsets [BP, cols] into a [*, P, NW] state buffer (halves layout) of chunk ``bhc``."""
    return (bhc.to(tl.int64) * P + p[:, None]) * NW + cols[None, :]


@triton.jit
def _store_state(S, bhc, p, mp, j, P, s_e, s_o, N2B: tl.constexpr):
    """Store a state tile's even and odd halves [BP, pairs j] (in S's dtype) at chunk ``bhc``."""
    off = _state_offsets(bhc, p, j, P, 2 * N2B)
    tl.store(S + off, s_e.to(S.dtype.element_ty), mask=mp[:, None])
    tl.store(S + off + N2B, s_o.to(S.dtype.element_ty), mask=mp[:, None])


@triton.jit
def _state_t(S, bhc, p, mp, P, N2B: tl.constexpr):
    """The even and odd halves of chunk ``bhc``'s state loaded transposed, [N2B, BP] each."""
    ptr = S + (bhc.to(tl.int64) * P + p[None, :]) * (2 * N2B) + tl.arange(0, N2B)[:, None]
    return (tl.load(ptr, mask=mp[None, :], other=0.0),
            tl.load(ptr + N2B, mask=mp[None, :], other=0.0))


@triton.jit
def _tp(b, tok, h, p, s_b, s_l, s_h, s_p):
    """Offsets [T, BP] of a [B, L, H, P] tensor."""
    return b * s_b + tok[:, None] * s_l + h * s_h + p[None, :] * s_p


@triton.jit
def _gated_grad(DY, Z, b, tok, h, p, mask, sy_b, sy_l, sy_h, sy_p, sz_b, sz_l, sz_h, sz_p,
                HAS_Z: tl.constexpr):
    """(do, dy, z, sigmoid(z)) [T, BP] in float32: do = dy * silu(z), or dy without z."""
    dy = tl.load(DY + _tp(b, tok, h, p, sy_b, sy_l, sy_h, sy_p), mask=mask, other=0.0)
    dy = dy.to(tl.float32)
    if HAS_Z:
        z = tl.load(Z + _tp(b, tok, h, p, sz_b, sz_l, sz_h, sz_p), mask=mask, other=0.0)
        z = z.to(tl.float32)
        sig = tl.sigmoid(z)
        return dy * z * sig, dy, z, sig
    return dy, dy, dy, dy


@triton.jit
def _chunk_operands(Q, K, ADT, DT, TRAP, ANG, QBIAS, KBIAS, RESET,
                    sq_b, sq_l, sq_g, sq_n, sk_b, sk_l, sk_g, sk_n, sa_b, sa_l, sa_h,
                    sd_b, sd_l, sd_h, st_b, st_l, st_h, sg_b, sg_l, sg_h, sg_r,
                    sqb_h, sqb_n, skb_h, skb_n, L, H, G, NC, P, N, R,
                    T: tl.constexpr, BP: tl.constexpr, N2B: tl.constexpr,
                    HAS_RESET: tl.constexpr, FAST: tl.constexpr):
    """The start of the chunk kernels, grid (H, C, B): head, row, the chunk's tokens and
    [T, BP] mask, its index into the state buffers, a / scale / gamma / seg, and the head's
    rotated q and k halves [T, N2B] (float32)."""
    h, c, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g = h // (H // G)
    tok, live, a, dt, gamma, scale, seg = _chunk_start(
        ADT, DT, TRAP, RESET, b, h, c, L, sa_b, sa_l, sa_h, sd_b, sd_l, sd_h, st_b, st_l, st_h,
        T, HAS_RESET)
    _th, _ell, cos, sin = _frame(ANG, b, h, tok, live, tl.arange(0, N2B), R, dt,
                                 sg_b, sg_l, sg_h, sg_r, FAST)
    q_e, q_o = _rotated(Q, QBIAS, h, b * sq_b + tok * sq_l + g * sq_g, live, 0, N, sq_n,
                        sqb_h, sqb_n, cos, sin, N2B)
    k_e, k_o = _rotated(K, KBIAS, h, b * sk_b + tok * sk_l + g * sk_g, live, 0, N, sk_n,
                        skb_h, skb_n, cos, sin, N2B)
    p = tl.arange(0, BP)
    mask = live[:, None] & (p < P)[None, :]
    return (h, b, tok, p, mask, (b * H + h) * NC + c, a, gamma, scale, seg,
            q_e, q_o, k_e, k_o)


@triton.jit
def _chunk_scores(q_e, q_o, k_e, k_o, a, scale, gamma, seg, T: tl.constexpr,
                  DOT: tl.constexpr):
    """scores = (q k^T) * W [T, T], carry and w_state of one chunk."""
    carry, _to_end, w_state, _decay = _weights(a, scale, seg, T)
    w, _decay_tt = _intra_weights(a, scale, gamma, seg, tl.arange(0, T))
    qk = _mm(q_e, tl.trans(k_e), DOT) + _mm(q_o, tl.trans(k_o), DOT)
    return qk * w, carry, w_state


@triton.jit
def _read_out(SIN, scores, x, q_e, q_o, carry, d_skip, bhc, p, mp, P, N2B: tl.constexpr,
              DOT: tl.constexpr):
    """y before the gate [T, BP]: intra (scores x) + carry q S_in^T + D x."""
    s_e, s_o = _state_t(SIN, bhc, p, mp, P, N2B)
    return (_mm(scores, x, DOT) + carry[:, None] * (_mm(q_e, s_e, DOT) + _mm(q_o, s_o, DOT))
            + d_skip * x.to(tl.float32))


# Every kernel takes the inputs (Q, K, V, Z, DY, ADT, DT, TRAP, ANG, QBIAS, KBIAS, DSKIP,
# RESET; None where absent), its outputs, the inputs' strides in that order (_strides) and the
# sizes B, L, H, G, NC, P, N, R.

# -- forward ---------------------------------------------------------------------------------
@triton.jit
def _state_fwd(Q, K, V, Z, DY, ADT, DT, TRAP, ANG, QBIAS, KBIAS, DSKIP, RESET,
               SIN, SFIN, AFIN,
               sq_b, sq_l, sq_g, sq_n, sk_b, sk_l, sk_g, sk_n, sv_b, sv_l, sv_h, sv_p,
               sz_b, sz_l, sz_h, sz_p, sy_b, sy_l, sy_h, sy_p, sa_b, sa_l, sa_h,
               sd_b, sd_l, sd_h, st_b, st_l, st_h, sg_b, sg_l, sg_h, sg_r,
               sqb_h, sqb_n, skb_h, skb_n, B, L, H, G, NC, P, N, R,
               T: tl.constexpr, BP: tl.constexpr, N2B: tl.constexpr, JB: tl.constexpr,
               HAS_RESET: tl.constexpr, DOT: tl.constexpr, FAST: tl.constexpr):
    """Walks one head's chunks for a tile of JB pairs: stores S_in[c], then the final state
    and the final angle (mod 2 pi). S_in[c + 1] = rot(-phi_c)(decay_c S_in[c]
    + sum_s w_state_s x_s k_s^T)."""
    pid_j, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g = h // (H // G)
    p = tl.arange(0, BP)
    mp = p < P
    j0 = pid_j * JB
    j = j0 + tl.arange(0, JB)
    s_e = tl.zeros([BP, JB], dtype=tl.float32)  # the state entering chunk c, in its frame
    s_o = tl.zeros([BP, JB], dtype=tl.float32)
    total = tl.zeros([JB], dtype=tl.float32)  # the angle so far, mod 2 pi
    for c in range(NC):
        bhc = (b * H + h) * NC + c
        _store_state(SIN, bhc, p, mp, j, P, s_e, s_o, N2B)
        tok, live, a, dt, _gamma, scale, seg = _chunk_start(
            ADT, DT, TRAP, RESET, b, h, c, L, sa_b, sa_l, sa_h, sd_b, sd_l, sd_h,
            st_b, st_l, st_h, T, HAS_RESET)
        _carry, _to_end, w_state, decay = _weights(a, scale, seg, T)
        _th, ell, cos, sin = _frame(ANG, b, h, tok, live, j, R, dt, sg_b, sg_l, sg_h, sg_r, FAST)
        k_e, k_o = _rotated(K, KBIAS, h, b * sk_b + tok * sk_l + g * sk_g, live, j0, N, sk_n,
                            skb_h, skb_n, cos, sin, JB)
        x = tl.load(V + _tp(b, tok, h, p, sv_b, sv_l, sv_h, sv_p),
                    mask=live[:, None] & mp[None, :], other=0.0)
        xw = tl.trans(x.to(tl.float32) * w_state[:, None])  # [BP, T]
        u_e = decay * s_e + _mm(xw, k_e, DOT)
        u_o = decay * s_o + _mm(xw, k_o, DOT)
        phi = _last_row(ell, T)
        cp, sp = _cos_sin(phi, FAST)
        cp, sp = cp[None, :], sp[None, :]
        s_e, s_o = u_e * cp + u_o * sp, u_o * cp - u_e * sp
        total += phi
        total -= 6.283185307179586 * tl.floor(total * 0.15915494309189535)
    _store_state(SFIN, b * H + h, p, mp, j, P, s_e, s_o, N2B)
    tl.store(AFIN + (b * H + h) * N2B + j, total)


@triton.jit
def _out_fwd(Q, K, V, Z, DY, ADT, DT, TRAP, ANG, QBIAS, KBIAS, DSKIP, RESET,
             SIN, Y, YP,
             sq_b, sq_l, sq_g, sq_n, sk_b, sk_l, sk_g, sk_n, sv_b, sv_l, sv_h, sv_p,
             sz_b, sz_l, sz_h, sz_p, sy_b, sy_l, sy_h, sy_p, sa_b, sa_l, sa_h,
             sd_b, sd_l, sd_h, st_b, st_l, st_h, sg_b, sg_l, sg_h, sg_r,
             sqb_h, sqb_n, skb_h, skb_n, B, L, H, G, NC, P, N, R,
             T: tl.constexpr, BP: tl.constexpr, N2B: tl.constexpr, HAS_D: tl.constexpr,
             HAS_Z: tl.constexpr, HAS_RESET: tl.constexpr, DOT: tl.constexpr,
             FAST: tl.constexpr, STORE_YP: tl.constexpr):
    """y of one chunk of one head: (intra + carry q S_in^T + D x) * silu(z); STORE_YP: also
    y before the gate (YP, for dz)."""
    h, b, tok, p, mask, bhc, a, gamma, scale, seg, q_e, q_o, k_e, k_o = _chunk_operands(
        Q, K, ADT, DT, TRAP, ANG, QBIAS, KBIAS, RESET, sq_b, sq_l, sq_g, sq_n,
        sk_b, sk_l, sk_g, sk_n, sa_b, sa_l, sa_h, sd_b, sd_l, sd_h, st_b, st_l, st_h,
        sg_b, sg_l, sg_h, sg_r, sqb_h, sqb_n, skb_h, skb_n, L, H, G, NC, P, N, R,
        T, BP, N2B, HAS_RESET, FAST)
    scores, carry, _w_state = _chunk_scores(q_e, q_o, k_e, k_o, a, scale, gamma, seg, T, DOT)
    x = tl.load(V + _tp(b, tok, h, p, sv_b, sv_l, sv_h, sv_p), mask=mask, other=0.0)
    d_skip = 0.0
    if HAS_D:
        d_skip = tl.load(DSKIP + h).to(tl.float32)
    y = _read_out(SIN, scores, x, q_e, q_o, carry, d_skip, bhc, p, p < P, P, N2B, DOT)
    out = ((b * L + tok[:, None]).to(tl.int64) * H + h) * P + p[None, :]
    if HAS_Z:
        if STORE_YP:
            tl.store(YP + out, y.to(YP.dtype.element_ty), mask=mask)
        z = tl.load(Z + _tp(b, tok, h, p, sz_b, sz_l, sz_h, sz_p), mask=mask, other=0.0)
        z = z.to(tl.float32)
        y = y * z * tl.sigmoid(z)
    tl.store(Y + out, y.to(Y.dtype.element_ty), mask=mask)


# -- backward --------------------------------------------------------------------------------
@triton.jit
def _state_bwd(Q, K, V, Z, DY, ADT, DT, TRAP, ANG, QBIAS, KBIAS, DSKIP, RESET,
               GST,
               sq_b, sq_l, sq_g, sq_n, sk_b, sk_l, sk_g, sk_n, sv_b, sv_l, sv_h, sv_p,
               sz_b, sz_l, sz_h, sz_p, sy_b, sy_l, sy_h, sy_p, sa_b, sa_l, sa_h,
               sd_b, sd_l, sd_h, st_b, st_l, st_h, sg_b, sg_l, sg_h, sg_r,
               sqb_h, sqb_n, skb_h, skb_n, B, L, H, G, NC, P, N, R,
               T: tl.constexpr, BP: tl.constexpr, N2B: tl.constexpr, JB: tl.constexpr,
               HAS_Z: tl.constexpr, HAS_RESET: tl.constexpr, DOT: tl.constexpr,
               FAST: tl.constexpr):
    """dS[c] = dL/dS_in[c] walking backwards for a tile of JB pairs; stores
    G_c = dL/dU_c = rot(-phi_c)^T dS[c + 1]."""
    pid_j, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g = h // (H // G)
    p = tl.arange(0, BP)
    mp = p < P
    j0 = pid_j * JB
    j = j0 + tl.arange(0, JB)
    ds_e = tl.zeros([BP, JB], dtype=tl.float32)  # dL/dS_in[c + 1]
    ds_o = tl.zeros([BP, JB], dtype=tl.float32)
    for i in range(NC):
        c = NC - 1 - i
        bhc = (b * H + h) * NC + c
        tok, live, a, dt, _gamma, _scale, seg = _chunk_start(
            ADT, DT, TRAP, RESET, b, h, c, L, sa_b, sa_l, sa_h, sd_b, sd_l, sd_h,
            st_b, st_l, st_h, T, HAS_RESET)
        _th, ell, cos, sin = _frame(ANG, b, h, tok, live, j, R, dt, sg_b, sg_l, sg_h, sg_r, FAST)
        cp, sp = _cos_sin(_last_row(ell, T), FAST)
        cp, sp = cp[None, :], sp[None, :]
        g_e = ds_e * cp - ds_o * sp
        g_o = ds_e * sp + ds_o * cp
        _store_state(GST, bhc, p, mp, j, P, g_e, g_o, N2B)
        carry, _to_end, _w_state, decay = _weights(a, a, seg, T)  # (no scale needed)
        q_e, q_o = _rotated(Q, QBIAS, h, b * sq_b + tok * sq_l + g * sq_g, live, j0, N, sq_n,
                            sqb_h, sqb_n, cos, sin, JB)
        do, _dy, _z, _sig = _gated_grad(DY, Z, b, tok, h, p, live[:, None] & mp[None, :],
                                        sy_b, sy_l, sy_h, sy_p, sz_b, sz_l, sz_h, sz_p, HAS_Z)
        do_t = tl.trans(do * carry[:, None])  # [BP, T]
        ds_e = decay * g_e + _mm(do_t, q_e, DOT)
        ds_o = decay * g_o + _mm(do_t, q_o, DOT)


@triton.jit
def _bwd_dx(Q, K, V, Z, DY, ADT, DT, TRAP, ANG, QBIAS, KBIAS, DSKIP, RESET,
            SIN, GST, YP, DV, DZ, DDP,
            sq_b, sq_l, sq_g, sq_n, sk_b, sk_l, sk_g, sk_n, sv_b, sv_l, sv_h, sv_p,
            sz_b, sz_l, sz_h, sz_p, sy_b, sy_l, sy_h, sy_p, sa_b, sa_l, sa_h,
            sd_b, sd_l, sd_h, st_b, st_l, st_h, sg_b, sg_l, sg_h, sg_r,
            sqb_h, sqb_n, skb_h, skb_n, B, L, H, G, NC, P, N, R,
            T: tl.constexpr, BP: tl.constexpr, N2B: tl.constexpr, HAS_D: tl.constexpr,
            HAS_Z: tl.constexpr, HAS_RESET: tl.constexpr, DOT: tl.constexpr,
            FAST: tl.constexpr, LOAD_YP: tl.constexpr):
    """One chunk of one head: dx (intra, skip, and x's use in the chunk state), dz, dD;
    LOAD_YP: dz from the forward's y before the gate (YP) instead of forming it again."""
    h, b, tok, p, mask, bhc, a, gamma, scale, seg, q_e, q_o, k_e, k_o = _chunk_operands(
        Q, K, ADT, DT, TRAP, ANG, QBIAS, KBIAS, RESET, sq_b, sq_l, sq_g, sq_n,
        sk_b, sk_l, sk_g, sk_n, sa_b, sa_l, sa_h, sd_b, sd_l, sd_h, st_b, st_l, st_h,
        sg_b, sg_l, sg_h, sg_r, sqb_h, sqb_n, skb_h, skb_n, L, H, G, NC, P, N, R,
        T, BP, N2B, HAS_RESET, FAST)
    mp = p < P
    scores, carry, w_state = _chunk_scores(q_e, q_o, k_e, k_o, a, scale, gamma, seg, T, DOT)
    x = tl.load(V + _tp(b, tok, h, p, sv_b, sv_l, sv_h, sv_p), mask=mask, other=0.0)
    do, dy, z, sig = _gated_grad(DY, Z, b, tok, h, p, mask, sy_b, sy_l, sy_h, sy_p,
                                 sz_b, sz_l, sz_h, sz_p, HAS_Z)
    d_skip = 0.0
    if HAS_D:
        d_skip = tl.load(DSKIP + h).to(tl.float32)
        tl.store(DDP + bhc, tl.sum(do * x.to(tl.float32)))
    out = ((b * L + tok[:, None]).to(tl.int64) * H + h) * P + p[None, :]
    if HAS_Z:
        if LOAD_YP:
            y_pre = tl.load(YP + out, mask=mask, other=0.0).to(tl.float32)
        else:
            y_pre = _read_out(SIN, scores, x, q_e, q_o, carry, d_skip, bhc, p, mp, P, N2B, DOT)
        tl.store(DZ + out, (dy * y_pre * sig * (1.0 + z * (1.0 - sig))).to(DZ.dtype.element_ty),
                 mask=mask)
    g_e, g_o = _state_t(GST, bhc, p, mp, P, N2B)
    dx = (_mm(tl.trans(scores), do, DOT) + d_skip * do
          + w_state[:, None] * (_mm(k_e, g_e, DOT) + _mm(k_o, g_o, DOT)))
    tl.store(DV + out, dx.to(DV.dtype.element_ty), mask=mask)


@triton.jit
def _unrotate(d_e, d_o, live, cos, sin, DB, bias, j, N):
    """d(q or k) [T, pairs j] from the rotated frame back to the biased, unrotated one (rows
    past the end 0); stores the sum over the chunk's tokens (the bias grad's part, DB)."""
    x_e = tl.where(live[:, None], d_e * cos + d_o * sin, 0.0)
    x_o = tl.where(live[:, None], d_o * cos - d_e * sin, 0.0)
    tl.store(DB + bias, tl.sum(x_e, axis=0), mask=2 * j < N)
    tl.store(DB + bias + 1, tl.sum(x_o, axis=0), mask=2 * j + 1 < N)
    return x_e, x_o


@triton.jit
def _bwd_qk(Q, K, V, Z, DY, ADT, DT, TRAP, ANG, QBIAS, KBIAS, DSKIP, RESET,
            SIN, GST, DQ, DK, DQB, DKB, DANG, DADT, DSC,
            sq_b, sq_l, sq_g, sq_n, sk_b, sk_l, sk_g, sk_n, sv_b, sv_l, sv_h, sv_p,
            sz_b, sz_l, sz_h, sz_p, sy_b, sy_l, sy_h, sy_p, sa_b, sa_l, sa_h,
            sd_b, sd_l, sd_h, st_b, st_l, st_h, sg_b, sg_l, sg_h, sg_r,
            sqb_h, sqb_n, skb_h, skb_n, B, L, H, G, NC, P, N, R, HB,
            T: tl.constexpr, BP: tl.constexpr, N2B: tl.constexpr, JD: tl.constexpr,
            HAS_Z: tl.constexpr, HAS_RESET: tl.constexpr, DOT: tl.constexpr,
            FAST: tl.constexpr):
    """One chunk, JD pairs (grid (C, N2B / JD, B * G * head blocks)), each of HB heads of one
    q/k group in turn: d(q, k) of those pairs in the head's rotated frame (float32), the grad
    of its in-chunk angle ell and from it the angle grads and dt's angle part, d(q, k) rotated
    back (the bias grads, and the sum over the block's heads: a partial dq, dk per block), and
    the pair tile's share of the adt grad and of d scale / d gamma (DADT, DSC: per tile,
    summed on the host, which forms dt and trap grads from DSC). Every scalar grad is linear
    in sums over pairs (q k^T, x^T G k, q S_in^T do, <G, S_in>), so a tile's share needs its
    pairs only; d_qk = (do x^T) * W is whole in every tile."""
    c, pid_j, pid = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    nhb = H // G // HB  # head blocks per group
    b = pid // (G * nhb)
    g = (pid // nhb) % G
    hb = pid % nhb
    p = tl.arange(0, BP)
    mp = p < P
    j0 = pid_j * JD
    j = j0 + tl.arange(0, JD)
    nsc = B * L * H
    dq_acc_e = tl.zeros([T, JD], dtype=tl.float32)
    dq_acc_o = tl.zeros([T, JD], dtype=tl.float32)
    dk_acc_e = tl.zeros([T, JD], dtype=tl.float32)
    dk_acc_o = tl.zeros([T, JD], dtype=tl.float32)
    for i in range(HB):
        h = (g * nhb + hb) * HB + i
        bhc = (b * H + h) * NC + c
        # zero, but not known to be: everything indexed by the chunk's tokens depends on it, so
        # the compiler cannot hoist those [T, *] offsets and masks out of the head loop, where
        # they would stay live in registers across it (ptxas, sm_90: 2744 -> 1780 bytes of
        # spills at 8 warps)
        zero = h // H
        t = tl.arange(0, T) + zero
        tok, live, a, dt, gamma, scale, seg = _chunk_start(
            ADT, DT, TRAP, RESET, b, h, c + zero, L, sa_b, sa_l, sa_h, sd_b, sd_l, sd_h,
            st_b, st_l, st_h, T, HAS_RESET)
        mask = live[:, None] & mp[None, :]
        th, _ell, cos, sin = _frame(ANG, b, h, tok, live, j, R, dt, sg_b, sg_l, sg_h, sg_r,
                                    FAST)
        q_e, q_o = _rotated(Q, QBIAS, h, b * sq_b + tok * sq_l + g * sq_g, live, j0, N, sq_n,
                            sqb_h, sqb_n, cos, sin, JD)
        k_e, k_o = _rotated(K, KBIAS, h, b * sk_b + tok * sk_l + g * sk_g, live, j0, N, sk_n,
                            skb_h, skb_n, cos, sin, JD)
        carry, to_end, w_state, decay = _weights(a, scale, seg, T)
        w, decay_tt = _intra_weights(a, scale, gamma, seg, t)
        x = tl.load(V + _tp(b, tok, h, p, sv_b, sv_l, sv_h, sv_p), mask=mask, other=0.0)
        do, _dy, _z, _sig = _gated_grad(DY, Z, b, tok, h, p, mask, sy_b, sy_l, sy_h, sy_p,
                                        sz_b, sz_l, sz_h, sz_p, HAS_Z)
        s_off = _state_offsets(bhc, p, j, P, 2 * N2B)
        s_e = tl.load(SIN + s_off, mask=mp[:, None], other=0.0)
        s_o = tl.load(SIN + s_off + N2B, mask=mp[:, None], other=0.0)
        g_e = tl.load(GST + s_off, mask=mp[:, None], other=0.0)
        g_o = tl.load(GST + s_off + N2B, mask=mp[:, None], other=0.0)

        # dq: intra + the carried state's read-out
        qk = _mm(q_e, tl.trans(k_e), DOT) + _mm(q_o, tl.trans(k_o), DOT)  # [T, T]
        d_scores = _mm(do, tl.trans(x), DOT)
        d_qk = d_scores * w
        d_w = d_scores * qk
        dos_e = _mm(do, s_e, DOT)  # [T, JD]
        dos_o = _mm(do, s_o, DOT)
        dq_e = _mm(d_qk, k_e, DOT) + carry[:, None] * dos_e
        dq_o = _mm(d_qk, k_o, DOT) + carry[:, None] * dos_o
        # q_t . (do_t S_in) = do_t . (q_t S_in^T): the carried read-out's share of d a_t
        q_s = tl.sum(q_e * dos_e + q_o * dos_o, axis=1)
        d_ell = q_e * dq_o - q_o * dq_e  # from q's rotation by ell

        # dk: intra + k's use in the chunk state (m = x^T G per token)
        m_e = _mm(x, g_e, DOT)  # [T, JD]
        m_o = _mm(x, g_o, DOT)
        d_qk_t = tl.trans(d_qk)
        dk_e = _mm(d_qk_t, q_e, DOT) + w_state[:, None] * m_e
        dk_o = _mm(d_qk_t, q_o, DOT) + w_state[:, None] * m_o
        d_ell += k_e * dk_o - k_o * dk_e
        mk = tl.sum(m_e * k_e + m_o * k_o, axis=1)  # x_s^T G k_s

        # the state's rotation by -phi_c (phi_c = the last token's ell): the pairwise cross
        # terms of G with U and with S_in; and <G, S_in> (the chunk decay's grad)
        g_e, g_o = g_e.to(tl.float32), g_o.to(tl.float32)
        s_e, s_o = s_e.to(tl.float32), s_o.to(tl.float32)
        d_phi = (tl.sum(w_state[:, None] * (m_e * k_o - m_o * k_e), axis=0)
                 + decay * tl.sum(g_e * s_o - g_o * s_e, axis=0))
        d_ell += tl.where((t == T - 1)[:, None], d_phi[None, :], 0.0)
        d_dec = tl.sum(g_e * s_e + g_o * s_o)

        # scalars: a (-> adt) here; d scale and d gamma go to the host (dt, trap)
        z_dec = d_w * decay_tt
        z_w = z_dec * scale[None, :]
        w_mk = w_state * mk
        d_scale = tl.sum(z_dec, axis=0) + to_end * mk
        d_a = tl.sum(z_w, axis=1) - tl.sum(z_w, axis=0) + carry * q_s - w_mk
        d_a += tl.where(t == T - 1, tl.sum(w_mk, axis=0) + d_dec * decay, 0.0)
        sc = pid_j * nsc + (b * L + tok) * H + h
        tl.store(DADT + sc, tl.cumsum(d_a, axis=0, reverse=True), mask=live)
        tl.store(DSC + sc, d_scale, mask=live)
        d_gamma = tl.sum(tl.where(t[:, None] == t[None, :], d_w, 0.0), axis=1) + d_scale
        tl.store(DSC + (N2B // JD) * nsc + sc, d_gamma, mask=live)

        # angles: ell = cumsum(pi tanh(angle) dt), so d(pi tanh(angle) dt) is the reverse
        # cumsum of d ell
        d_rate = tl.cumsum(d_ell, axis=0, reverse=True)
        d_ang = d_rate * dt[:, None] * 3.141592653589793 * (1.0 - th * th)
        tl.store(DANG + ((b * L + tok) * H + h).to(tl.int64)[:, None] * R + j[None, :],
                 d_ang.to(DANG.dtype.element_ty), mask=live[:, None] & (j < R)[None, :])
        tl.store(DSC + 2 * (N2B // JD) * nsc + sc,
                 tl.sum(d_rate * 3.141592653589793 * th, axis=1), mask=live)

        # back to the unrotated frame: the bias grads, and dq, dk summed over the heads
        bias = ((b * NC + c) * H + h) * N + 2 * j
        x_e, x_o = _unrotate(dq_e, dq_o, live, cos, sin, DQB, bias, j, N)
        dq_acc_e += x_e
        dq_acc_o += x_o
        x_e, x_o = _unrotate(dk_e, dk_o, live, cos, sin, DKB, bias, j, N)
        dk_acc_e += x_e
        dk_acc_o += x_o
    tok = c * T + tl.arange(0, T)
    live = tok < L
    out = (((hb * B + b) * L + tok) * G + g).to(tl.int64)[:, None] * N + 2 * j[None, :]
    m_e = live[:, None] & (2 * j < N)[None, :]
    m_o = live[:, None] & (2 * j + 1 < N)[None, :]
    tl.store(DQ + out, dq_acc_e, mask=m_e)
    tl.store(DQ + out + 1, dq_acc_o, mask=m_o)
    tl.store(DK + out, dk_acc_e, mask=m_e)
    tl.store(DK + out + 1, dk_acc_o, mask=m_o)


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
    JB: int  # pairs per program of the sequential kernels (N2B // JB tiles)
    JD: int  # pairs per program of _bwd_qk
    HB: int  # heads per program of _bwd_qk

    def dims(self) -> tuple[int, ...]:
        """The sizes every kernel takes: B, L, H, G, NC, P, N, R."""
        return self.B, self.L, self.H, self.G, self.NC, self.P, self.N, self.R


def _geometry(q: Tensor, v: Tensor, angles: Tensor, chunk_size: int) -> _Geometry:
    B, L, H, P = v.shape
    G, N, R = q.shape[2], q.shape[3], angles.shape[-1]
    if chunk_size not in CHUNK_SIZES:
        raise MegaCppError(f"mamba3_scan triton: chunk_size must be one of {CHUNK_SIZES}, "
                           f"got {chunk_size} (use the reference for other chunk sizes)")
    if P > MAX_HEADDIM or N > MAX_D_STATE:
        raise MegaCppError(f"mamba3_scan triton: needs headdim <= {MAX_HEADDIM} and d_state <= "
                           f"{MAX_D_STATE}, got {P} and {N} (use the reference)")
    N2B = max(16, triton.next_power_of_2((N + 1) // 2))
    T = min(chunk_size, TUNING["max_chunk"])  # any chunking computes the same function
    if v.dtype == torch.float32:
        T = min(T, 32)  # float32 operands of 64-token chunks overflow shared memory
    NC = triton.cdiv(L, T)
    if max(v.numel(), angles.numel(), q.numel(), B * H * NC * P * 2 * N2B) >= 2**31:
        raise MegaCppError("mamba3_scan triton: tensors of 2**31 elements or more are not "
                           "supported (32-bit offsets); split the batch")
    per_group = H // G
    HB = max(d for d in range(1, min(per_group, TUNING["qk_heads"]) + 1) if per_group % d == 0)
    BP = max(16, triton.next_power_of_2(P), TUNING["min_bp"] if T == 64 else 16)
    return _Geometry(B, L, H, G, P, N, R, T, NC, BP, N2B, min(N2B, TUNING["pairs"]),
                     min(N2B, TUNING["qk_pairs"]), HB)


def _launch(kernel: str) -> dict[str, int]:
    return {k: v for k, v in TUNING["launch"][kernel].items() if v is not None}


def _precision(v: Tensor) -> tuple[torch.dtype, tl.dtype, bool]:
    """(state storage dtype, matmul operand dtype, fast trig): float32 with accurate trig for
    float32 v; else bf16 with the hardware sin/cos (not in the CPU interpreter)."""
    if v.dtype == torch.float32:
        return torch.float32, tl.float32, False
    return torch.bfloat16, tl.bfloat16, v.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"


class _Inputs(NamedTuple):
    """The inputs every kernel takes, in its argument order (None where absent)."""

    q: Tensor
    k: Tensor
    v: Tensor
    z: Tensor | None
    dy: Tensor | None
    adt: Tensor
    dt: Tensor
    trap: Tensor
    angles: Tensor
    q_bias: Tensor
    k_bias: Tensor
    D: Tensor | None
    reset: Tensor | None  # int8

    def strides(self) -> tuple[int, ...]:
        """The strides of q ... k_bias in order (zeros for an absent tensor)."""
        out: list[int] = []
        for t, ndim in zip(self, (4, 4, 4, 4, 4, 3, 3, 3, 4, 2, 2)):
            out += t.stride() if t is not None else (0,) * ndim
        return tuple(out)


def _final_state(geo: _Geometry, k: Tensor, v: Tensor, k_bias: Tensor, s_fin: Tensor,
                 a_fin: Tensor) -> Mamba3ScanState:
    """The reference's final state in its global frame (angle mod 2 pi), without gradient."""
    L, H, G, N, R = geo.L, geo.H, geo.G, geo.N, geo.R
    total = torch.remainder(a_fin, 2 * math.pi)  # [B, H, N2B]
    cos, sin = torch.cos(total)[:, :, None], torch.sin(total)[:, :, None]
    s_e, s_o = s_fin[..., 0, :], s_fin[..., 1, :]  # [B, H, P, N2B]
    ssm = torch.stack([s_e * cos - s_o * sin, s_e * sin + s_o * cos], dim=-1)
    ssm = ssm.flatten(-2)[..., :N].contiguous()
    k_last = k[:, L - 1].float().repeat_interleave(H // G, dim=1) + k_bias.float()  # [B, H, N]
    angle = total[..., :R].contiguous()
    return Mamba3ScanState(angle, ssm, _rotate(k_last, angle), v[:, L - 1].float())


def _forward(geo: _Geometry, ins: _Inputs, dtype: torch.dtype, dot,
             fast: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """_state_fwd then _out_fwd: y, S_in, the final state [B, H, P, 2, N2B] and angle
    [B, H, N2B], and y before the gate (``TUNING["save_y_pre"]`` with z, else None)."""
    v, z = ins.v, ins.z
    B, L, H, P, T, NC, N2B = geo.B, geo.L, geo.H, geo.P, geo.T, geo.NC, geo.N2B
    dev = v.device
    shape = {"T": T, "BP": geo.BP, "N2B": N2B, "HAS_RESET": ins.reset is not None,
             "DOT": dot, "FAST": fast}
    s_in = torch.empty(B, H, NC, P, 2, N2B, device=dev, dtype=dtype)
    s_fin = torch.empty(B, H, P, 2, N2B, device=dev, dtype=torch.float32)
    a_fin = torch.empty(B, H, N2B, device=dev, dtype=torch.float32)
    _state_fwd[(N2B // geo.JB, H, B)](
        *ins, s_in, s_fin, a_fin, *ins.strides(), *geo.dims(), JB=geo.JB, **shape,
        **_launch("state_fwd"))
    y = torch.empty(B, L, H, P, device=dev, dtype=v.dtype)
    y_pre = torch.empty_like(y) if z is not None and TUNING["save_y_pre"] else None
    _out_fwd[(H, NC, B)](
        *ins, s_in, y, y_pre, *ins.strides(), *geo.dims(), HAS_D=ins.D is not None,
        HAS_Z=z is not None, STORE_YP=y_pre is not None, **shape, **_launch("out_fwd"))
    return y, s_in, s_fin, a_fin, y_pre


def _backward(geo: _Geometry, ins: _Inputs, s_in: Tensor, y_pre: Tensor | None, dot,
              fast: bool) -> tuple:
    """_state_bwd, _bwd_dx, _bwd_qk; the input grads."""
    q, k, v, z, _dy, adt, dt, trap, angles, q_bias, k_bias, D, rst = ins
    B, L, H, G, P, N, R, T, NC = geo[:9]
    dev = v.device
    f32 = {"device": dev, "dtype": torch.float32}
    shape = {"T": T, "BP": geo.BP, "N2B": geo.N2B, "HAS_Z": z is not None,
             "HAS_RESET": rst is not None, "DOT": dot, "FAST": fast}
    strides, dims = ins.strides(), geo.dims()
    g_st = torch.empty_like(s_in)
    _state_bwd[(geo.N2B // geo.JB, H, B)](
        *ins, g_st, *strides, *dims, JB=geo.JB, **shape, **_launch("state_bwd"))

    dv = torch.empty(B, L, H, P, device=dev, dtype=v.dtype)
    dz = torch.empty(B, L, H, P, device=dev, dtype=z.dtype) if z is not None else None
    dd_part = torch.empty(B, H, NC, **f32)
    _bwd_dx[(H, NC, B)](
        *ins, s_in, g_st, y_pre, dv, dz, dd_part, *strides, *dims, HAS_D=D is not None,
        LOAD_YP=y_pre is not None, **shape, **_launch("bwd_dx"))

    njd = geo.N2B // geo.JD
    nhb = H // G // geo.HB
    dq_part = torch.empty(nhb, B, L, G, N, **f32)  # per block of a group's heads
    dk_part = torch.empty(nhb, B, L, G, N, **f32)
    dqb_part = torch.empty(B, NC, H, N, **f32)  # per chunk
    dkb_part = torch.empty(B, NC, H, N, **f32)
    dang = torch.empty(B, L, H, R, device=dev, dtype=angles.dtype)
    dadt = torch.empty(njd, B, L, H, **f32)  # shares of the pair tiles
    d_sc = torch.empty(3, njd, B, L, H, **f32)  # d scale, d gamma, dt's angle part
    _bwd_qk[(NC, njd, B * G * nhb)](
        *ins, s_in, g_st, dq_part, dk_part, dqb_part, dkb_part, dang, dadt, d_sc,
        *strides, *dims, geo.HB, JD=geo.JD, **shape, **_launch("bwd_qk"))
    dadt, d_sc = (dadt[0], d_sc[:, 0]) if njd == 1 else (dadt.sum(0), d_sc.sum(1))

    # dt and trap: gamma = lambda dt and scale_{t-1} = gamma_{t-1} + (1 - lambda_t) dt_t
    d_scale, d_gamma, ddt_angle = d_sc.unbind(0)
    d_prev = torch.nn.functional.pad(d_scale[:, :-1], (0, 0, 1, 0))  # d scale_{t-1}
    lam = torch.sigmoid(trap.float())
    ddt = d_gamma * lam + d_prev * (1 - lam) + ddt_angle
    dtrap = (d_gamma - d_prev) * dt.float() * lam * (1 - lam)
    dD = dd_part.sum((0, 2)).to(D.dtype) if D is not None else None
    return (dq_part.sum(0).to(q.dtype), dk_part.sum(0).to(k.dtype), dv, dadt.to(adt.dtype),
            ddt.to(dt.dtype), dtrap.to(trap.dtype), dqb_part.sum((0, 1)).to(q_bias.dtype),
            dkb_part.sum((0, 1)).to(k_bias.dtype), dang, dD, dz, None, None)


class _Mamba3ScanFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, reset, chunk_size):
        geo = _geometry(q, v, angles, chunk_size)
        dtype, dot, fast = _precision(v)
        rst = reset.to(torch.int8).contiguous() if reset is not None else None
        ins = _Inputs(q, k, v, z, None, adt, dt, trap, angles, q_bias, k_bias, D, rst)
        y, s_in, s_fin, a_fin, y_pre = _forward(geo, ins, dtype, dot, fast)
        final = _final_state(geo, k, v, k_bias, s_fin, a_fin)
        ctx.save_for_backward(q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, rst, s_in,
                              y_pre)
        ctx.geo = geo
        ctx.mark_non_differentiable(*final)
        return (y, *final)

    @staticmethod
    def backward(ctx, dy, *_state_grads):
        q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, rst, s_in, y_pre = (
            ctx.saved_tensors)
        _dtype, dot, fast = _precision(v)
        ins = _Inputs(q, k, v, z, dy, adt, dt, trap, angles, q_bias, k_bias, D, rst)
        return _backward(ctx.geo, ins, s_in, y_pre, dot, fast)


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
