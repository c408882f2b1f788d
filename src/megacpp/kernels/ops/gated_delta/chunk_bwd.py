"""The gated delta rule's backward kernels (the math and the launch: ``op.py``)."""

from __future__ import annotations

import triton
import triton.language as tl

from megacpp.kernels.ops.gated_delta.common import (
    _cast,
    _chunk_start,
    _decays,
    _dot,
    _gates,
    _loop_count,
    _pair,
    _state_loads,
    _state_tile,
    _tile,
    _tile_t,
)


@triton.jit
def _bwd_dv_local(Q, K_, G, BETA, RST, DO, DVN, L, scale, H: tl.constexpr, DK: tl.constexpr,
                  DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
                  HAS_RESET: tl.constexpr, MODE: tl.constexpr):
    n, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    t, valid, gc, seg, _ = _gates(G, BETA, RST, b, h, n, L, H, BT, HAS_RESET)
    row = b.to(tl.int64) * L + t
    q_ptrs, k_mask = _tile(Q, row, valid, 0, DK, BK, H, h)
    k_ptrs, _ = _tile(K_, row, valid, 0, DK, BK, H, h)
    q = tl.load(q_ptrs, mask=k_mask, other=0.0)
    k = tl.load(k_ptrs, mask=k_mask, other=0.0)
    p_t = _dot(k, tl.trans(q), MODE) * scale * tl.trans(_pair(gc, seg, BT, False))  # P^T
    for v0 in range(0, DV, BV):
        do_ptrs, v_mask = _tile(DO, row, valid, v0, DV, BV, H, h)
        do = tl.load(do_ptrs, mask=v_mask, other=0.0)
        dvn_ptrs, _dvn_mask = _tile(DVN, row, valid, v0, DV, BV, H, h)
        tl.store(dvn_ptrs, _cast(_dot(p_t, do, MODE), DVN, MODE), mask=v_mask)


