"""The gated delta rule's forward kernels (the math and the launch: ``op.py``)."""

from __future__ import annotations

import triton
import triton.language as tl

from megacpp.kernels.ops.gated_delta.common import (
    _cast,
    _chunk_start,
    _decays,
    _dot,
    _loop_count,
    _pair,
    _state_loads,
    _state_tile,
    _tile,
    _tile_t,
)


@triton.jit
def _unit_lower_inverse(A, BT: tl.constexpr, MODE: tl.constexpr):
    """(I + A)^-1 for a strictly lower-triangular [BT, BT] A (BT a power of two <= 128), by
    doubling the side of the inverted diagonal blocks: with T the inverse of the blocks of
    side s / 2 and E the part of A in the lower-left quadrants of the blocks of side s,
    (D + E)^-1 = (I - T E) T = T - T E T ((T E)^2 = 0). Side 2 needs no product (T = I - E);
    sides 4 .. BT take two [BT, BT] products each. Every product only fills a quadrant T
    holds zeros in: nothing cancels (the block forward substitution of the textbook)."""
    rows = tl.arange(0, BT)[:, None]
    cols = tl.arange(0, BT)[None, :]
    tm = tl.where(rows == cols, 1.0, 0.0) - tl.where((rows >> 1) == (cols >> 1), A, 0.0)
    for lvl in tl.static_range(2, 8):  # blocks of side 2**lvl
        if (1 << lvl) <= BT:
            quad = ((rows >> lvl) == (cols >> lvl)) & ((rows >> (lvl - 1)) != (cols >> (lvl - 1)))
            tm = tm - _dot(_dot(tm, tl.where(quad, A, 0.0), MODE), tm, MODE)
    return tm


@triton.jit
def _fwd_intra(K_, V_, G, BETA, RST, W, U, TM, DIN, DOUT, GAM, L, N, H: tl.constexpr,
               DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               BT: tl.constexpr, HAS_RESET: tl.constexpr,
               MODE: tl.constexpr, SOLVE: tl.constexpr):
    n, bh = tl.program_id(0), tl.program_id(1)
    h, valid, gc, seg, beta, row, rows, chunk = _chunk_start(G, BETA, RST, n, bh, L, N, H, BT,
                                                             HAS_RESET)
    decay_in, decay_out, gamma = _decays(gc, seg, BT)
    gate_off = chunk * BT + rows  # [BH, N * BT] per-token gates
    tl.store(DIN + gate_off, decay_in)
    tl.store(DOUT + gate_off, decay_out)
    tl.store(GAM + chunk, gamma)

    k_ptrs, k_mask = _tile(K_, row, valid, 0, DK, BK, H, h)
    k = tl.load(k_ptrs, mask=k_mask, other=0.0)  # [BT, BK]
    kk = _dot(k, tl.trans(k), MODE)  # [BT, BT]
    a = beta[:, None] * _pair(gc, seg, BT, True) * kk
    tm = _unit_lower_inverse(a, BT, SOLVE)  # T = (I + A)^-1 (never bfloat16 products)

    w = _dot(tm, k.to(tl.float32) * (beta * decay_in)[:, None], MODE)  # [BT, BK]
    w_ptrs, _ = _tile(W, row, valid, 0, DK, BK, H, h)
    tl.store(w_ptrs, _cast(w, W, MODE), mask=k_mask)
    for v0 in range(0, DV, BV):
        v_ptrs, v_mask = _tile(V_, row, valid, v0, DV, BV, H, h)
        v = tl.load(v_ptrs, mask=v_mask, other=0.0).to(tl.float32)
        u_ptrs, _u_mask = _tile(U, row, valid, v0, DV, BV, H, h)
        tl.store(u_ptrs, _cast(_dot(tm, v * beta[:, None], MODE), U, MODE), mask=v_mask)

    t_base = chunk * BT * BT
    tl.store(TM + t_base + rows[:, None] * BT + rows[None, :], _cast(tm, TM, MODE))


