"""The Mamba-3 scan's backward kernels: the reverse state pass, dx / dz / dD, d(q, k) per pair
tile, the per-token grads and each group's head sum (the layout and the launch: ``op.py``)."""

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
    _intra_weights,
    _mm,
    _qk_rows,
    _rot_table,
    _rotated,
    _segments,
    _state_dot,
    _state_offsets,
    _store_state,
    _tp,
    _weights,
)


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
            DOT: tl.constexpr, PAIRED: tl.constexpr):
    """One chunk of one head: dx (intra, skip, and x's use in the chunk state), dz (from the
    forward's y before the gate, YP), dD."""
    h, _c, b, tok, p, mask, bhc, row, a, scale, gamma, seg = _chunk_program(
        SC, RESET, B, L, H, NC, P, T, BP, HAS_RESET, 1)
    mp = p < P
    q_e, q_o, k_e, k_o = _chunk_qk(Q, K, QBIAS, KBIAS, CS, b, h, h // (H // G), tok, row,
                                   tok < L, L, G, N, R, N2B, RB, DOT, PAIRED)
    scores, _carry, w_state = _chunk_scores(q_e, q_o, k_e, k_o, a, scale, gamma, seg, T, DOT)
    x = tl.load(V + _tp(b, tok, h, p, sv_b, sv_l, sv_h, sv_p), mask=mask, other=0.0)
    do, dy, z, sig = _gated_grad(DY, Z, b, tok, h, p, mask, sy_b, sy_l, sy_h, sy_p,
                                 sz_b, sz_l, sz_h, sz_p, HAS_Z)
    d_skip = 0.0
    if HAS_D:
        d_skip = tl.load(DSKIP + h).to(tl.float32)
        tl.store(DDP + bhc, tl.sum(do * x.to(tl.float32)))
    out = ((b * L + tok[:, None]).to(tl.int64) * H + h) * P + p[None, :]
    if HAS_Z:
        y_pre = tl.load(YP + out, mask=mask, other=0.0).to(tl.float32)
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
    run next to each other and share its x, dy, z in L2, 2.02 ms at L 4096 on the H100
    against 2.10 with tiles a grid apart): d(q, k) of those pairs, rotated back and stored per
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
    miscompiled on the H100 in bf16 with 64-token chunks (right at 8 warps)."""
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
    # kernel, cost 2.39 vs 2.08 + 0.11 ms at L 4096 on the H100: more spills)
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