@triton.jit
def _bwd_state(Q, K_, W, DIN, DOUT, GAM, DO, DVN, DHT, DHS, DH0, L, N, scale,
               H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
               BV: tl.constexpr, BT: tl.constexpr, HAS_RESET: tl.constexpr,
               HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, MODE: tl.constexpr,
               N_CONST: tl.constexpr, PREFETCH: tl.constexpr = 1):
    vb, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    v0 = vb * BV
    rows = tl.arange(0, BT)
    s_ptrs, s_mask = _state_tile(DHT, bh.to(tl.int64) * DK * DV, 0, v0, DK, DV, BK, BV)
    if HAS_DHT:
        dstate = tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32)
    else:
        dstate = tl.zeros([BK, BV], dtype=tl.float32)
    # the loads that feed no product (do, dL/dv_new's local part, the decays): PREFETCH issues
    # them a chunk ahead by hand, else each chunk loads its own (as _fwd_state does). In ncu on
    # the H100 its own chunk was faster (106.0 -> 88.6 us at nam56r 4k, 401 -> 391 at H16), but
    # Triton then pipelines these loads through shared memory too (263 KB at K = 128 in float32,
    # over the 227 KB limit). Own chunk is used for bf16 products in the small-grid launch
    # (nam56r; four runs bit-identical). The BV 64 launch keeps the prefetch (own-chunk loads
    # were not measured there since _bwd_key's race was fixed; configs.py). Float32 products
    # (MODE 0) always prefetch, and so does a setting without the switch
    if PREFETCH or MODE == 0:
        do_next, din_next, gam_next = _state_loads(DO, DIN, GAM, b, bh, N - 1, v0, L, N, H, DV,
                                                   BV, BT)
        dvn_next, dout_next, _g = _state_loads(DVN, DOUT, GAM, b, bh, N - 1, v0, L, N, H, DV, BV,
                                              BT)
    for i in range(_loop_count(N, N_CONST)):
        n = N - 1 - i
        if PREFETCH or MODE == 0:
            do, decay_in, gamma = do_next, din_next, gam_next
            dv_new, decay_out = dvn_next, dout_next
            do_next, din_next, gam_next = _state_loads(DO, DIN, GAM, b, bh, tl.maximum(n - 1, 0),
                                                       v0, L, N, H, DV, BV, BT)
            dvn_next, dout_next, _g = _state_loads(DVN, DOUT, GAM, b, bh, tl.maximum(n - 1, 0),
                                                  v0, L, N, H, DV, BV, BT)
        else:
            do, decay_in, gamma = _state_loads(DO, DIN, GAM, b, bh, n, v0, L, N, H, DV, BV, BT)
            dv_new, decay_out, _g = _state_loads(DVN, DOUT, GAM, b, bh, n, v0, L, N, H, DV, BV,
                                                 BT)
        dhs_ptrs, _ = _state_tile(DHS, (bh.to(tl.int64) * N + n) * DK * DV, 0, v0, DK, DV,
                                  BK, BV)
        tl.store(dhs_ptrs, _cast(dstate, DHS, MODE), mask=s_mask)  # dL/d(S leaving n)
        t = n * BT + rows
        valid = t < L
        row = b.to(tl.int64) * L + t
        # q^T and w^T enter the products as loaded; the decays scale rows of [BT, BV] tiles
        qt_ptrs, kt_mask = _tile_t(Q, row, valid, 0, DK, BK, H, h)
        wt_ptrs, _ = _tile_t(W, row, valid, 0, DK, BK, H, h)
        k_ptrs, k_mask = _tile(K_, row, valid, 0, DK, BK, H, h)
        dvn_ptrs, v_mask = _tile(DVN, row, valid, v0, DV, BV, H, h)
        q_t = tl.load(qt_ptrs, mask=kt_mask, other=0.0)
        w_t = tl.load(wt_ptrs, mask=kt_mask, other=0.0)
        k = tl.load(k_ptrs, mask=k_mask, other=0.0)
        dv_new = dv_new.to(tl.float32) + _dot(k, dstate, MODE) * decay_out[:, None]  # [BT, BV]
        tl.store(dvn_ptrs, _cast(dv_new, DVN, MODE), mask=v_mask)
        # (scale * decay_in * q)^T do - w^T dv_new
        dstate = (dstate * gamma + _dot(q_t, do.to(tl.float32) * (scale * decay_in)[:, None], MODE)
                  - _dot(w_t, dv_new, MODE))
    if STORE_DH0:
        dh0_ptrs, _ = _state_tile(DH0, bh.to(tl.int64) * DK * DV, 0, v0, DK, DV, BK, BV)
        tl.store(dh0_ptrs, dstate, mask=s_mask)


