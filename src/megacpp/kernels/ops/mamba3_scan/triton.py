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

Halves layout. ``rot`` turns pairs ``(n = 2j, n = 2j+1)``. Every kernel splits q and k into
their even and odd components, ``[T, pairs]`` each (pairs j >= R get angle 0, padding is 0),
so a rotation is elementwise on the two halves and a dot product over N is two dots, one per
half; the chunk states are stored in the same layout, ``[P, 2, N2B]``.

Rotation table. q and k are shared by a group's heads but the angle is per head, so a
rotated copy per head would be 2 x [B, H, L, N]. Instead _prep writes, per head and token,
cos and sin of the in-chunk angle of the R rotated pairs ([B, H, L, 2, RB], float16; float32
for float32 ``v``): 4x fewer bytes than the rotated copies at N = 128, R = 32, and every
kernel rotates the (L2-resident, shared) q / k rows it loads with a few multiply-adds.

Kernels (grid; C = chunks, J = tiles of pairs):
  _prep      (H, C, B)   per head: the rotation table (rows padded to whole chunks), the
                         per-token scalars a (in-chunk cumsum of adt), scale, gamma, and phi_c
  forward    _state_fwd  (J, H, B)  walks the chunks: S_in[c] (stored), the final state
             _out_fwd    (H, C, B)  y = (intra + exp(a) q S_in^T + D x) * silu(z)
             _final      (H, B)     the final state in the global frame (the returned cache;
                                    not launched with output_final_state=False)
  backward   _state_bwd  (J, H, B)  walks the chunks backwards: G_c = dL/dU_c (stored)
             _bwd_dx     (H, C, B)  dx, dz, dD
             _bwd_dqk    (H*J', C, B)  for a tile of pairs (J' tiles): d(q, k) rotated back and
                                    stored per head (operand dtype) with the bias grads'
                                    parts; d ell of the rotated pairs (float32, from the
                                    float32 d(q, k) in the rotated frame and the state's
                                    rotation); the tile's shares of the adt grad, d scale
                                    and d gamma
             _bwd_tokens (H, C, B)  the per-token grads: angles (the reverse cumsum of d ell
                                    over the chunk), adt (the tiles' shares summed), dt and
                                    trap (from d scale / d gamma; the first token of a chunk
                                    takes the previous chunk's last d scale)
             _group_sum  (B*L*G / rows)  d(q, k): each group's per-head grads summed (float32)
  host       the sums of the per-chunk bias and D partials
The sequential kernels only carry a [P, pairs-tile] state through a short per-chunk update;
all T x T and T x N work is in the chunk-parallel kernels.
Saved for backward: the inputs (q, k and their biases made contiguous), _prep's outputs,
S_in [B, H, C, P, 2, N2B] (bf16; float32 for float32 ``v``) and (``TUNING["save_y_pre"]``,
with z) y before the gate.
Backward scratch: G (as S_in), d(q, k) per head [B, L, H, 2, N2B], float32 per-token partials.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from megacpp.errors import MegaCppError
from megacpp.kernels.device import cdiv, next_power_of_2, sm_count
from megacpp.kernels.ops.mamba3_scan.reference import Mamba3ScanState, _check_inputs
from megacpp.kernels.ops.sum_rows import sum_rows

CHUNK_SIZES = (16, 32, 64)
# launch settings per kernel (Triton launch options) and tile sizes, chosen by H100 sweeps
# (benchmarks/results/kernels/mamba3_h100_s3.log, h100_s7/mamba3_sweep_h100_s7.log, h100_s11).
# The kernels are latency-bound (ncu: long-scoreboard stalls after loads, one or two programs
# per SM), so register caps (maxnreg) buy more programs per SM: _out_fwd 2 -> 3. With the
# rotation table (session 11, L 4096): state tiles of 32 pairs, 437 -> 314 us (_state_fwd) and,
# with _state_bwd capped at 128 registers (96 spilled 30), 630 -> 365 us (_state_bwd).
# Session 15 swept them again at both the bench's shape (L 4096, 32 heads, d_state 128) and the
# nam56r-350m training step's (B 8, L 2048, 24 heads, d_state 64; h100_s15/mamba3_step_sweep*):
# _prep at 2 warps (119 -> 87 us, 27 -> 22), _state_fwd at num_stages 2 (315 -> 286, 98 -> 85;
# session 11 had found 3 better), and for the narrow shape the entries of "narrow_launch" and
# half-width state tiles (see "min_state_programs_per_sm")
TUNING = {
    "launch": {
        "prep": {"num_warps": 2, "num_stages": 1},
        "state_fwd": {"num_warps": 4, "num_stages": 2},
        "out_fwd": {"num_warps": 4, "num_stages": 1, "maxnreg": 168},
        "state_bwd": {"num_warps": 4, "num_stages": 2, "maxnreg": 128},
        "bwd_dx": {"num_warps": 4, "num_stages": 1},
        "bwd_dqk": {"num_warps": 4, "num_stages": 1},
        "bwd_tokens": {"num_warps": 4, "num_stages": 1},
        "final": {"num_warps": 4, "num_stages": 1},
        "group_sum": {"num_warps": 4, "num_stages": 1},
    },
    # replacing "launch" entries when the pairs pad to at most 32 (N2B <= 32: d_state <= 64):
    # the smaller [T, N2B] tiles of _out_fwd fit 128 registers (145 -> 130 us at the step's
    # shape; at d_state 128 the cap spills: 474 -> 783)
    "narrow_launch": {"out_fwd": {"maxnreg": 128}},
    "pairs": 32,  # state tile of the sequential kernels
    # ... halved (down to 16) while their grid, B * H * N2B / pairs programs, would give an SM
    # fewer than this many: at the step's shape 192 programs of 32 pairs on 132 SMs ran
    # _state_fwd / _state_bwd in 98 / 180 us, 384 of 16 pairs in 86 / 123; at the bench's (512
    # programs of 32) 16 pairs were slower (315 -> 432, 361 -> 489)
    "min_state_programs_per_sm": 2,
    # pairs per program of _bwd_dqk: 32 halves its pair-dimension tiles, so at 4 warps two
    # programs fit an SM (benchmarks/results/kernels/h100_s7)
    "dqk_pairs": 32,
    "max_chunk": 64,
    # chunks' phi per load of _final (one at a time it took 50 us at L 4096 on the H100)
    "final_chunks": 32,
    # (token, group) rows per program of _group_sum (whole head rows since session 15): 16 rows
    # at 4 warps, 41 us at the nam56r step's shape (B 8, L 2048, 24 heads of d_state 64; the
    # split-row kernel took 95) and 195 us at the bench's L 4096 (old 201; h100_s15 probe)
    "sum_rows": 16,
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
def _chunk_scalars(ADT, DT, TRAP, b, h, t0, L, sa_b, sa_l, sa_h, sd_b, sd_l, sd_h,
                   st_b, st_l, st_h, T: tl.constexpr):
    """[T] per-token scalars of one chunk and head: a (in-chunk cumsum of adt), dt,
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
    return tl.cumsum(adt, axis=0), dt, gamma, scale


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
def _angle_tanh(ANG, b, h, tok, live, j, R, sg_b, sg_l, sg_h, sg_r):
    """[T, pairs j] tanh of the angle logits (0 for pairs >= R and past the end)."""
    m = live[:, None] & (j < R)[None, :]
    ptr = ANG + b * sg_b + tok[:, None] * sg_l + h * sg_h + j[None, :] * sg_r
    return _tanh(tl.load(ptr, mask=m, other=0.0).to(tl.float32))


@triton.jit
def _pairs(X, row, live, j, j0, N, s_n, PAIRED: tl.constexpr):
    """Even and odd columns [T, pairs j = j0 + arange] (float32, 0 outside) of the rows at
    offsets ``row``. PAIRED (every pair of the padded tile inside N, unit stride): one load of
    the tile's [T, 2 len(j)] contiguous columns split in two; else two loads at a stride of two
    columns (session 10's _prep, which loaded q / k, with 32-pair tiles on an H100: 1.7 ms
    strided, 0.88 split; h100_s10)."""
    if PAIRED:
        n = 2 * j0 + tl.arange(0, 2 * j.shape[0])
        x = tl.load(X + row[:, None] + n[None, :], mask=live[:, None], other=0.0)
        e, o = tl.split(tl.reshape(x.to(tl.float32), [x.shape[0], j.shape[0], 2]))
        return e, o
    ptr = X + row[:, None] + (2 * j)[None, :] * s_n
    e = tl.load(ptr, mask=live[:, None] & (2 * j < N)[None, :], other=0.0).to(tl.float32)
    o = tl.load(ptr + s_n, mask=live[:, None] & (2 * j + 1 < N)[None, :], other=0.0)
    return e, o.to(tl.float32)


@triton.jit
def _bias_pairs(BIAS, h, j, N, sb_h, sb_n):
    """Even and odd entries [pairs j] of head h's bias (0 outside N)."""
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
def _rot_table(CS, row, j, R, RB: tl.constexpr):
    """cos, sin [T, pairs j] of the in-chunk angle at the padded rows ``row`` of _prep's table,
    in its dtype (1 and 0 for the pairs j >= R, which are not rotated)."""
    ptr = CS + row.to(tl.int64)[:, None] * (2 * RB) + j[None, :]
    m = (j < R)[None, :]
    return tl.load(ptr, mask=m, other=1.0), tl.load(ptr + RB, mask=m, other=0.0)


@triton.jit
def _rotated(X, xrow, live, j, j0, N, bias_e, bias_o, cos, sin, DOT: tl.constexpr,
             PAIRED: tl.constexpr):
    """rot(x + bias, ell) [T, pairs j = j0 + arange] of the rows at offsets ``xrow`` of a
    contiguous q or k: even and odd halves rounded to the matmul operand dtype (as a stored
    rotated copy would be, and half the registers), 0 past the end."""
    raw_e, raw_o = _pairs(X, xrow, live, j, j0, N, 1, PAIRED)
    x_e, x_o = _biased_rotated(raw_e, raw_o, bias_e, bias_o, live, cos, sin)
    return x_e.to(DOT), x_o.to(DOT)


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
def _weights(a, scale, seg, T: tl.constexpr):
    """Per-token weights of one chunk from a (in-chunk cumsum) and scale:
    carry_t = exp(a_t) (0 after a reset), to_end_s = exp(a_last - a_s) (0 before the last
    reset), w_state = to_end * scale, and the chunk's decay exp(a_last) (0 with a reset)."""
    a_last = _last(a, T)
    seg_last = tl.max(seg, axis=0)
    carry = tl.where(seg == 0, tl.exp(a), 0.0)
    to_end = tl.where(seg == seg_last, tl.exp(a_last - a), 0.0)
    decay = tl.where(seg_last == 0, tl.exp(a_last), 0.0)
    return carry, to_end, to_end * scale, decay


@triton.jit
def _intra_weights(a, scale, gamma, seg, T: tl.constexpr):
    """[T, T] W = exp(a_t - a_s) scale_s (s < t, same document) + gamma_t (s = t), and the
    decay part exp(a_t - a_s) alone."""
    t = tl.arange(0, T)
    decay_tt = _decay_matrix(a, seg, T)
    w = decay_tt * scale[None, :] + tl.where(t[:, None] == t[None, :], gamma[:, None], 0.0)
    return w, decay_tt


@triton.jit
def _load_scalars(SC, row, n_sc):
    """a, scale, gamma [T] of the chunk rows ``row`` (padded to whole chunks by _prep)."""
    return tl.load(SC + row), tl.load(SC + n_sc + row), tl.load(SC + 2 * n_sc + row)


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
def _state_t(S, bhc, p, mp, cols, P, NW: tl.constexpr):
    """The state tile of chunk ``bhc`` loaded transposed, [cols, BP] (0 past P)."""
    return tl.load(S + (bhc.to(tl.int64) * P + p[None, :]) * NW + cols[:, None],
                   mask=mp[None, :], other=0.0)


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


# -- per-head operands -----------------------------------------------------------------------
@triton.jit
def _prep(ADT, DT, TRAP, ANG, SC, PHI, CS, sa_b, sa_l, sa_h, sd_b, sd_l, sd_h, st_b, st_l, st_h,
          sg_b, sg_l, sg_h, sg_r, B, L, H, NC, R,
          T: tl.constexpr, RB: tl.constexpr, FAST: tl.constexpr):
    """One chunk of one head: a / scale / gamma, the rotation table (cos and sin of the
    in-chunk angle ell of every rotated pair, [T, 2, RB] per chunk) and phi_c."""
    h, c, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = tl.arange(0, T)
    j = tl.arange(0, RB)
    tok = c * T + t
    live = tok < L
    a, dt, gamma, scale = _chunk_scalars(ADT, DT, TRAP, b, h, c * T, L, sa_b, sa_l, sa_h,
                                         sd_b, sd_l, sd_h, st_b, st_l, st_h, T)
    row = (b * H + h) * (NC * T) + tok  # rows padded to whole chunks
    n_sc = B * H * NC * T
    tl.store(SC + row, a)
    tl.store(SC + n_sc + row, scale)
    tl.store(SC + 2 * n_sc + row, gamma)
    th = _angle_tanh(ANG, b, h, tok, live, j, R, sg_b, sg_l, sg_h, sg_r)
    ell = tl.cumsum(3.141592653589793 * th * dt[:, None], axis=0)  # [T, RB]
    tl.store(PHI + ((b * H + h) * NC + c) * RB + j,
             tl.sum(tl.where((t == T - 1)[:, None], ell, 0.0), axis=0))
    cos, sin = _cos_sin(ell, FAST)
    off = row.to(tl.int64)[:, None] * (2 * RB) + j[None, :]
    tl.store(CS + off, cos.to(CS.dtype.element_ty))
    tl.store(CS + off + RB, sin.to(CS.dtype.element_ty))


@triton.jit
def _qk_rows(b, tok, g, L, G, N):
    """Offsets [T] of the rows of a contiguous [B, L, G, N] q or k."""
    return ((b * L + tok) * G + g) * N


@triton.jit
def _chunk_qk(Q, K, QBIAS, KBIAS, CS, b, h, g, tok, row, live, L, G, N, R,
              N2B: tl.constexpr, RB: tl.constexpr, DOT: tl.constexpr, PAIRED: tl.constexpr):
    """A chunk's q and k [T, N2B], biased and rotated (even and odd halves, DOT)."""
    j = tl.arange(0, N2B)
    cos, sin = _rot_table(CS, row, j, R, RB)
    xrow = _qk_rows(b, tok, g, L, G, N)
    qb_e, qb_o = _bias_pairs(QBIAS, h, j, N, N, 1)
    q_e, q_o = _rotated(Q, xrow, live, j, 0, N, qb_e, qb_o, cos, sin, DOT, PAIRED)
    kb_e, kb_o = _bias_pairs(KBIAS, h, j, N, N, 1)
    k_e, k_o = _rotated(K, xrow, live, j, 0, N, kb_e, kb_o, cos, sin, DOT, PAIRED)
    return q_e, q_o, k_e, k_o


# -- forward ---------------------------------------------------------------------------------
@triton.jit
def _state_fwd(K, KBIAS, CS, V, SC, PHI, RESET, SIN, SFIN, sv_b, sv_l, sv_h, sv_p,
               B, L, H, G, NC, P, N, R,
               T: tl.constexpr, BP: tl.constexpr, N2B: tl.constexpr, RB: tl.constexpr,
               JB: tl.constexpr, HAS_RESET: tl.constexpr, DOT: tl.constexpr,
               FAST: tl.constexpr, PAIRED: tl.constexpr):
    """Walks one head's chunks for a tile of JB pairs: stores S_in[c], then the final state.
    S_in[c + 1] = rot(-phi_c)(decay_c S_in[c] + sum_s w_state_s x_s k_s^T)."""
    pid_j, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g = h // (H // G)
    t = tl.arange(0, T)
    p = tl.arange(0, BP)
    mp = p < P
    j = pid_j * JB + tl.arange(0, JB)
    kb_e, kb_o = _bias_pairs(KBIAS, h, j, N, N, 1)
    n_sc = B * H * NC * T
    s_e = tl.zeros([BP, JB], dtype=tl.float32)  # the state entering chunk c, in its frame
    s_o = tl.zeros([BP, JB], dtype=tl.float32)
    for c in range(NC):
        bhc = (b * H + h) * NC + c
        _store_state(SIN, bhc, p, mp, j, P, s_e, s_o, N2B)
        tok = c * T + t
        live = tok < L
        row = (b * H + h) * (NC * T) + tok
        a = tl.load(SC + row)
        scale = tl.load(SC + n_sc + row)
        seg = _segments(RESET, b, c * T, L, T, HAS_RESET)
        _carry, _to_end, w_state, decay = _weights(a, scale, seg, T)
        x = tl.load(V + _tp(b, tok, h, p, sv_b, sv_l, sv_h, sv_p),
                    mask=live[:, None] & mp[None, :], other=0.0)
        xw = tl.trans(x.to(tl.float32) * w_state[:, None])  # [BP, T]
        cos, sin = _rot_table(CS, row, j, R, RB)
        k_e, k_o = _rotated(K, _qk_rows(b, tok, g, L, G, N), live, j, pid_j * JB, N, kb_e, kb_o,
                            cos, sin, DOT, PAIRED)
        u_e = decay * s_e + _mm(xw, k_e, DOT)
        u_o = decay * s_o + _mm(xw, k_o, DOT)
        cp, sp = _cos_sin(tl.load(PHI + bhc * RB + j, mask=j < R, other=0.0), FAST)
        cp, sp = cp[None, :], sp[None, :]
        s_e, s_o = u_e * cp + u_o * sp, u_o * cp - u_e * sp
    _store_state(SFIN, b * H + h, p, mp, j, P, s_e, s_o, N2B)


@triton.jit
def _chunk_program(SC, RESET, B, L, H, NC, P, T: tl.constexpr, BP: tl.constexpr,
                   HAS_RESET: tl.constexpr, SPLIT: tl.constexpr):
    """The chunk kernels' common start, grid (H * SPLIT, C, B): the head, chunk and row, the
    chunk's tokens and [T, BP] mask, its rows of the padded per-head buffers, a / scale /
    gamma, and the document segments."""
    h, c, b = tl.program_id(0) // SPLIT, tl.program_id(1), tl.program_id(2)
    tok = c * T + tl.arange(0, T)
    p = tl.arange(0, BP)
    mask = (tok < L)[:, None] & (p < P)[None, :]
    row = (b * H + h) * (NC * T) + tok
    a, scale, gamma = _load_scalars(SC, row, B * H * NC * T)
    seg = _segments(RESET, b, c * T, L, T, HAS_RESET)
    return h, c, b, tok, p, mask, (b * H + h) * NC + c, row, a, scale, gamma, seg


@triton.jit
def _chunk_scores(q_e, q_o, k_e, k_o, a, scale, gamma, seg, T: tl.constexpr, DOT: tl.constexpr):
    """scores = (q k^T) * W [T, T] of a chunk's q, k halves; carry and w_state."""
    carry, _to_end, w_state, _decay = _weights(a, scale, seg, T)
    w, _decay_tt = _intra_weights(a, scale, gamma, seg, T)
    qk = _mm(q_e, tl.trans(k_e), DOT) + _mm(q_o, tl.trans(k_o), DOT)
    return qk * w, carry, w_state


@triton.jit
def _state_dot(X_e, X_o, S, bhc, p, mp, P, N2B: tl.constexpr, DOT: tl.constexpr):
    """X S^T [T, BP] of the [T, N2B] halves X_e, X_o and chunk ``bhc``'s state tile of S."""
    j = tl.arange(0, N2B)
    s_e = _state_t(S, bhc, p, mp, j, P, 2 * N2B)  # [N2B, BP]
    s_o = _state_t(S, bhc, p, mp, N2B + j, P, 2 * N2B)
    return _mm(X_e, s_e, DOT) + _mm(X_o, s_o, DOT)


@triton.jit
def _read_out(SIN, scores, x, q_e, q_o, carry, d_skip, bhc, p, mp, P, N2B: tl.constexpr,
              DOT: tl.constexpr):
    """y before the gate [T, BP]: intra (scores x) + carry q S_in^T + D x."""
    return (_mm(scores, x, DOT) + carry[:, None] * _state_dot(q_e, q_o, SIN, bhc, p, mp, P, N2B,
                                                              DOT)
            + d_skip * x.to(tl.float32))


@triton.jit
def _out_fwd(Q, K, QBIAS, KBIAS, CS, V, Z, Y, YP, SC, DSKIP, RESET, SIN,
             sv_b, sv_l, sv_h, sv_p, sz_b, sz_l, sz_h, sz_p, B, L, H, G, NC, P, N, R,
             T: tl.constexpr, BP: tl.constexpr, N2B: tl.constexpr, RB: tl.constexpr,
             HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_RESET: tl.constexpr,
             DOT: tl.constexpr, STORE_YP: tl.constexpr, PAIRED: tl.constexpr):
    """y of one chunk of one head: (intra + carry q S_in^T + D x) * silu(z); STORE_YP: also
    y before the gate (YP, for dz)."""
    h, _c, b, tok, p, mask, bhc, row, a, scale, gamma, seg = _chunk_program(
        SC, RESET, B, L, H, NC, P, T, BP, HAS_RESET, 1)
    q_e, q_o, k_e, k_o = _chunk_qk(Q, K, QBIAS, KBIAS, CS, b, h, h // (H // G), tok, row,
                                   tok < L, L, G, N, R, N2B, RB, DOT, PAIRED)
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


@triton.jit
def _final(SFIN, PHI, K, KBIAS, V, ANGLE, SSM, KLAST, VLAST, sv_b, sv_l, sv_h, sv_p,
           L, H, G, NC, P, N, R, BP: tl.constexpr, N2B: tl.constexpr, RB: tl.constexpr,
           CB: tl.constexpr):
    """The final state of one head (grid (H, B)) in the reference's global frame, float32: the
    angle (the chunks' phi summed in float64, mod 2 pi) [B, H, R], the last state (halves,
    last chunk's frame) rotated into it and interleaved [B, H, P, N], the last token's biased,
    rotated k [B, H, N] and its v [B, H, P]."""
    h, b = tl.program_id(0), tl.program_id(1)
    bh = b * H + h
    j = tl.arange(0, N2B)
    total = tl.zeros([N2B], dtype=tl.float64)
    for c0 in range(0, NC, CB):
        c = c0 + tl.arange(0, CB)
        phi = tl.load(PHI + (bh * NC + c[:, None]) * RB + j[None, :],
                      mask=(c < NC)[:, None] & (j < R)[None, :], other=0.0)
        total += tl.sum(phi.to(tl.float64), axis=0)
    two_pi = tl.full([], 6.283185307179586, tl.float64)  # (a bare float would be float32)
    angle = (total - two_pi * tl.floor(total / two_pi)).to(tl.float32)
    tl.store(ANGLE + bh * R + j, angle, mask=j < R)
    cos, sin = tl.cos(angle), tl.sin(angle)  # pairs >= R: angle 0
    p = tl.arange(0, BP)
    mp = p < P
    off = (bh * P + p[:, None]) * (2 * N2B) + j[None, :]
    s_e = tl.load(SFIN + off, mask=mp[:, None], other=0.0)
    s_o = tl.load(SFIN + off + N2B, mask=mp[:, None], other=0.0)
    out = (bh * P + p[:, None]) * N + 2 * j[None, :]
    tl.store(SSM + out, s_e * cos[None, :] - s_o * sin[None, :],
             mask=mp[:, None] & (2 * j < N)[None, :])
    tl.store(SSM + out + 1, s_e * sin[None, :] + s_o * cos[None, :],
             mask=mp[:, None] & (2 * j + 1 < N)[None, :])
    row = ((b * L + L - 1) * G + h // (H // G)) * N  # the last token's row of k
    kb_e, kb_o = _bias_pairs(KBIAS, h, j, N, N, 1)
    k_e = tl.load(K + row + 2 * j, mask=2 * j < N, other=0.0).to(tl.float32) + kb_e
    k_o = tl.load(K + row + 2 * j + 1, mask=2 * j + 1 < N, other=0.0).to(tl.float32) + kb_o
    tl.store(KLAST + bh * N + 2 * j, k_e * cos - k_o * sin, mask=2 * j < N)
    tl.store(KLAST + bh * N + 2 * j + 1, k_e * sin + k_o * cos, mask=2 * j + 1 < N)
    v = tl.load(V + b * sv_b + (L - 1) * sv_l + h * sv_h + p * sv_p, mask=mp, other=0.0)
    tl.store(VLAST + bh * P + p, v.to(tl.float32), mask=mp)


# -- backward --------------------------------------------------------------------------------
@triton.jit
def _state_bwd(Q, QBIAS, CS, Z, DY, SC, PHI, RESET, GST,
               sz_b, sz_l, sz_h, sz_p, sy_b, sy_l, sy_h, sy_p, B, L, H, G, NC, P, N, R,
               T: tl.constexpr, BP: tl.constexpr, N2B: tl.constexpr, RB: tl.constexpr,
               JB: tl.constexpr, HAS_Z: tl.constexpr, HAS_RESET: tl.constexpr,
               DOT: tl.constexpr, FAST: tl.constexpr, PAIRED: tl.constexpr):
    """dS[c] = dL/dS_in[c] walking backwards for a tile of JB pairs; stores
    G_c = dL/dU_c = rot(-phi_c)^T dS[c + 1]."""
    pid_j, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g = h // (H // G)
    t = tl.arange(0, T)
    p = tl.arange(0, BP)
    mp = p < P
    j = pid_j * JB + tl.arange(0, JB)
    qb_e, qb_o = _bias_pairs(QBIAS, h, j, N, N, 1)
    ds_e = tl.zeros([BP, JB], dtype=tl.float32)  # dL/dS_in[c + 1]
    ds_o = tl.zeros([BP, JB], dtype=tl.float32)
    for i in range(NC):
        c = NC - 1 - i
        bhc = (b * H + h) * NC + c
        cp, sp = _cos_sin(tl.load(PHI + bhc * RB + j, mask=j < R, other=0.0), FAST)
        cp, sp = cp[None, :], sp[None, :]
        g_e = ds_e * cp - ds_o * sp
        g_o = ds_e * sp + ds_o * cp
        _store_state(GST, bhc, p, mp, j, P, g_e, g_o, N2B)
        tok = c * T + t
        live = tok < L
        row = (b * H + h) * (NC * T) + tok
        a = tl.load(SC + row)
        seg = _segments(RESET, b, c * T, L, T, HAS_RESET)
        carry, _to_end, _w_state, decay = _weights(a, a, seg, T)  # (no scale needed)
        do, _dy, _z, _sig = _gated_grad(DY, Z, b, tok, h, p, live[:, None] & mp[None, :],
                                        sy_b, sy_l, sy_h, sy_p, sz_b, sz_l, sz_h, sz_p, HAS_Z)
        do_t = tl.trans(do * carry[:, None])  # [BP, T]
        cos, sin = _rot_table(CS, row, j, R, RB)
        q_e, q_o = _rotated(Q, _qk_rows(b, tok, g, L, G, N), live, j, pid_j * JB, N, qb_e, qb_o,
                            cos, sin, DOT, PAIRED)
        ds_e = decay * g_e + _mm(do_t, q_e, DOT)
        ds_o = decay * g_o + _mm(do_t, q_o, DOT)


@triton.jit
def _bwd_dx(Q, K, QBIAS, KBIAS, CS, V, Z, DY, SC, DSKIP, RESET, SIN, GST, YP, DV, DZ, DDP,
            sv_b, sv_l, sv_h, sv_p, sz_b, sz_l, sz_h, sz_p, sy_b, sy_l, sy_h, sy_p,
            B, L, H, G, NC, P, N, R,
            T: tl.constexpr, BP: tl.constexpr, N2B: tl.constexpr, RB: tl.constexpr,
            HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_RESET: tl.constexpr,
            DOT: tl.constexpr, LOAD_YP: tl.constexpr, PAIRED: tl.constexpr):
    """One chunk of one head: dx (intra, skip, and x's use in the chunk state), dz, dD;
    LOAD_YP: dz from the forward's y before the gate (YP) instead of forming it again."""
    h, _c, b, tok, p, mask, bhc, row, a, scale, gamma, seg = _chunk_program(
        SC, RESET, B, L, H, NC, P, T, BP, HAS_RESET, 1)
    mp = p < P
    q_e, q_o, k_e, k_o = _chunk_qk(Q, K, QBIAS, KBIAS, CS, b, h, h // (H // G), tok, row,
                                   tok < L, L, G, N, R, N2B, RB, DOT, PAIRED)
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
    dx = (_mm(tl.trans(scores), do, DOT) + d_skip * do
          + w_state[:, None] * _state_dot(k_e, k_o, GST, bhc, p, mp, P, N2B, DOT))
    tl.store(DV + out, dx.to(DV.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_tokens(DELL, DADTS, DSG, DT, TRAP, ANG, DANG, DADT, DDT, DTRAP,
                sd_b, sd_l, sd_h, st_b, st_l, st_h, sg_b, sg_l, sg_h, sg_r,
                B, L, H, NC, R, T: tl.constexpr, RB: tl.constexpr, NJD: tl.constexpr):
    """One chunk of one head (grid (H, C, B)): the per-token grads from _bwd_dqk's outputs.
    Angles: ell = cumsum over the chunk of pi tanh(angle) dt, so d(pi tanh(angle) dt) is the
    reverse cumsum of d ell (DELL, the rotated pairs); DANG [B, L, H, R]. adt: its NJD pair
    tiles' shares summed (DADTS). dt, trap: from d scale and d gamma (DSG, NJD shares each) with
    gamma = lambda dt and scale_{t-1} = gamma_{t-1} + (1 - lambda_t) dt_t (the chunk's first
    token reads the previous chunk's last d scale), plus dt's angle part. DADT, DDT, DTRAP are
    contiguous [B, L, H] in their inputs' dtypes."""
    h, c, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    tok = c * T + tl.arange(0, T)
    live = tok < L
    j = tl.arange(0, RB)
    row = (b * H + h) * (NC * T) + tok
    d_ell = tl.load(DELL + row.to(tl.int64)[:, None] * RB + j[None, :], mask=(j < R)[None, :],
                    other=0.0)
    d_rate = tl.cumsum(d_ell, axis=0, reverse=True)
    th = _angle_tanh(ANG, b, h, tok, live, j, R, sg_b, sg_l, sg_h, sg_r)
    dt = tl.load(DT + b * sd_b + tok * sd_l + h * sd_h, mask=live, other=0.0).to(tl.float32)
    tsc = (b * L + tok) * H + h  # [B, L, H] offsets of the chunk's tokens
    d_ang = d_rate * dt[:, None] * 3.141592653589793 * (1.0 - th * th)
    tl.store(DANG + tsc.to(tl.int64)[:, None] * R + j[None, :], d_ang.to(DANG.dtype.element_ty),
             mask=live[:, None] & (j < R)[None, :])

    n = B * H * NC * T  # the shares: rows of [B, H, C * T] (padded, contiguous per head)
    d_adt = tl.zeros([T], dtype=tl.float32)
    d_scale = tl.zeros([T], dtype=tl.float32)
    d_gamma = tl.zeros([T], dtype=tl.float32)
    d_prev = tl.zeros([T], dtype=tl.float32)  # d scale_{t-1}
    for jt in tl.static_range(NJD):
        d_adt += tl.load(DADTS + jt * n + row)
        d_scale += tl.load(DSG + jt * n + row)
        d_gamma += tl.load(DSG + (NJD + jt) * n + row)
        d_prev += tl.load(DSG + jt * n + row - 1, mask=tok > 0, other=0.0)
    trap = tl.load(TRAP + b * st_b + tok * st_l + h * st_h, mask=live, other=0.0)
    lam = tl.sigmoid(trap.to(tl.float32))
    d_dt = d_gamma * lam + d_prev * (1.0 - lam) + tl.sum(d_rate * 3.141592653589793 * th, axis=1)
    d_trap = (d_gamma - d_prev) * dt * lam * (1.0 - lam)
    tl.store(DADT + tsc, d_adt.to(DADT.dtype.element_ty), mask=live)
    tl.store(DDT + tsc, d_dt.to(DDT.dtype.element_ty), mask=live)
    tl.store(DTRAP + tsc, d_trap.to(DTRAP.dtype.element_ty), mask=live)


@triton.jit
def _store_unrotated(DH, DB, hrow, brow, live, j, d_e, d_o, cos, sin, N2B: tl.constexpr):
    """A head's d(q or k) [T, pairs j] rotated back to the biased, unrotated frame and stored
    at rows ``hrow`` of a halves-layout buffer (DH's dtype; contiguous runs, not 2-byte
    stores at a 4-byte stride); its sum over the chunk's tokens (the bias grad's part) at
    row ``brow`` of DB (same layout)."""
    x_e = tl.where(live[:, None], d_e * cos + d_o * sin, 0.0)
    x_o = tl.where(live[:, None], d_o * cos - d_e * sin, 0.0)
    tl.store(DB + brow + j, tl.sum(x_e, axis=0))
    tl.store(DB + brow + N2B + j, tl.sum(x_o, axis=0))
    off = hrow[:, None] + j[None, :]
    tl.store(DH + off, x_e.to(DH.dtype.element_ty), mask=live[:, None])
    tl.store(DH + off + N2B, x_o.to(DH.dtype.element_ty), mask=live[:, None])


@triton.jit
def _bwd_dqk(Q, K, QBIAS, KBIAS, CS, V, Z, DY, SC, RESET, SIN, GST,
             DQH, DKH, DQB, DKB, DELL, DADT, DSG,
             sv_b, sv_l, sv_h, sv_p, sz_b, sz_l, sz_h, sz_p, sy_b, sy_l, sy_h, sy_p,
             B, L, H, G, NC, P, N, R,
             T: tl.constexpr, BP: tl.constexpr, N2B: tl.constexpr, RB: tl.constexpr,
             HAS_Z: tl.constexpr, HAS_RESET: tl.constexpr, DOT: tl.constexpr,
             JD: tl.constexpr, PAIRED: tl.constexpr):
    """One chunk of one head, JD of its pairs (grid (H * N2B / JD, C, B): a head's pair tiles
    run next to each other and share its x, dy, z in L2, 2.10 -> 2.02 ms at L 4096 on the H100
    against tiles a grid apart; h100_s12): d(q, k) of those pairs, rotated back and stored per
    head (DQH, DKH [B, L, H, 2, N2B], halves layout, summed over a group's heads by _group_sum)
    with their sums over the chunk (DQB, DKB [B, C, H, 2, N2B]: the bias grads' parts); d ell
    of the rotated pairs (DELL, float32); the pair tile's shares of the adt grad (DADT) and of
    d scale / d gamma (DSG), [N2B / JD, ...] each. _bwd_tokens turns d ell, the shares and d
    scale / d gamma into the per-token grads. Every scalar grad is linear in sums over pairs
    (q k^T, x^T G k, q S_in^T do, <G, S_in>), so a tile's share needs its pairs only; d_qk =
    (do x^T) * W is whole in every tile. d ell comes from the float32 d(q, k) in the rotated
    frame and the state's rotation by -phi_c.
    A loop over a group's heads adding up d(q, k) in the program (no per-head copies, no
    _group_sum) spilled: 3.8 ms with 8 heads, 3.9 with 2. Split into a dq and a dk launch
    (4-16 bytes spilled offline, against 212) both took 4.3 ms, and the dq side at 4 warps was
    miscompiled on the H100 in bf16 with 64-token chunks (right at 8 warps; h100_s12)."""
    h, c, b, tok, p, mask, bhc, row, a, scale, gamma, seg = _chunk_program(
        SC, RESET, B, L, H, NC, P, T, BP, HAS_RESET, N2B // JD)
    jt = tl.program_id(0) % (N2B // JD)
    t = tl.arange(0, T)
    live = tok < L
    mp = p < P
    j = jt * JD + tl.arange(0, JD)
    carry, to_end, w_state, decay = _weights(a, scale, seg, T)
    w, decay_tt = _intra_weights(a, scale, gamma, seg, T)
    xrow = _qk_rows(b, tok, h // (H // G), L, G, N)
    cos, sin = _rot_table(CS, row, j, R, RB)
    qb_e, qb_o = _bias_pairs(QBIAS, h, j, N, N, 1)
    q_e, q_o = _rotated(Q, xrow, live, j, jt * JD, N, qb_e, qb_o, cos, sin, DOT, PAIRED)
    kb_e, kb_o = _bias_pairs(KBIAS, h, j, N, N, 1)
    k_e, k_o = _rotated(K, xrow, live, j, jt * JD, N, kb_e, kb_o, cos, sin, DOT, PAIRED)
    x = tl.load(V + _tp(b, tok, h, p, sv_b, sv_l, sv_h, sv_p), mask=mask, other=0.0)
    do, _dy, _z, _sig = _gated_grad(DY, Z, b, tok, h, p, mask, sy_b, sy_l, sy_h, sy_p,
                                    sz_b, sz_l, sz_h, sz_p, HAS_Z)
    hrow = ((b * L + tok).to(tl.int64) * H + h) * (2 * N2B)  # rows of DQH, DKH
    brow = ((b * NC + c) * H + h) * (2 * N2B)  # the bias grads' parts

    # the [T, T] work first, reduced at once to [T] vectors (d_w, W and the decays are then
    # dead: the kernel runs at the register limit)
    qk = _mm(q_e, tl.trans(k_e), DOT) + _mm(q_o, tl.trans(k_o), DOT)  # [T, T]
    d_scores = _mm(do, tl.trans(x), DOT)
    # d_qk is only a dot operand: rounded to DOT here (as _mm would) it holds half the registers
    # (sm_90 spills 136 -> 32 bytes at the step's shape, 152 -> 32 at the bench's; same results)
    d_qk = (d_scores * w).to(DOT)
    d_w = d_scores * qk
    z_dec = d_w * decay_tt
    z_w = z_dec * scale[None, :]
    dz_dec = tl.sum(z_dec, axis=0)
    dz_w = tl.sum(z_w, axis=1) - tl.sum(z_w, axis=0)
    d_gamma = tl.sum(tl.where(t[:, None] == t[None, :], d_w, 0.0), axis=1)

    # dq: intra + the carried state's read-out
    s_off = _state_offsets(bhc, p, j, P, 2 * N2B)
    s_e = tl.load(SIN + s_off, mask=mp[:, None], other=0.0)
    s_o = tl.load(SIN + s_off + N2B, mask=mp[:, None], other=0.0)
    dos_e = _mm(do, s_e, DOT)  # [T, JD]
    dos_o = _mm(do, s_o, DOT)
    dq_e = _mm(d_qk, k_e, DOT) + carry[:, None] * dos_e
    dq_o = _mm(d_qk, k_o, DOT) + carry[:, None] * dos_o
    # q_t . (do_t S_in) = do_t . (q_t S_in^T): the carried read-out's share of d a_t
    q_s = tl.sum(q_e * dos_e + q_o * dos_o, axis=1)
    d_ell = q_e * dq_o - q_o * dq_e  # d ell (the in-chunk angle) from q's rotation
    # cos, sin loaded again where they are used (fewer registers live through the products)
    _store_unrotated(DQH, DQB, hrow, brow, live, j, dq_e, dq_o, *_rot_table(CS, row, j, R, RB),
                     N2B)

    # dk: intra + k's use in the chunk state (m = x^T G per token)
    g_e = tl.load(GST + s_off, mask=mp[:, None], other=0.0)
    g_o = tl.load(GST + s_off + N2B, mask=mp[:, None], other=0.0)
    m_e = _mm(x, g_e, DOT)  # [T, JD]
    m_o = _mm(x, g_o, DOT)
    d_qk_t = tl.trans(d_qk)
    dk_e = _mm(d_qk_t, q_e, DOT) + w_state[:, None] * m_e
    dk_o = _mm(d_qk_t, q_o, DOT) + w_state[:, None] * m_o
    d_ell += k_e * dk_o - k_o * dk_e
    _store_unrotated(DKH, DKB, hrow, brow, live, j, dk_e, dk_o, *_rot_table(CS, row, j, R, RB),
                     N2B)
    mk = tl.sum(m_e * k_e + m_o * k_o, axis=1)  # x_s^T G k_s

    # the state's rotation by -phi_c (phi_c = the last token's ell): the pairwise cross terms
    # of G with U and with S_in; and <G, S_in> (the chunk decay's grad)
    g_e, g_o = g_e.to(tl.float32), g_o.to(tl.float32)
    s_e, s_o = s_e.to(tl.float32), s_o.to(tl.float32)
    d_phi = (tl.sum(w_state[:, None] * (m_e * k_o - m_o * k_e), axis=0)
             + decay * tl.sum(g_e * s_o - g_o * s_e, axis=0))
    d_ell += tl.where((t == T - 1)[:, None], d_phi[None, :], 0.0)
    d_dec = tl.sum(g_e * s_e + g_o * s_o)

    # d ell of the rotated pairs, for _bwd_tokens (the angle grads here, at the end of this
    # kernel, cost 2.39 vs 2.08 + 0.11 ms at L 4096 on the H100: more spills; h100_s11)
    tl.store(DELL + row.to(tl.int64)[:, None] * RB + j[None, :], d_ell, mask=(j < R)[None, :])
    sc = jt * (B * H * NC * T) + row  # the chunk's rows of the [B, H, C * T] shares

    # scalars: a (-> adt) here; d scale and d gamma go to _bwd_tokens (dt, trap)
    w_mk = w_state * mk
    d_scale = dz_dec + to_end * mk
    d_a = dz_w + carry * q_s - w_mk
    d_a += tl.where(t == T - 1, tl.sum(w_mk, axis=0) + d_dec * decay, 0.0)
    tl.store(DADT + sc, tl.cumsum(d_a, axis=0, reverse=True))
    tl.store(DSG + sc, d_scale)
    tl.store(DSG + (N2B // JD) * B * H * NC * T + sc, d_gamma + d_scale)


@triton.jit
def _head_sum(DH, D, base, m, out, m_out, ROWS: tl.constexpr, N2B: tl.constexpr):
    """One of _group_sum's two sums: the [ROWS, heads, 2 N2B] rows (halves layout, one load)
    summed over the heads and stored interleaved, one contiguous row each."""
    acc = tl.sum(tl.load(DH + base, mask=m, other=0.0).to(tl.float32), axis=1)
    acc = tl.reshape(tl.permute(tl.reshape(acc, [ROWS, 2, N2B]), (0, 2, 1)), [ROWS, 2 * N2B])
    tl.store(D + out, acc.to(D.dtype.element_ty), mask=m_out)


@triton.jit
def _group_sum(DQH, DKH, DQ, DK, n_rows, HG, N, ROWS: tl.constexpr, HGP: tl.constexpr,
               N2B: tl.constexpr):
    """d(q, k) of ROWS (token, group) rows: the group's HG per-head rows (halves layout,
    contiguous) summed in float32 and stored interleaved, [*, N] in DQ's / DK's dtype. Each
    head's row is loaded whole and the interleaved row stored whole (split half-rows and
    2-byte stores at a 4-byte stride ran at 1.1 TB/s at the nam56r shape, 24 heads of 64)."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    i = tl.arange(0, HGP)
    c = tl.arange(0, 2 * N2B)
    live = r < n_rows
    m = live[:, None, None] & (i < HG)[None, :, None]
    base = (r.to(tl.int64)[:, None, None] * HG + i[None, :, None]) * (2 * N2B) + c[None, None, :]
    out = r.to(tl.int64)[:, None] * N + c[None, :]
    m_out = live[:, None] & (c < N)[None, :]
    _head_sum(DQH, DQ, base, m, out, m_out, ROWS, N2B)
    _head_sum(DKH, DK, base, m, out, m_out, ROWS, N2B)


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
    RB: int  # R rotated pairs padded to a power of two (>= 16, <= N2B): the table's width
    JB: int  # pairs per program of the sequential kernels (NJ = N2B // JB tiles)
    PAIRED: bool  # N = 2 N2B: a tile's pairs are contiguous columns of q, k (one row load)


def _geometry(q: Tensor, v: Tensor, angles: Tensor, chunk_size: int) -> _Geometry:
    B, L, H, P = v.shape
    G, N, R = q.shape[2], q.shape[3], angles.shape[-1]
    if chunk_size not in CHUNK_SIZES:
        raise MegaCppError(f"mamba3_scan triton: chunk_size must be one of {CHUNK_SIZES}, "
                           f"got {chunk_size} (use the reference for other chunk sizes)")
    if P > MAX_HEADDIM or N > MAX_D_STATE:
        raise MegaCppError(f"mamba3_scan triton: needs headdim <= {MAX_HEADDIM} and d_state <= "
                           f"{MAX_D_STATE}, got {P} and {N} (use the reference)")
    N2B = max(16, next_power_of_2((N + 1) // 2))
    RB = max(16, next_power_of_2(R))  # R <= N // 2, so RB <= N2B
    T = min(chunk_size, TUNING["max_chunk"])  # any chunking computes the same function
    if v.dtype == torch.float32:
        T = min(T, 32)  # float32 operands of 64-token chunks overflow shared memory
    NC = cdiv(L, T)
    BP = max(16, next_power_of_2(P), TUNING["min_bp"] if T == 64 else 16)
    if max(v.numel(), angles.numel(), B * L * H * N, B * H * NC * BP * 2 * N2B) >= 2**31:
        raise MegaCppError("mamba3_scan triton: tensors of 2**31 elements or more are not "
                           "supported (32-bit offsets); split the batch")
    sms = sm_count(v.device) if v.is_cuda else 1
    return _Geometry(B, L, H, G, P, N, R, T, NC, BP, N2B, RB, _state_pairs(B * H, N2B, sms),
                     N == 2 * N2B)


def _state_pairs(heads: int, n2b: int, sms: int) -> int:
    """Pairs per program of the sequential state kernels (grid N2B / pairs x B * H) on a device
    of ``sms`` multiprocessors."""
    pairs = min(n2b, TUNING["pairs"])
    while pairs > 16 and heads * (n2b // pairs) < TUNING["min_state_programs_per_sm"] * sms:
        pairs //= 2
    return pairs


def _launch(kernel: str, geo: _Geometry) -> dict[str, int]:
    """Triton launch options of ``kernel`` for this geometry (``TUNING``)."""
    options = TUNING["launch"][kernel]
    if geo.N2B <= 32:
        options = {**options, **TUNING["narrow_launch"].get(kernel, {})}
    return {k: v for k, v in options.items() if v is not None}


def _precision(v: Tensor) -> tuple[torch.dtype, tl.dtype, bool]:
    """(rotation table dtype, matmul operand dtype, fast trig): float32 with accurate trig for
    float32 v; else float16 cos / sin (11 bits, finer than the bf16 operands they rotate),
    bf16 products and the hardware sin/cos (not in the CPU interpreter)."""
    if v.dtype == torch.float32:
        return torch.float32, tl.float32, False
    return torch.float16, tl.bfloat16, v.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"


def _operand_dtype(v: Tensor) -> torch.dtype:
    """Storage of the chunk states and the per-head d(q, k): the matmul operand dtype."""
    return torch.float32 if v.dtype == torch.float32 else torch.bfloat16


def _strides(t: Tensor | None, ndim: int) -> tuple[int, ...]:
    return tuple(t.stride()) if t is not None else (0,) * ndim


class _Operands(NamedTuple):
    """What _prep writes: the rotation table, a / scale / gamma, phi."""

    cs: Tensor  # [B, H, NC * T, 2, RB] cos, sin of the in-chunk angle (float16; float32)
    sc: Tensor  # [3, B, H, NC * T] float32
    phi: Tensor  # [B, H, NC, RB] float32


def _prep_operands(geo: _Geometry, args: tuple, st: dict, cs_dtype: torch.dtype,
                   fast: bool) -> _Operands:
    adt, dt, trap, angles = args[3:7]
    B, H, T, NC, RB = geo.B, geo.H, geo.T, geo.NC, geo.RB
    dev = adt.device
    cs = torch.empty(B, H, NC * T, 2, RB, device=dev, dtype=cs_dtype)
    sc = torch.empty(3, B, H, NC * T, device=dev, dtype=torch.float32)
    phi = torch.empty(B, H, NC, RB, device=dev, dtype=torch.float32)
    _prep[(H, NC, B)](
        adt, dt, trap, angles, sc, phi, cs, *st["adt"], *st["dt"], *st["trap"], *st["ang"],
        B, geo.L, H, NC, geo.R, T=T, RB=RB, FAST=fast, **_launch("prep", geo))
    return _Operands(cs, sc, phi)


def _common_strides(v, z, adt, dt, trap, angles) -> dict[str, tuple]:
    return {"v": _strides(v, 4), "z": _strides(z, 4), "adt": _strides(adt, 3),
            "dt": _strides(dt, 3), "trap": _strides(trap, 3), "ang": _strides(angles, 4)}


def _final_state(geo: _Geometry, k: Tensor, v: Tensor, k_bias: Tensor, s_fin: Tensor,
                 phi: Tensor) -> Mamba3ScanState:
    """The reference's final state in its global frame (angle mod 2 pi), without gradient."""
    B, H, P, N, R = geo.B, geo.H, geo.P, geo.N, geo.R
    f32 = {"device": v.device, "dtype": torch.float32}
    state = Mamba3ScanState(torch.empty(B, H, R, **f32), torch.empty(B, H, P, N, **f32),
                            torch.empty(B, H, N, **f32), torch.empty(B, H, P, **f32))
    _final[(H, B)](s_fin, phi, k, k_bias, v, *state.tensors(), *v.stride(), geo.L, H, geo.G, geo.NC, P,
                   N, R, BP=geo.BP, N2B=geo.N2B, RB=geo.RB, CB=TUNING["final_chunks"],
                   **_launch("final", geo))
    return state


def _qk_args(args: tuple, ops: _Operands) -> tuple:
    """q, k, q_bias, k_bias (contiguous) and the rotation table: what every kernel that
    rotates q or k reads."""
    q, k, q_bias, k_bias = args[0], args[1], args[7], args[8]
    return q, k, q_bias, k_bias, ops.cs


def _forward(geo: _Geometry, args: tuple, st: dict, ops: _Operands, dot,
             fast: bool) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """_state_fwd then _out_fwd: y, S_in, the final state [B, H, P, 2, N2B], and y before the
    gate (``TUNING["save_y_pre"]`` with z, else None)."""
    _q, k, v, D, z, rst = args[0], args[1], args[2], args[9], args[10], args[11]
    B, L, H, G, P, N, R, T, NC = geo[:9]
    dev = v.device
    dims = (B, L, H, G, NC, P, N, R)
    const = {"T": T, "BP": geo.BP, "N2B": geo.N2B, "RB": geo.RB, "HAS_RESET": rst is not None,
             "DOT": dot, "PAIRED": geo.PAIRED}
    s_in = torch.empty(B, H, NC, P, 2, geo.N2B, device=dev, dtype=_operand_dtype(v))
    s_fin = torch.empty(B, H, P, 2, geo.N2B, device=dev, dtype=torch.float32)
    _state_fwd[(geo.N2B // geo.JB, H, B)](
        k, args[8], ops.cs, v, ops.sc, ops.phi, rst, s_in, s_fin, *st["v"], *dims,
        JB=geo.JB, FAST=fast, **const, **_launch("state_fwd", geo))
    y = torch.empty(B, L, H, P, device=dev, dtype=v.dtype)
    y_pre = torch.empty_like(y) if z is not None and TUNING["save_y_pre"] else None
    _out_fwd[(H, NC, B)](
        *_qk_args(args, ops), v, z, y, y_pre, ops.sc, D, rst, s_in, *st["v"], *st["z"], *dims,
        HAS_D=D is not None, HAS_Z=z is not None, STORE_YP=y_pre is not None, **const,
        **_launch("out_fwd", geo))
    return y, s_in, s_fin, y_pre


def _backward(geo: _Geometry, args: tuple, st: dict, ops: _Operands, dy: Tensor,
              s_in: Tensor, y_pre: Tensor | None, dot, fast: bool) -> tuple:
    """_state_bwd, _bwd_dx, _bwd_dqk; the input grads."""
    q, k, v, adt, dt, trap, angles, q_bias, k_bias, D, z, rst = args
    B, L, H, G, P, N, R, T, NC = geo[:9]
    dev = v.device
    f32 = {"device": dev, "dtype": torch.float32}
    dims = (B, L, H, G, NC, P, N, R)
    const = {"T": T, "BP": geo.BP, "N2B": geo.N2B, "RB": geo.RB, "HAS_Z": z is not None,
             "HAS_RESET": rst is not None, "DOT": dot, "PAIRED": geo.PAIRED}
    strides = (*st["v"], *st["z"], *dy.stride())
    g_st = torch.empty_like(s_in)
    _state_bwd[(geo.N2B // geo.JB, H, B)](
        q, q_bias, ops.cs, z, dy, ops.sc, ops.phi, rst, g_st, *st["z"], *dy.stride(), *dims,
        JB=geo.JB, FAST=fast, **const, **_launch("state_bwd", geo))

    dv = torch.empty(B, L, H, P, device=dev, dtype=v.dtype)
    dz = torch.empty(B, L, H, P, device=dev, dtype=z.dtype) if z is not None else None
    dd_part = torch.empty(B, H, NC, **f32)
    _bwd_dx[(H, NC, B)](
        *_qk_args(args, ops), v, z, dy, ops.sc, D, rst, s_in, g_st, y_pre, dv, dz, dd_part,
        *strides, *dims, HAS_D=D is not None, LOAD_YP=y_pre is not None, **const,
        **_launch("bwd_dx", geo))

    # d(q, k) per head, unrotated, in the operand dtype (summed over the group's heads below)
    dqh = torch.empty(B, L, H, 2 * geo.N2B, device=dev, dtype=_operand_dtype(v))
    dkh = torch.empty_like(dqh)
    dqb_part = torch.empty(B, NC, H, 2 * geo.N2B, **f32)
    dkb_part = torch.empty_like(dqb_part)
    dang = torch.empty(B, L, H, R, device=dev, dtype=angles.dtype)
    jd = min(geo.N2B, TUNING["dqk_pairs"])
    njd = geo.N2B // jd
    d_ell = torch.empty(B, H, NC * T, geo.RB, **f32)
    dadt_part = torch.empty(njd, B, H, NC * T, **f32)  # shares of _bwd_dqk's pair tiles
    d_sg = torch.empty(2, njd, B, H, NC * T, **f32)  # d scale, d gamma
    _bwd_dqk[(H * njd, NC, B)](
        *_qk_args(args, ops), v, z, dy, ops.sc, rst, s_in, g_st, dqh, dkh, dqb_part, dkb_part,
        d_ell, dadt_part, d_sg, *strides, *dims, JD=jd, **const, **_launch("bwd_dqk", geo))
    dadt = torch.empty(B, L, H, device=dev, dtype=adt.dtype)
    ddt = torch.empty(B, L, H, device=dev, dtype=dt.dtype)
    dtrap = torch.empty(B, L, H, device=dev, dtype=trap.dtype)
    _bwd_tokens[(H, NC, B)](
        d_ell, dadt_part, d_sg, dt, trap, angles, dang, dadt, ddt, dtrap, *st["dt"],
        *st["trap"], *st["ang"], B, L, H, NC, R, T=T, RB=geo.RB, NJD=njd,
        **_launch("bwd_tokens", geo))
    dD = dd_part.sum((0, 2)).to(D.dtype) if D is not None else None

    def interleaved(d: Tensor, like: Tensor) -> Tensor:  # [..., 2, N2B] -> [..., N]
        d = d.unflatten(-1, (2, geo.N2B)).transpose(-1, -2).flatten(-2)
        return d[..., :N].to(like.dtype)

    # d(q, k): each group's heads summed (in float32), the halves interleaved
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    rows = B * L * G
    _group_sum[(cdiv(rows, TUNING["sum_rows"]),)](
        dqh, dkh, dq, dk, rows, H // G, N, ROWS=TUNING["sum_rows"],
        HGP=next_power_of_2(H // G), N2B=geo.N2B, **_launch("group_sum", geo))
    dqb, dkb = (sum_rows(part.flatten(0, 1).flatten(1)).view(H, 2 * geo.N2B)
                for part in (dqb_part, dkb_part))  # [B, C, H, 2 N2B] summed over (B, C)
    return (dq, dk, dv, dadt, ddt, dtrap, interleaved(dqb, q_bias), interleaved(dkb, k_bias),
            dang, dD, dz, None, None)


class _Mamba3ScanFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, reset, chunk_size,
                output_final_state):
        geo = _geometry(q, v, angles, chunk_size)
        cs_dtype, dot, fast = _precision(v)
        rst = reset.to(torch.int8).contiguous() if reset is not None else None
        q, k, q_bias, k_bias = (t.contiguous() for t in (q, k, q_bias, k_bias))
        st = _common_strides(v, z, adt, dt, trap, angles)
        args = (q, k, v, adt, dt, trap, angles, q_bias, k_bias, D, z, rst)
        ops = _prep_operands(geo, args, st, cs_dtype, fast)
        y, s_in, s_fin, y_pre = _forward(geo, args, st, ops, dot, fast)
        ctx.save_for_backward(q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, rst, s_in,
                              y_pre, *ops)
        ctx.geo = geo
        if not output_final_state:
            return y
        final = _final_state(geo, k, v, k_bias, s_fin, ops.phi)
        ctx.mark_non_differentiable(*final.tensors())
        return (y, *final.tensors())

    @staticmethod
    def backward(ctx, dy, *_state_grads):
        q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, rst, s_in, y_pre, *ops = (
            ctx.saved_tensors)
        _cs_dtype, dot, fast = _precision(v)
        st = _common_strides(v, z, adt, dt, trap, angles)
        args = (q, k, v, adt, dt, trap, angles, q_bias, k_bias, D, z, rst)
        return (*_backward(ctx.geo, args, st, _Operands(*ops), dy, s_in, y_pre, dot, fast), None)


def mamba3_scan_triton(
    q: Tensor, k: Tensor, v: Tensor, adt: Tensor, dt: Tensor, trap: Tensor,
    q_bias: Tensor, k_bias: Tensor, angles: Tensor,
    D: Tensor | None = None, z: Tensor | None = None, reset: Tensor | None = None,
    initial_state: Mamba3ScanState | None = None, chunk_size: int = 64,
    output_final_state: bool = True,
) -> tuple[Tensor, Mamba3ScanState | None]:
    """The chunked Mamba-3 SISO scan on the GPU (arguments as :func:`mamba3_scan_chunked`).

    Returns y [B, L, H, P] in v.dtype and the final state (float32, no gradient), or None for
    it with ``output_final_state=False`` (``_final`` is then not launched).
    ``initial_state`` is not supported (a cached prefill must call the reference); neither
    is float64 (the reference is the float64 path).
    """
    _check_inputs(q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, reset)
    if initial_state is not None:
        raise MegaCppError("mamba3_scan triton: initial_state is not supported; a prefill that "
                           "continues a cache runs the reference (mamba3_scan_chunked)")
    if v.dtype == torch.float64:
        raise MegaCppError("mamba3_scan triton: float64 is not supported (use the reference)")
    if not output_final_state:
        return _Mamba3ScanFn.apply(q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, reset,
                                   chunk_size, False), None
    y, *final = _Mamba3ScanFn.apply(q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z,
                                    reset, chunk_size, True)
    return y, Mamba3ScanState(*final)
