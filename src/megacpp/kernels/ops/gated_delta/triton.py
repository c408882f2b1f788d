"""The chunked gated delta rule in Triton, forward and backward.

Same contract as :func:`megacpp.kernels.ops.gated_delta.reference.gated_delta_rule_chunked`
(fla's layout: q, k [B, L, H, K], v [B, L, H, V], g, beta [B, L, H], reset [B, L] bool,
state [B, H, K, V]); float32 or bfloat16 q/k/v, any float g/beta, float32 state and
accumulation. Chunks are always ``CHUNK`` = 64 tokens: the result does not depend on the
chunk length, so ``chunk_size`` is accepted and only validated.

Per chunk of C tokens (one batch row, one head), with ``gc`` the in-chunk cumulative log decay
and ``seg`` the number of resets seen so far in the chunk (decays never cross a reset)::

    A      = strict_lower(beta_i * exp(gc_i - gc_j) * k_i.k_j)   (same segment)   [C, C]
    T      = (I + A)^-1                                                           [C, C]
    w, u   = T (beta * decay_in * k),  T (beta * v)                  (the WY / UT form)
    v_new  = u - w S                       S: the state entering the chunk        [C, V]
    o      = (scale * decay_in * q) S + (scale * q k^T * exp(gc_i - gc_j), causal) v_new
    S'     = decay_chunk * S + (decay_out * k)^T v_new

Kernels (grid in brackets; N chunks, BH = B * H):

* ``_fwd_intra``  [N, BH]   A, T (by doubling blocks, below), w, u, and
  the per-token decay_in / decay_out and per-chunk gamma the state passes read
* ``_fwd_state``  [V/BV, BH] the only sequential pass: S per chunk, v_new, final state
* ``_fwd_out``    [N, BH]   o
* ``_bwd_dv_local`` [N, BH] the intra-chunk part of dL/dv_new: P^T do
* ``_bwd_state``  [V/BV, BH] reverse pass: dL/dS per chunk, dL/dv_new, dL/d initial_state
* ``_bwd_val``    [N, BH]   the value side (a V loop): dv, dL/dP, the u part of dL/dA, the
  value part of dbeta
* ``_bwd_key``    [N * K/BKS, BH] one K slice: its V loop (dL/d(decay_in q), dL/dw,
  dL/d(decay_out k), [C, BKS] each), dq, dk but its dL/dA term, the slice's w part of dL/dA
  and its row sums for dbeta and dg
* ``_bwd_fin``    [N, BH]   dL/dA summed from the parts, the dL/dA terms of dk, dbeta, dg, and
  dg through the decays' cumsum

T is built without tiny matmuls or per-row steps: the inverse of (I + A)'s diagonal blocks of
side 2, 4, ..., 64 in turn, each from the last by ``T <- T - T E T`` (E: A's lower-left
quadrants of the new blocks), two [64, 64] products per side, all blocks at once: 10 dependent
products (the 15-step forward substitution it replaced took 19; _fwd_intra -15% at H16).

Saved for backward: q, k, v, g, beta, reset, T [B, H, N*C, C], w (k's dtype), the
chunk-entry states [B, H, N, K, V] (q's dtype), v_new [B, L, H, V], the decays; u^T is
recomputed. T and v_new are bfloat16 for bfloat16 inputs when ``BF16_STORAGE`` names them, else
float32. The split backward's scratch, with NKB = K / BKS key slices (see above ``_bwd_val``):
dL/dP masked [B, H, N, C, C], float32 [B, H, N, 1 + NKB, C, C] (the u part of dL/dA, the w
part per K slice; transposes are reads of these through transposed pointers), [B, H, N, NKB,
2, C] (row sums per K slice) and [B, L, H, K] (dk before its dL/dA term); partials are summed
in a fixed order (no atomics: bit-reproducible gradients).
bfloat16 inputs use bfloat16 tensor-core products throughout (float32 operands rounded, as fla
does; ``BF16_PRODUCTS`` names the kernels, the others use tf32 where an operand is a float32
intermediate), except T's own products (tf32); float32 inputs use 3xTF32 products.

Supported here: CUDA (or the Triton CPU interpreter, ``TRITON_INTERPRET=1``), q/k/v float32 or
bfloat16, K <= 128, initial_state and output_final_state. Anything else (float64, float16,
K > 128) is computed by the reference for that call (one warning per process).
"""

