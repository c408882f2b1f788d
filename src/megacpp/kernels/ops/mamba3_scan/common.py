"""Pieces every Mamba-3 scan kernel shares: products, trig, a chunk's scalars, segments and
decay weights, the rotated q / k of a chunk (halves layout, rotation table), the chunk-state
tiles. The layout and the math: ``op.py``."""

from __future__ import annotations

import triton
import triton.language as tl


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
    columns (a _prep that loaded q / k with 32-pair tiles on an H100: 1.7 ms strided, 0.88
    split)."""
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