@triton.jit
def _fwd_state(K_, W, U, DOUT, GAM, H0, HS, VN, HT, L, N, H: tl.constexpr,
               DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               BT: tl.constexpr, HAS_RESET: tl.constexpr, HAS_H0: tl.constexpr,
               STORE_HT: tl.constexpr, MODE: tl.constexpr, N_CONST: tl.constexpr):
    vb, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    v0 = vb * BV
    rows = tl.arange(0, BT)
    s_ptrs, s_mask = _state_tile(H0, bh.to(tl.int64) * DK * DV, 0, v0, DK, DV, BK, BV)
    if HAS_H0:
        state = tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32)  # [BK, BV]
    else:
        state = tl.zeros([BK, BV], dtype=tl.float32)
    for n in range(_loop_count(N, N_CONST)):
        # the loads that feed no product, in their own chunk: issued a chunk ahead by hand,
        # the loop carry's register moves waited for them (ncu, H100, nam56r 4k: 18% of the
        # stall samples on one move) and the prefetch cost 85.9 vs 73.6 us
        u, decay_out, gamma = _state_loads(U, DOUT, GAM, b, bh, n, v0, L, N, H, DV, BV, BT)
        hs_ptrs, _ = _state_tile(HS, (bh.to(tl.int64) * N + n) * DK * DV, 0, v0, DK, DV, BK, BV)
        tl.store(hs_ptrs, _cast(state, HS, MODE), mask=s_mask)
        t = n * BT + rows
        valid = t < L
        row = b.to(tl.int64) * L + t
        kt_ptrs, kt_mask = _tile_t(K_, row, valid, 0, DK, BK, H, h)
        w_ptrs, k_mask = _tile(W, row, valid, 0, DK, BK, H, h)
        v_mask = valid[:, None] & ((v0 + tl.arange(0, BV))[None, :] < DV)
        k_t = tl.load(kt_ptrs, mask=kt_mask, other=0.0)  # k^T [BK, BT]
        w = tl.load(w_ptrs, mask=k_mask, other=0.0)
        v_new = u - _dot(w, state.to(w.dtype), MODE)  # [BT, BV]; bf16 S costs ~nothing here
        vn_ptrs, _ = _tile(VN, row, valid, v0, DV, BV, H, h)
        tl.store(vn_ptrs, _cast(v_new, VN, MODE), mask=v_mask)
        # (decay_out * k)^T v_new with the decay on v_new's rows: k^T enters as loaded
        state = state * gamma + _dot(k_t, v_new * decay_out[:, None], MODE)
    if STORE_HT:
        ht_ptrs, _ = _state_tile(HT, bh.to(tl.int64) * DK * DV, 0, v0, DK, DV, BK, BV)
        tl.store(ht_ptrs, state, mask=s_mask)


@triton.jit
def _fwd_out(Q, K_, G, BETA, RST, HS, VN, O, L, N, scale, H: tl.constexpr, DK: tl.constexpr,
             DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
             HAS_RESET: tl.constexpr, MODE: tl.constexpr):
    n, bh = tl.program_id(0), tl.program_id(1)
    h, valid, gc, seg, _, row, _, chunk = _chunk_start(G, BETA, RST, n, bh, L, N, H, BT,
                                                       HAS_RESET)
    decay_in, _, _ = _decays(gc, seg, BT)
    q_ptrs, k_mask = _tile(Q, row, valid, 0, DK, BK, H, h)
    k_ptrs, _ = _tile(K_, row, valid, 0, DK, BK, H, h)
    q = tl.load(q_ptrs, mask=k_mask, other=0.0)
    k = tl.load(k_ptrs, mask=k_mask, other=0.0)
    p = _dot(q, tl.trans(k), MODE) * scale * _pair(gc, seg, BT, False)  # [BT, BT]
    for v0 in range(0, DV, BV):
        hs_ptrs, s_mask = _state_tile(HS, chunk * DK * DV, 0, v0, DK, DV, BK, BV)
        state = tl.load(hs_ptrs, mask=s_mask, other=0.0)
        vn_ptrs, v_mask = _tile(VN, row, valid, v0, DV, BV, H, h)
        v_new = tl.load(vn_ptrs, mask=v_mask, other=0.0)
        # (scale * decay_in * q) S, the row scale after the product (q, S both as stored)
        o = _dot(q, state, MODE) * (scale * decay_in)[:, None] + _dot(p, v_new, MODE)
        o_ptrs, _o_mask = _tile(O, row, valid, v0, DV, BV, H, h)
        tl.store(o_ptrs, _cast(o, O, MODE), mask=v_mask)