from __future__ import annotations

import os
import warnings

import torch
import triton
import triton.language as tl
from torch import Tensor

from megacpp.kernels.device import cdiv, next_power_of_2, sm_count
from megacpp.kernels.ops.gated_delta.reference import _check_inputs, gated_delta_rule_chunked

CHUNK = 64  # tokens per chunk (the tile side of A and T)
MAX_K = 128  # head_k_dim the kernels hold in registers
# Smallest K / V tile. On the H100 (Triton 3.6) 16-wide tiles hit illegal memory accesses
# (fp32 K = V = 16; the backward with BV = 16), so narrower heads run masked 32-wide tiles.
MIN_TILE = 32
DTYPES = (torch.float32, torch.bfloat16)
# bfloat16 inputs: the kernels whose products round float32 operands (the state, decayed keys,
# T, dL/dA, ...) to bfloat16 as fla does, instead of tf32 (see ``_dot``; T's own products stay
# tf32), and the intermediates stored in bfloat16 instead of float32 (u, v_new, dvn =
# dL/dv_new; T and dqk = dL/dP masked, which only products read, so bf16 products round them
# the same either way; dk_part = dk before its dL/dA term). All products by default: on the
# H100 -15% (nam56r 4k) and -20% (H16) kernel time against tf32 products and float32 storage,
# relative errors against the float64 reference 3.9e-3 vs 2.6e-3 (fla 5.4e-3), at most 7.2e-3
# in the interpreter's emulation; per-kernel ablation and timings:
# benchmarks/results/kernels/h100_s8.
BF16_PRODUCTS: frozenset[str] = frozenset({
    "fwd_intra", "fwd_state", "fwd_out", "bwd_dv_local", "bwd_state", "bwd_val", "bwd_key",
    "bwd_fin"})
BF16_STORAGE: frozenset[str] = frozenset({"u", "v_new", "dvn", "T", "dqk", "dk_part"})