# The backward after the state pass, in three kernels with little live state each (one kernel
# doing all of it ran at 255 registers with 176 spilled on the H100, 1.1-1.2x slower end to
# end). Per chunk, DQK [BT, BT] holds d_qk = dL/dP masked (bfloat16 for bfloat16 inputs:
# only bf16 products read it), scratch SCR [NS = 1 + NKB, BT, BT] float32 the u part of dL/dA
# (slot 0) and the w part of dL/dA per K slice (slots 1..); VEC [NKB, 2, BT] the per-K-slice
# row sums for d_beta and d_gc; DKP [B, L, H, K] dk before its dL/dA term (in q's dtype for
# bfloat16 inputs, else float32). The partials are summed in a fixed order (no
# atomics). Transposes of computed [BT, BT] matrices are loads of those tiles with transposed
# pointers, or (_bwd_fin) tl.trans of a sum of loaded tiles: no tl.trans of a matmul result
# feeds a matmul (Triton 3.4-3.7.0 miscompiles that on Hopper, fla issue 640).
@triton.jit
def _bwd_val(V_, G, BETA, RST, TM, VN, DO, DVN, DQK, SCR, DV_, DB, L, N, H: tl.constexpr,
             DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
             BT: tl.constexpr, HAS_RESET: tl.constexpr, MODE: tl.constexpr, NS: tl.constexpr):
    """The value side of one chunk (a V loop, no [BT, K] accumulators): dv, d_qk = dL/dP
    masked (DQK), the u part of dL/dA, -(T^T du) u^T (scratch slot 0), and d_beta's value
    part, rowsum(T^T du * v), stored in DB for _bwd_fin to add to."""
    n, bh = tl.program_id(0), tl.program_id(1)
    h, valid, gc, seg, beta, row, rows, chunk = _chunk_start(G, BETA, RST, n, bh, L, N, H, BT,
                                                             HAS_RESET)
    tm_t = tl.load(TM + chunk * BT * BT + rows[None, :] * BT + rows[:, None])  # T^T

    d_p = tl.zeros([BT, BT], dtype=tl.float32)  # dL/dP
    x = tl.zeros([BT, BT], dtype=tl.float32)  # (T^T du) (beta v)^T over the V loop
    d_beta = tl.zeros([BT], dtype=tl.float32)
    for v0 in range(0, DV, BV):
        v_ptrs, v_mask = _tile(V_, row, valid, v0, DV, BV, H, h)
        vn_ptrs, _ = _tile(VN, row, valid, v0, DV, BV, H, h)
        do_ptrs, _ = _tile(DO, row, valid, v0, DV, BV, H, h)
        dvn_ptrs, _ = _tile(DVN, row, valid, v0, DV, BV, H, h)
        v = tl.load(v_ptrs, mask=v_mask, other=0.0).to(tl.float32)
        v_new = tl.load(vn_ptrs, mask=v_mask, other=0.0)
        do = tl.load(do_ptrs, mask=v_mask, other=0.0)
        du = tl.load(dvn_ptrs, mask=v_mask, other=0.0)  # dL/dv_new = dL/du  [BT, BV]
        d_p += _dot(do, tl.trans(v_new), MODE)
        dx_u = _dot(tm_t, du, MODE)  # dL/d(beta * v)  [BT, BV]
        dv_ptrs, _ = _tile(DV_, row, valid, v0, DV, BV, H, h)
        tl.store(dv_ptrs, _cast(dx_u * beta[:, None], DV_, MODE), mask=v_mask)
        d_beta += tl.sum(dx_u * v, 1)
        x += _dot(dx_u, tl.trans(v * beta[:, None]), MODE)
    d_a = -_dot(x, tm_t, MODE)  # dL/dA, u part (before masking): -(T^T du) u^T, u = T beta v

    tile = rows[:, None] * BT + rows[None, :]
    d_qk = d_p * _pair(gc, seg, BT, False)  # dL/d(scale * q_i . k_j)
    tl.store(DQK + chunk * BT * BT + tile, _cast(d_qk, DQK, MODE))
    tl.store(SCR + chunk * NS * BT * BT + tile, d_a)
    tl.store(DB + row * H + h, d_beta, mask=valid)


