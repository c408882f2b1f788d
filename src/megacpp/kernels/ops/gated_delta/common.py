"""Pieces every gated-delta kernel shares: the products at each precision mode, the
bfloat16 emulation of the CPU interpreter, a chunk's gates and decays, and tile pointers.

Precision modes (``MODE``, see :func:`_dot`): 0 float32 inputs (3xTF32 products); 1 bfloat16
tensor cores where both operands are bfloat16, else tf32 (T's own products); 3 every operand
rounded to bfloat16 (bfloat16 inputs, as fla does); 2 and 4 the roundings of 1 and 3 in IEEE
float32 products (the CPU interpreter, whose bfloat16 dot is wrong).
"""

from __future__ import annotations

import triton
import triton.language as tl


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
    MODE 1 (T's own products for bfloat16 inputs): bfloat16 tensor cores when both operands
    are bfloat16, else tf32, so float32 operands keep 10 mantissa bits instead of 7. MODE 3
    (bfloat16 inputs, every other product): every operand rounded to bfloat16, as fla does.
    MODE 2 and 4: MODE 1's and MODE 3's rounding in IEEE float32 products (the CPU
    interpreter, whose bfloat16 dot is wrong)."""
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