# -- shared pieces ------------------------------------------------------------------------------
@triton.jit
def _tf32(x):
    """x rounded to tf32 (10 mantissa bits, ties away from zero), kept as float32."""
    bits = x.to(tl.float32).to(tl.int32, bitcast=True)
    return ((bits + 0x1000) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def _bf16(x):
    """x rounded to bfloat16 (7 mantissa bits, ties to even), kept as float32: the GPU's
    conversion. The CPU interpreter's ``.to(tl.bfloat16)`` truncates (Triton 3.6), which
    biases every rounding the same way and overstated bfloat16 errors about fourfold."""
    bits = x.to(tl.float32).to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _cast(x, PTR, MODE: tl.constexpr):
    """x in PTR's element type, for a store; under the CPU interpreter (MODE 2, 4) rounded to
    nearest even first (``_bf16``), so the emulation stores what the GPU stores."""
    if (MODE == 2 or MODE == 4) and PTR.dtype.element_ty == tl.bfloat16:
        x = _bf16(x)
    return x.to(PTR.dtype.element_ty)


@triton.jit
def _dot(a, b, MODE: tl.constexpr):
    """a @ b with float32 accumulation. MODE 0 (float32 inputs): 3xTF32 (float32-accurate
    products on the tensor cores; "ieee" would run these [64, 64] products on FMA units).
    MODE 1 (bfloat16 inputs): bfloat16 tensor cores when both operands are bfloat16 (inputs,
    stored intermediates), else tf32, so float32 intermediates (the state, decayed keys, dL/dA)
    keep 10 mantissa bits instead of 7. MODE 3 (bfloat16 inputs, kernels in
    ``BF16_PRODUCTS``): every operand rounded to bfloat16, as fla does. MODE 2 and 4: MODE 1's
    and MODE 3's rounding in IEEE float32 products (the CPU interpreter, whose bfloat16 dot is
    wrong)."""
    if MODE == 0:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32x3")
    elif MODE == 1:
        if a.dtype == tl.bfloat16 and b.dtype == tl.bfloat16:
            return tl.dot(a, b)
        else:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32")
    elif MODE == 2:
        return tl.dot(_tf32(a), _tf32(b), input_precision="ieee")
    elif MODE == 3:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        return tl.dot(_bf16(a), _bf16(b), input_precision="ieee")


@triton.jit
def _gates(G, BETA, RST, b, h, n, L, H: tl.constexpr, BT: tl.constexpr,
           HAS_RESET: tl.constexpr):
    """The chunk's per-token gates. Returns (t [BT] token index, valid [BT], gc [BT] cumulative
    log decay (resets contribute 0), seg [BT] resets seen so far, beta [BT])."""
    t = n * BT + tl.arange(0, BT)
    valid = t < L
    row = b.to(tl.int64) * L + t  # [BT] index into [B, L]
    g = tl.load(G + row * H + h, mask=valid, other=0.0).to(tl.float32)
    beta = tl.load(BETA + row * H + h, mask=valid, other=0.0).to(tl.float32)
    if HAS_RESET:
        rst = tl.load(RST + row, mask=valid, other=0).to(tl.int32)
        g = tl.where(rst != 0, 0.0, g)
    else:
        rst = tl.zeros([BT], dtype=tl.int32)
    gc = tl.cumsum(g, 0)
    seg = tl.cumsum(rst, 0)
    return t, valid, gc, seg, beta


@triton.jit
def _chunk_start(G, BETA, RST, n, bh, L, N, H: tl.constexpr, BT: tl.constexpr,
                 HAS_RESET: tl.constexpr):
    """What a per-chunk program starts from: head h, the chunk's gates (``_gates``'s valid, gc,
    seg, beta), its rows into [B, L] (int64), arange(BT) and its index into [BH, N]."""
    b, h = bh // H, bh % H
    t, valid, gc, seg, beta = _gates(G, BETA, RST, b, h, n, L, H, BT, HAS_RESET)
    row = b.to(tl.int64) * L + t
    return h, valid, gc, seg, beta, row, tl.arange(0, BT), bh.to(tl.int64) * N + n


@triton.jit
def _last(x, BT: tl.constexpr):
    """x[BT - 1] of a [BT] vector, as a scalar."""
    return tl.sum(tl.where(tl.arange(0, BT) == BT - 1, x, 0), 0)


@triton.jit
def _decays(gc, seg, BT: tl.constexpr):
    """decay_in [BT] (chunk start -> token i, inclusive), decay_out [BT] (token j -> chunk
    end), gamma (the whole chunk), each zero across a reset."""
    decay_in = tl.where(seg == 0, tl.exp(gc), 0.0)
    gc_end, seg_end = _last(gc, BT), _last(seg, BT)
    decay_out = tl.where(seg == seg_end, tl.exp(gc_end - gc), 0.0)
    gamma = _last(decay_in, BT)
    return decay_in, decay_out, gamma


@triton.jit
def _pair(gc, seg, BT: tl.constexpr, STRICT: tl.constexpr):
    """[BT, BT] exp(gc_i - gc_j) for j < i (STRICT) or j <= i in the same segment, else 0."""
    rows = tl.arange(0, BT)[:, None]
    cols = tl.arange(0, BT)[None, :]
    if STRICT:
        mask = rows > cols
    else:
        mask = rows >= cols
    mask = mask & (seg[:, None] == seg[None, :])
    return tl.where(mask, tl.exp(tl.where(mask, gc[:, None] - gc[None, :], 0.0)), 0.0)


@triton.jit
def _tile(PTR, row, valid, col0, D: tl.constexpr, BD: tl.constexpr, H: tl.constexpr, h):
    """Pointers and mask of the [BT, BD] tile (tokens row, features col0..) of a [B, L, H, D]
    tensor, row = b * L + t (int64)."""
    cols = col0 + tl.arange(0, BD)
    ptrs = PTR + (row[:, None] * H + h) * D + cols[None, :]
    return ptrs, valid[:, None] & (cols[None, :] < D)


@triton.jit
def _tile_t(PTR, row, valid, col0, D: tl.constexpr, BD: tl.constexpr, H: tl.constexpr, h):
    """``_tile``'s transpose: pointers and mask of the [BD, BT] tile (features col0.., tokens
    row) of a [B, L, H, D] tensor, so a product takes it as loaded, not through tl.trans."""
    cols = col0 + tl.arange(0, BD)
    ptrs = PTR + (row[None, :] * H + h) * D + cols[:, None]
    return ptrs, valid[None, :] & (cols[:, None] < D)


@triton.jit
def _state_tile(PTR, base, row0, col0, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                BV: tl.constexpr):
    """Pointers and mask of the [BK, BV] tile (keys row0.., values col0..) of a [K, V] state at
    ``base``."""
    rk = row0 + tl.arange(0, BK)
    cv = col0 + tl.arange(0, BV)
    return PTR + base + rk[:, None] * V + cv[None, :], (rk[:, None] < K) & (cv[None, :] < V)


@triton.jit
def _loop_count(N, N_CONST: tl.constexpr):
    """The chunk loop's bound: the runtime N, or N_CONST when > 0 (the CPU interpreter, whose
    runtime scalars cannot bound a Python range under numpy 2)."""
    if N_CONST > 0:
        return N_CONST
    else:
        return N


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


# -- forward ------------------------------------------------------------------------------------
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
def _state_loads(X, D, GAM, b, bh, n, v0, L, N, H: tl.constexpr, DV: tl.constexpr,
                 BV: tl.constexpr, BT: tl.constexpr):
    """Chunk n's loads of a state pass that feed no product: the [BT, BV] tile of X (a [B, L,
    H, DV] tensor), the [BT] gate vector of D ([BH, N * BT]) and the chunk's gamma."""
    rows = tl.arange(0, BT)
    t = n * BT + rows
    valid = t < L
    x_ptrs, x_mask = _tile(X, b.to(tl.int64) * L + t, valid, v0, DV, BV, H, bh % H)
    x = tl.load(x_ptrs, mask=x_mask, other=0.0)
    d = tl.load(D + (bh.to(tl.int64) * N + n) * BT + rows)
    return x, d, tl.load(GAM + bh.to(tl.int64) * N + n)


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
        # the loads that feed no product, in their own chunk: issued a chunk ahead by hand
        # (sessions 8-9), the loop carry's register moves waited for them (ncu, H100, nam56r
        # 4k: 18% of the stall samples on one move) and the prefetch cost 85.9 vs 73.6 us
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


# -- backward -----------------------------------------------------------------------------------
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
    # over the 227 KB limit). Own chunk is used for bf16 products in the SMALL_GRID launch
    # (nam56r; four runs bit-identical, h100_s11). The BV 64 launch keeps the prefetch: the H16
    # repeats that differed in h100_s10 run 19 came from _bwd_key (see CONFIG), and own-chunk
    # loads there were not measured again after that fix. Float32 products (MODE 0) always
    # prefetch, and so does a setting without the switch (the tuning sweeps' settings)
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
# end). Per chunk, DQK [BT, BT] holds d_qk = dL/dP masked (bfloat16 under "dqk" in
# BF16_STORAGE, which only bf16 products read), scratch SCR [NS = 1 + NKB, BT, BT] float32 the
# u part of dL/dA (slot 0) and the w part of dL/dA per K slice (slots 1..); VEC [NKB, 2, BT]
# the per-K-slice row sums for d_beta and d_gc; DKP [B, L, H, K] dk before its dL/dA term
# (float32, or bfloat16 under "dk_part"). The partials are summed in a fixed order (no
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


# -- autograd -----------------------------------------------------------------------------------
# Launch settings per kernel: BV (value columns per tile), BKS (key columns per slice of
# _bwd_key / _bwd_fin), the Triton launch options (LAUNCH_OPTIONS) and the kernel's own
# switches (any other lower-case key, passed as its upper-case constexpr: "prefetch" ->
# _bwd_state's PREFETCH), from benchmarks/gated_delta_tune.py --quick
# --graph sweeps on an H100 (nam56r 4k and H16 K = V = 128 4k, CUDA-graph replays;
# benchmarks/results/kernels/h100_s9).
LAUNCH_OPTIONS = ("num_warps", "num_stages", "maxnreg")
CONFIG: dict[str, dict[str, int]] = {
    "fwd_intra": {"num_warps": 4, "num_stages": 1},
    # num_stages 1 here, with bf16 products at K = V = 128, hit an illegal memory access on the
    # H100 (Triton 3.6; session 8) and, in session 9, gave a wrong state and output (35% off,
    # compute-sanitizer memcheck and racecheck clean): a miscompile, see
    # h100_s9/session9_h100.log. Keep >= 2
    "fwd_state": {"BV": 64, "num_warps": 4, "num_stages": 2},
    "fwd_out": {"BV": 64, "num_warps": 4, "num_stages": 2},
    "bwd_dv_local": {"BV": 64, "num_warps": 4, "num_stages": 2},
    "bwd_state": {"BV": 64, "num_warps": 4, "num_stages": 3, "prefetch": 1},
    "bwd_val": {"BV": 64, "num_warps": 4, "num_stages": 2},
    # num_stages 1: at 2 (the sweeps' pick), two bf16 fwd+bwd at H16 K = V = 128 (two key
    # slices) gave dk, dg, d_beta differing by up to 0.05, 0.03, 0.01 on the H100 (Triton
    # 3.6); of nine single-kernel launch edits only this one made four runs bit-identical
    # (h100_s11 run 4: a race in the pipelined loads, not root-caused)
    "bwd_key": {"BKS": 64, "BV": 64, "num_warps": 4, "num_stages": 1},
    "bwd_fin": {"BKS": 64, "num_warps": 4, "num_stages": 1},
}
# The state passes' settings when CONFIG's [V / BV, B * H] grid has fewer programs than the
# device has SMs (nam56r: 64 programs of BV 64 on 132 SMs): narrower tiles, more programs, and
# for _fwd_state two warps (likely because two warps take mma.sync, not the four-warp wgmma,
# for its chain of dependent products; not profiled). On the H100, CUDA-graph replays: about
# -20 us (_fwd_state) and -5 us (_bwd_state) of 0.72 ms at nam56r 4k; at H16 (256 programs)
# BV 32 costs +50..80 us.
SMALL_GRID: dict[str, dict[str, int]] = {
    "fwd_state": {"BV": 32, "num_warps": 2, "num_stages": 3},
    "bwd_state": {"BV": 32, "num_warps": 4, "num_stages": 3, "prefetch": 0},
}


def _sm_count(device: torch.device) -> int:
    """The device's SM count; for the CPU interpreter an H100's 132, so it follows the choices
    an H100 makes."""
    return sm_count(device) if device.type == "cuda" else 132


def _dot_mode(q: Tensor) -> int:
    """The kernels' MODE (see ``_dot``): 0 float32 (3xTF32 products), 1 bfloat16 tensor cores,
    2 bfloat16 emulated in float32 (the CPU interpreter); a kernel in ``BF16_PRODUCTS`` runs
    1 -> 3, 2 -> 4."""
    if q.dtype == torch.float32:
        return 0
    return 2 if q.device.type == "cpu" else 1


STORABLE = ("u", "v_new", "dvn", "T", "dqk", "dk_part")  # what BF16_STORAGE may name


def _check_precision_sets() -> None:
    """BF16_PRODUCTS names kernels of CONFIG and BF16_STORAGE names STORABLE intermediates: a
    misspelt name would otherwise change nothing, silently."""
    bad = sorted(set(BF16_PRODUCTS) - set(CONFIG)) + sorted(set(BF16_STORAGE) - set(STORABLE))
    if bad:
        raise ValueError(f"gated_delta triton: unknown names {bad} in BF16_PRODUCTS (kernels: "
                         f"{sorted(CONFIG)}) or BF16_STORAGE (intermediates: {list(STORABLE)})")


def _store_dtype(q: Tensor, name: str) -> torch.dtype:
    """Storage of the intermediate ``name`` (one of STORABLE): bfloat16 for bfloat16 inputs
    when it is in ``BF16_STORAGE``, else float32."""
    return q.dtype if q.dtype == torch.bfloat16 and name in BF16_STORAGE else torch.float32


class _Launcher:
    """Grid and constexpr arguments shared by the kernels for one call's shapes."""

    def __init__(self, q: Tensor, v: Tensor, reset: Tensor | None, g: Tensor) -> None:
        B, L, H, K = q.shape
        V = v.shape[-1]
        self.B, self.L, self.H, self.K, self.V = B, L, H, K, V
        self.N = cdiv(L, CHUNK)
        self.rst = reset.view(torch.uint8) if reset is not None else g  # unused without reset
        self.on_cpu = q.device.type == "cpu"
        _check_precision_sets()
        self.const = {"H": H, "DK": K, "DV": V, "BK": max(MIN_TILE, next_power_of_2(K)),
                      "BT": CHUNK, "MODE": _dot_mode(q), "HAS_RESET": reset is not None}
        self.q = q

    def k_slice(self, name: str) -> int:
        """CONFIG[name]'s BKS clamped to [MIN_TILE, BK]: the key columns of one slice."""
        return max(MIN_TILE, min(CONFIG[name]["BKS"], self.const["BK"]))

    def v_tile(self, cfg: dict[str, int]) -> int:
        """A setting's BV (64 if it has none) clamped to [MIN_TILE, V rounded up to a power
        of two]: the value columns of one tile."""
        return max(MIN_TILE, min(cfg.get("BV", 64), next_power_of_2(self.V)))

    def __call__(self, kernel, name: str, per_chunk: bool, *args, slices: int = 1, **const):
        """Launch ``kernel`` over [N * slices, B*H] (per_chunk) or [V / BV, B*H] with
        CONFIG[name] (its BKS, if any, clamped by ``k_slice``, and BV then to at most BKS), or
        SMALL_GRID[name] when the latter grid would not fill the device's SMs."""
        cfg = dict(CONFIG[name])
        if not per_chunk:
            const["N_CONST"] = self.N if self.on_cpu else 0  # see _loop_count
            programs = cdiv(self.V, self.v_tile(cfg)) * self.B * self.H
            if name in SMALL_GRID and programs < _sm_count(self.q.device):
                cfg = dict(SMALL_GRID[name])
        bv = self.v_tile(cfg)
        cfg.pop("BV", None)
        for key in [k for k in cfg if k.islower() and k not in LAUNCH_OPTIONS]:
            const[key.upper()] = cfg.pop(key)  # a kernel switch
        if "BKS" in cfg:
            const["BKS"] = self.k_slice(name)
            cfg.pop("BKS")
            # no value tile wider than the key slice: _bwd_key at BKS 32 (K = 32) with BV 64
            # faults or computes a wrong dq on the H100 (Triton 3.6; h100_s9 session log)
            bv = min(bv, const["BKS"])
        grid = (self.N * slices if per_chunk else cdiv(self.V, bv), self.B * self.H)
        launch_cfg = {} if self.on_cpu else cfg
        mode = self.const["MODE"]
        if name in BF16_PRODUCTS and mode in (1, 2):
            const["MODE"] = mode + 2
        return kernel[grid](*args, BV=bv, **{**self.const, **const}, **launch_cfg)

    def store(self, name: str) -> dict:
        """torch.empty keywords of the intermediate ``name`` (see ``_store_dtype``)."""
        return {"device": self.q.device, "dtype": _store_dtype(self.q, name)}


class _ChunkedGatedDelta(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, reset, scale: float):
        run = _Launcher(q, v, reset, g)
        B, L, H, K, V, N, rst = run.B, run.L, run.H, run.K, run.V, run.N, run.rst
        f32 = {"device": q.device, "dtype": torch.float32}
        tm = torch.empty(B, H, N * CHUNK, CHUNK, **run.store("T"))
        w, u = torch.empty_like(k), torch.empty(B, L, H, V, **run.store("u"))
        decay_in, decay_out = (torch.empty(B, H, N * CHUNK, **f32) for _ in range(2))
        gamma = torch.empty(B, H, N, **f32)
        run(_fwd_intra, "fwd_intra", True, k, v, g, beta, rst, w, u, tm, decay_in, decay_out,
            gamma, L, N, SOLVE=run.const["MODE"])
        hs = torch.empty(B, H, N, K, V, device=q.device, dtype=q.dtype)
        v_new = torch.empty(B, L, H, V, **run.store("v_new"))
        ht = torch.empty(B, H, K, V, **f32)
        run(_fwd_state, "fwd_state", False, k, w, u, decay_out, gamma,
            ht if h0 is None else h0, hs, v_new, ht, L, N, HAS_H0=h0 is not None, STORE_HT=True)
        del u
        o = torch.empty_like(v)
        run(_fwd_out, "fwd_out", True, q, k, g, beta, rst, hs, v_new, o, L, N, scale)
        ctx.save_for_backward(q, k, v, g, beta, reset, tm, w, hs, v_new, decay_in, decay_out,
                              gamma)
        ctx.scale, ctx.has_h0 = scale, h0 is not None
        ctx.set_materialize_grads(False)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, reset, tm, w, hs, v_new, decay_in, decay_out, gamma = ctx.saved_tensors
        run = _Launcher(q, v, reset, g)
        B, L, H, K, V, N, rst = run.B, run.L, run.H, run.K, run.V, run.N, run.rst
        f32 = {"device": q.device, "dtype": torch.float32}
        do = torch.zeros_like(v) if do is None else do.to(v.dtype).contiguous()
        # dL/dv_new: the local part, then all of it
        dvn = torch.empty(B, L, H, V, **run.store("dvn"))
        run(_bwd_dv_local, "bwd_dv_local", True, q, k, g, beta, rst, do, dvn, L, ctx.scale)
        dhs = torch.empty_like(hs)
        dh0 = torch.empty(B, H, K, V, **f32) if ctx.has_h0 else None
        dht_arg = dvn if dht is None else dht.float().contiguous()
        run(_bwd_state, "bwd_state", False, q, k, w, decay_in, decay_out, gamma, do, dvn,
            dht_arg, dhs, dvn if dh0 is None else dh0, L, N, ctx.scale,
            HAS_DHT=dht is not None, STORE_DH0=ctx.has_h0)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dg, db = torch.empty_like(g), torch.empty_like(beta)
        # the scratch is described above _bwd_val
        nkb = cdiv(K, run.k_slice("bwd_key"))
        ns = 1 + nkb
        d_qk = torch.empty(B, H, N, CHUNK, CHUNK, **run.store("dqk"))
        scratch = torch.empty(B, H, N, ns, CHUNK, CHUNK, **f32)
        vec = torch.empty(B, H, N, nkb, 2, CHUNK, **f32)
        dk_part = torch.empty(B, L, H, K, **run.store("dk_part"))
        assert db.dtype == torch.float32  # it carries _bwd_val's d_beta part to _bwd_fin
        run(_bwd_val, "bwd_val", True, v, g, beta, rst, tm, v_new, do, dvn, d_qk, scratch, dv,
            db, L, N, NS=ns)
        run(_bwd_key, "bwd_key", True, q, k, g, beta, rst, tm, w, hs, v_new, dhs, do, dvn,
            d_qk, scratch, vec, dq, dk_part, L, N, ctx.scale, slices=nkb, NKB=nkb, NS=ns)
        run(_bwd_fin, "bwd_fin", True, k, g, beta, rst, scratch, vec, dk_part, dk, dg, db, L, N,
            NKB=nkb, NS=ns)
        return dq, dk, dv, dg, db, dh0, None, None


# -- entry point --------------------------------------------------------------------------------
def unsupported_reason(q: Tensor, k: Tensor, v: Tensor) -> str | None:
    """Why the Triton kernels cannot take this call (the reference then does), or None."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if q.device.type != "cuda" and not (interpret and q.device.type == "cpu"):
        return f"device {q.device.type} (CUDA, or the CPU under TRITON_INTERPRET=1)"
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"q/k/v dtypes {q.dtype}/{k.dtype}/{v.dtype} (float32 or bfloat16, all equal)"
    if q.shape[-1] > MAX_K:
        return f"head_k_dim {q.shape[-1]} > {MAX_K}"
    return None


_warned: set[str] = set()


def gated_delta_rule_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    reset: Tensor | None = None,
    output_final_state: bool = True,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor | None]:
    """Chunked gated delta rule in Triton; the arguments and results of
    :func:`~megacpp.kernels.ops.gated_delta.reference.gated_delta_rule_chunked`.

    ``chunk_size`` is validated but the kernels always use 64-token chunks (same result).
    Calls the kernels cannot take (see :func:`unsupported_reason`) run the reference.
    """
    _check_inputs(q, k, v, g, beta, initial_state, reset)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size}")
    why = unsupported_reason(q, k, v)
    if why is not None:
        if why not in _warned:
            _warned.add(why)
            warnings.warn(f"gated_delta triton: {why}; this call uses the reference",
                          stacklevel=2)
        return gated_delta_rule_chunked(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, reset=reset,
            output_final_state=output_final_state, chunk_size=chunk_size)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    h0 = None if initial_state is None else initial_state.float().contiguous()
    o, state = _ChunkedGatedDelta.apply(
        q.contiguous(), k.contiguous(), v.contiguous(), g.float().contiguous(),
        beta.float().contiguous(), h0, None if reset is None else reset.contiguous(),
        float(scale))
    return o, (state if output_final_state else None)