@triton.jit
def _bwd_key(Q, K_, G, BETA, RST, TM, W, HS, VN, DHS, DO, DVN, DQK, SCR, VEC, DQ, DKP, L, N,
             scale,
             H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
             BV: tl.constexpr, BT: tl.constexpr, HAS_RESET: tl.constexpr, MODE: tl.constexpr,
             BKS: tl.constexpr, NKB: tl.constexpr, NS: tl.constexpr):
    """One chunk's K slice of BKS columns (after _bwd_val; program_id(0) = chunk * NKB + slice,
    so a chunk's slices run side by side and share its reads in L2): a V loop for the slice's
    dL/d(q_in), dL/dw, dL/d(k_out) [BT, BKS], then dq (final), dk without its dL/dA term
    (DKP), the slice's w part of dL/dA, -(T^T dL/dw) w^T (scratch slot 1 + slice), and its
    row sums for d_beta and d_gc (VEC). The P terms of d_gc use rowsum(m) = rowsum(q * dq_P),
    colsum(m) = rowsum(k * dk_P) for m = d_qk * (scale q k^T), so no q k^T is formed."""
    n, kb, bh = tl.program_id(0) // NKB, tl.program_id(0) % NKB, tl.program_id(1)
    h, valid, gc, seg, beta, row, rows, chunk = _chunk_start(G, BETA, RST, n, bh, L, N, H, BT,
                                                             HAS_RESET)
    decay_in, decay_out, gamma = _decays(gc, seg, BT)
    k0 = kb * BKS

    d_q_in = tl.zeros([BT, BKS], dtype=tl.float32)  # dL/d(scale * decay_in * q)
    d_w_neg = tl.zeros([BT, BKS], dtype=tl.float32)  # -dL/dw
    d_k_out = tl.zeros([BT, BKS], dtype=tl.float32)  # dL/d(decay_out * k)
    d_gamma = tl.zeros([BKS], dtype=tl.float32)  # summed at the end
    for v0 in range(0, DV, BV):
        hs_ptrs, s_mask = _state_tile(HS, chunk * DK * DV, k0, v0, DK, DV, BKS, BV)
        dhs_ptrs, _ = _state_tile(DHS, chunk * DK * DV, k0, v0, DK, DV, BKS, BV)
        state = tl.load(hs_ptrs, mask=s_mask, other=0.0)  # S entering the chunk [BKS, BV]
        dstate = tl.load(dhs_ptrs, mask=s_mask, other=0.0)  # dL/dS leaving it
        vn_ptrs, v_mask = _tile(VN, row, valid, v0, DV, BV, H, h)
        do_ptrs, _ = _tile(DO, row, valid, v0, DV, BV, H, h)
        dvn_ptrs, _ = _tile(DVN, row, valid, v0, DV, BV, H, h)
        v_new = tl.load(vn_ptrs, mask=v_mask, other=0.0)
        do = tl.load(do_ptrs, mask=v_mask, other=0.0)
        du = tl.load(dvn_ptrs, mask=v_mask, other=0.0)
        d_q_in += _dot(do, tl.trans(state), MODE)
        d_w_neg += _dot(du, tl.trans(state), MODE)
        d_k_out += _dot(v_new, tl.trans(dstate), MODE)
        d_gamma += tl.sum(state.to(tl.float32) * dstate.to(tl.float32), 1)

    # the epilogue consumes each [BT, BKS] accumulator as soon as it can (its row sums taken,
    # its terms added), so few of them are live at once: d_q_in, then d_k_out, then d_w_neg
    q_ptrs, k_mask = _tile(Q, row, valid, k0, DK, BKS, H, h)
    k_ptrs, _ = _tile(K_, row, valid, k0, DK, BKS, H, h)
    q = tl.load(q_ptrs, mask=k_mask, other=0.0)
    k = tl.load(k_ptrs, mask=k_mask, other=0.0)
    q32 = q.to(tl.float32)
    k32 = k.to(tl.float32)
    tile = rows[:, None] * BT + rows[None, :]
    dq_p = _dot(tl.load(DQK + chunk * BT * BT + tile), k, MODE) * scale
    d_gc = scale * tl.sum(d_q_in * q32, 1) * decay_in + tl.sum(q32 * dq_p, 1)
    dq_ptrs, _ = _tile(DQ, row, valid, k0, DK, BKS, H, h)
    tl.store(dq_ptrs, _cast(d_q_in * (scale * decay_in)[:, None] + dq_p, DQ, MODE), mask=k_mask)

    end = tl.sum(d_k_out * k32, 1) * decay_out  # dL/d(decay_out) * decay_out
    dk = d_k_out * decay_out[:, None]
    tm_t = tl.load(TM + chunk * BT * BT + rows[None, :] * BT + rows[:, None])  # T^T
    dx_w_neg = _dot(tm_t, d_w_neg, MODE)  # -dL/d(beta * decay_in * k)  [BT, BKS]
    xk = -tl.sum(dx_w_neg * k32, 1)
    dk -= dx_w_neg * (beta * decay_in)[:, None]
    kcols = k0 + tl.arange(0, BKS)
    w_t = tl.load(W + (row[None, :] * H + h) * DK + kcols[:, None],
                  mask=valid[None, :] & (kcols[:, None] < DK), other=0.0)  # w^T [BKS, BT]
    scr = SCR + chunk * NS * BT * BT
    tl.store(scr + (1 + kb) * BT * BT + tile, _dot(dx_w_neg, w_t, MODE))

    d_qk_t = tl.load(DQK + chunk * BT * BT + rows[None, :] * BT + rows[:, None])
    dk_p = _dot(d_qk_t, q, MODE) * scale
    dk += dk_p
    dkp_ptrs, _ = _tile(DKP, row, valid, k0, DK, BKS, H, h)
    tl.store(dkp_ptrs, _cast(dk, DKP, MODE), mask=k_mask)

    d_gc += (beta * xk * decay_in - tl.sum(k32 * dk_p, 1) - end
             + tl.where(rows == BT - 1, tl.sum(end, 0) + tl.sum(d_gamma, 0) * gamma, 0.0))
    vec = VEC + (chunk * NKB + kb) * 2 * BT
    tl.store(vec + rows, xk * decay_in)  # d_beta part
    tl.store(vec + BT + rows, d_gc)


