"""The Mamba-3 scan's forward kernels: the per-head operands (``_prep``), the chunk-state
pass, the output, the final state (the layout and the launch: ``op.py``)."""

from __future__ import annotations

import triton
import triton.language as tl

from megacpp.kernels.ops.mamba3_scan.common import (
    _angle_tanh,
    _bias_pairs,
    _chunk_program,
    _chunk_qk,
    _chunk_scores,
    _cos_sin,
    _mm,
    _qk_rows,
    _rot_table,
    _rotated,
    _segments,
    _state_dot,
    _store_state,
    _tp,
    _weights,
)


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
             DOT: tl.constexpr, PAIRED: tl.constexpr):
    """y of one chunk of one head: (intra + carry q S_in^T + D x) * silu(z); with z, also y
    before the gate (YP, for dz)."""
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