@triton.jit
def _bwd_fin(K_, G, BETA, RST, SCR, VEC, DKP, DK_, DG, DB, L, N, H: tl.constexpr,
             DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
             BT: tl.constexpr, HAS_RESET: tl.constexpr, MODE: tl.constexpr,
             BKS: tl.constexpr, NKB: tl.constexpr, NS: tl.constexpr):
    """One chunk's finish (after _bwd_key): dL/dA summed from the scratch slots, masked, as
    d_ak = dL/dA * pair and d_kk^T (d_ak's rows scaled by beta, transposed: a loaded sum, not
    a matmul result, so tl.trans is safe here, see above _bwd_val); then per K
    slice of BKS: dk = DKP + beta * (d_ak k) + d_kk^T k, and the dL/dA terms of d_beta and d_gc
    as row sums (rowsum(d_ak * k k^T) = rowsum(k * d_ak k)); then d_g (cumsum, resets)."""
    n, bh = tl.program_id(0), tl.program_id(1)
    h, valid, gc, seg, beta, row, rows, chunk = _chunk_start(G, BETA, RST, n, bh, L, N, H, BT,
                                                             HAS_RESET)
    scr = SCR + chunk * NS * BT * BT
    tile = rows[:, None] * BT + rows[None, :]
    d_a = tl.load(scr + tile)  # dL/dA
    for kb in tl.static_range(NKB):
        d_a += tl.load(scr + (1 + kb) * BT * BT + tile)
    pair = _pair(gc, seg, BT, True)
    d_ak = tl.where(pair != 0.0, d_a, 0.0) * pair  # dL/d(beta_i * (k_i . k_j)), i > j
    d_kk_t = tl.trans(d_ak * beta[:, None])  # dL/d(k_j . k_i)

    d_beta = tl.load(DB + row * H + h, mask=valid, other=0.0)  # _bwd_val's part
    d_gc = tl.zeros([BT], dtype=tl.float32)
    vec = VEC + chunk * NKB * 2 * BT
    for kb in tl.static_range(NKB):
        d_beta += tl.load(vec + kb * 2 * BT + rows)
        d_gc += tl.load(vec + kb * 2 * BT + BT + rows)
    for k0 in range(0, DK, BKS):
        k_ptrs, k_mask = _tile(K_, row, valid, k0, DK, BKS, H, h)
        k = tl.load(k_ptrs, mask=k_mask, other=0.0)
        x = _dot(d_ak, k, MODE)  # [BT, BKS]
        y = _dot(d_kk_t, k, MODE)
        dkp_ptrs, _ = _tile(DKP, row, valid, k0, DK, BKS, H, h)
        dk = tl.load(dkp_ptrs, mask=k_mask, other=0.0).to(tl.float32) + x * beta[:, None] + y
        dk_ptrs, _ = _tile(DK_, row, valid, k0, DK, BKS, H, h)
        tl.store(dk_ptrs, _cast(dk, DK_, MODE), mask=k_mask)
        k32 = k.to(tl.float32)
        xk = tl.sum(k32 * x, 1)
        d_beta += xk
        d_gc += beta * xk - tl.sum(k32 * y, 1)  # rowsum(m) - colsum(m), m = d_kk * k k^T

    d_g = tl.cumsum(d_gc, 0, reverse=True)
    if HAS_RESET:
        rst = tl.load(RST + row, mask=valid, other=0)
        d_g = tl.where(rst != 0, 0.0, d_g)
    tl.store(DG + row * H + h, d_g, mask=valid)
    tl.store(DB + row * H + h, d_beta, mask=valid)
