"""Mamba-3 MIMO scan with its intra-chunk quadratic form in Triton, forward and backward.

The chunked form (reference.py's :func:`chunked_scan`) spends its memory and most of its
bytes on the intra-chunk form: per chunk and head a [T*R, T*R] score matrix, its decay
weights and their products, each a [B, C, H, T, R, T, R] tensor in PyTorch (1 GiB in float32
at batch 8, L 4096, 32 heads, T 16, R 4), several of them saved for backward. Here one
program per (row, chunk, head) holds the chunk's q, k [T*R, N] and x [T*R, P] tiles, forms
the scores and weights in registers and writes y [T*R, P] only:

    y[i] = sum_j W[t(i), t(j)] (q_i . k_j) x_j,   t(i) = i // R (the token of row i)
    W[t, s] = exp(a_t - a_s) scale_s  (s < t, same document),  gamma_t  (s = t),  else 0

Backward, one program per (row, chunk, head), with dP = dy x^T and S = q k^T recomputed:
dx = (S * W)^T dy, dq = (dP * W) k, dk = (dP * W)^T q, and the token scalars' gradients
from dW = dP * S as four per-row sums (summed over each token's R rows on the host):
d a_t = sum (dW * W_off) over t's rows, d a_s = -sum over s's columns, d scale_s = sum of
dW * exp(a_t - a_s) over s's columns, d gamma_t = sum of dW over t's diagonal block.

The sequential pass over chunks (s <- decay_c s + chunk_state_c, storing the state entering
each chunk) is a second pair of kernels, one program per (head, 1024 state entries), instead
of the reference's Python loop of a few small kernels per chunk (256 chunks at L 4096, T 16).

Everything else (rotation, biases, the MIMO projections, the chunk states' einsum, the
read-out of the carried state, skip, gate) is the reference's PyTorch, differentiated by
autograd; :func:`chunked_scan` keeps only the scan's inputs for backward and runs the whole
forward (these kernels included) again there, so none of this module's saved tensors (the
rows-layout copies, the entering states) outlive one backward. Limits: T*R <= 128, d_state <= 128, headdim <= 128 (larger
tiles would not fit a program's registers); float64 runs the reference. Matmul operands are
float32 for every input dtype (:func:`chunked_scan` computes q, k and x in float32 before the
intra-chunk form), with IEEE products; sums in float32.
Launch settings: ``configs.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from megacpp.errors import MegaCppError
from megacpp.kernels.device import next_power_of_2
from megacpp.kernels.launch import for_device
from megacpp.kernels.ops.mamba3_mimo_scan.configs import CONFIGS
from megacpp.kernels.ops.mamba3_mimo_scan.reference import chunked_scan
from megacpp.kernels.ops.mamba3_scan.reference import Mamba3ScanState

MAX_ROWS = 128  # T * R
MAX_D_STATE = 128
MAX_HEADDIM = 128


@triton.jit
def _mimo_weights(A, SC, GM, SEG, pid, seg_row, i, j, valid_i, valid_j, T, R: tl.constexpr):
    """W [TRB, TRB] between rows i and columns j (float32), its off-diagonal decay
    exp(a_t - a_s) (0 outside s < t in one document) and the same-token mask."""
    ti, tj = i // R, j // R
    a_i = tl.load(A + pid * T + ti, mask=valid_i, other=0.0)
    a_j = tl.load(A + pid * T + tj, mask=valid_j, other=0.0)
    sc_j = tl.load(SC + pid * T + tj, mask=valid_j, other=0.0)
    gm_i = tl.load(GM + pid * T + ti, mask=valid_i, other=0.0)
    sg_i = tl.load(SEG + seg_row * T + ti, mask=valid_i, other=-1)
    sg_j = tl.load(SEG + seg_row * T + tj, mask=valid_j, other=-2)
    off = (ti[:, None] > tj[None, :]) & (sg_i[:, None] == sg_j[None, :])
    off = off & valid_i[:, None] & valid_j[None, :]
    decay = tl.exp(tl.where(off, a_i[:, None] - a_j[None, :], float("-inf")))
    diag = (ti[:, None] == tj[None, :]) & valid_i[:, None] & valid_j[None, :]
    w = decay * sc_j[None, :] + tl.where(diag, gm_i[:, None], 0.0)
    return w, decay, diag


@triton.jit
def _mimo_tiles(Q, K, X, pid, i, valid_i, n, p, TR, N, P):
    """The program's q, k [TRB, NB] and x [TRB, PB] tiles (operand dtype) and their rows."""
    rows = pid.to(tl.int64) * TR + i
    qk_mask = valid_i[:, None] & (n < N)[None, :]
    q = tl.load(Q + rows[:, None] * N + n[None, :], mask=qk_mask, other=0.0)
    k = tl.load(K + rows[:, None] * N + n[None, :], mask=qk_mask, other=0.0)
    x = tl.load(X + rows[:, None] * P + p[None, :], mask=valid_i[:, None] & (p < P)[None, :],
                other=0.0)
    return q, k, x, rows


@triton.jit
def _mimo_intra_fwd(Q, K, X, A, SC, GM, SEG, Y, H, T, TR, N, P, R: tl.constexpr,
                    TRB: tl.constexpr, NB: tl.constexpr, PB: tl.constexpr):
    pid = tl.program_id(0)  # (row, chunk, head) flattened
    i = tl.arange(0, TRB)
    n, p = tl.arange(0, NB), tl.arange(0, PB)
    valid = i < TR
    q, k, x, rows = _mimo_tiles(Q, K, X, pid, i, valid, n, p, TR, N, P)
    w, _decay, _diag = _mimo_weights(A, SC, GM, SEG, pid, pid // H, i, i, valid, valid, T, R)
    s = tl.dot(q, tl.trans(k), input_precision="ieee")
    y = tl.dot((s * w).to(x.dtype), x, input_precision="ieee")
    tl.store(Y + rows[:, None] * P + p[None, :], y.to(Y.dtype.element_ty),
             mask=valid[:, None] & (p < P)[None, :])


@triton.jit
def _mimo_intra_bwd(Q, K, X, A, SC, GM, SEG, DY, DQ, DK, DX, ROWS4, H, T, TR, N, P,
                    R: tl.constexpr, TRB: tl.constexpr, NB: tl.constexpr, PB: tl.constexpr):
    pid = tl.program_id(0)
    i = tl.arange(0, TRB)
    n, p = tl.arange(0, NB), tl.arange(0, PB)
    valid = i < TR
    q, k, x, rows = _mimo_tiles(Q, K, X, pid, i, valid, n, p, TR, N, P)
    dy = tl.load(DY + rows[:, None] * P + p[None, :], mask=valid[:, None] & (p < P)[None, :],
                 other=0.0)
    w, decay, diag = _mimo_weights(A, SC, GM, SEG, pid, pid // H, i, i, valid, valid, T, R)
    s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [TRB, TRB]
    dp = tl.dot(dy, tl.trans(x), input_precision="ieee")  # dy_i . x_j
    ds = (dp * w).to(q.dtype)
    dx = tl.dot(tl.trans((s * w).to(dy.dtype)), dy, input_precision="ieee")
    dq = tl.dot(ds, k, input_precision="ieee")
    dk = tl.dot(tl.trans(ds), q, input_precision="ieee")
    qk_mask = valid[:, None] & (n < N)[None, :]
    tl.store(DQ + rows[:, None] * N + n[None, :], dq.to(DQ.dtype.element_ty), mask=qk_mask)
    tl.store(DK + rows[:, None] * N + n[None, :], dk.to(DK.dtype.element_ty), mask=qk_mask)
    tl.store(DX + rows[:, None] * P + p[None, :], dx.to(DX.dtype.element_ty),
             mask=valid[:, None] & (p < P)[None, :])
    # the token scalars: dW = dP * S, reduced to per-row / per-column sums
    dw = dp * s
    sc_j = tl.load(SC + pid * T + i // R, mask=valid, other=0.0)
    g_off = dw * decay * sc_j[None, :]  # dW * W_off
    out = ROWS4 + pid.to(tl.int64) * 4 * TR
    tl.store(out + i, tl.sum(g_off, axis=1), mask=valid)  # d a, rows
    tl.store(out + TR + i, tl.sum(g_off, axis=0), mask=valid)  # -d a, columns
    tl.store(out + 2 * TR + i, tl.sum(dw * decay, axis=0), mask=valid)  # d scale, columns
    tl.store(out + 3 * TR + i, tl.sum(tl.where(diag, dw, 0.0), axis=1), mask=valid)  # d gamma


@triton.jit
def _mimo_pass_fwd(S0, CS, DEC, SIN, SF, NC, PN, BLOCK: tl.constexpr):
    """One (head, tile of the P*N state) a program: walk the chunks, storing the state that
    enters each and the last; s <- decay_c s + chunk_state_c (float32)."""
    bh, tile = tl.program_id(0), tl.program_id(1)
    off = tile * BLOCK + tl.arange(0, BLOCK)
    m = off < PN
    s = tl.load(S0 + bh.to(tl.int64) * PN + off, mask=m, other=0.0)
    for c in range(NC):
        row = (bh.to(tl.int64) * NC + c) * PN
        tl.store(SIN + row + off, s, mask=m)
        s = tl.load(DEC + bh * NC + c) * s + tl.load(CS + row + off, mask=m, other=0.0)
    tl.store(SF + bh.to(tl.int64) * PN + off, s, mask=m)


@triton.jit
def _mimo_pass_bwd(SIN, DEC, DSIN, DSF, DCS, DDEC, DS0, NC, PN, NT, BLOCK: tl.constexpr):
    """The walk backwards: g (the gradient of the state leaving chunk c) gives d chunk_state_c
    = g and the tile's share of d decay_c = sum(g * S_in[c]); then g <- decay_c g +
    d S_in[c], and finally d S0 = g."""
    bh, tile = tl.program_id(0), tl.program_id(1)
    off = tile * BLOCK + tl.arange(0, BLOCK)
    m = off < PN
    g = tl.load(DSF + bh.to(tl.int64) * PN + off, mask=m, other=0.0)
    for i in range(NC):
        c = NC - 1 - i
        row = (bh.to(tl.int64) * NC + c) * PN
        tl.store(DCS + row + off, g, mask=m)
        s_in = tl.load(SIN + row + off, mask=m, other=0.0)
        tl.store(DDEC + (bh * NC + c) * NT + tile, tl.sum(g * s_in, axis=0))
        g = tl.load(DEC + bh * NC + c) * g + tl.load(DSIN + row + off, mask=m, other=0.0)
    tl.store(DS0 + bh.to(tl.int64) * PN + off, g, mask=m)


_PASS_BLOCK = 1024


class _PassFn(torch.autograd.Function):
    """ssm0 [B*H, PN], chunk_state [B*H, C, PN], decay [B*H, C] (float32, contiguous) ->
    the entering states [B*H, C, PN] and the last [B*H, PN]."""

    @staticmethod
    def forward(ctx, state0, cs, dec):
        BH, NC, PN = cs.shape
        s_in, s_final = torch.empty_like(cs), torch.empty_like(state0)
        grid = (BH, triton.cdiv(PN, _PASS_BLOCK))
        _mimo_pass_fwd[grid](state0, cs, dec, s_in, s_final, NC, PN, BLOCK=_PASS_BLOCK,
                             num_warps=4)
        ctx.save_for_backward(s_in, dec)
        return s_in, s_final

    @staticmethod
    def backward(ctx, d_in, d_final):
        s_in, dec = ctx.saved_tensors
        BH, NC, PN = s_in.shape
        NT = triton.cdiv(PN, _PASS_BLOCK)
        d_in = torch.zeros_like(s_in) if d_in is None else d_in.float().contiguous()
        d_final = (torch.zeros(BH, PN, device=s_in.device) if d_final is None
                   else d_final.float().contiguous())
        d_cs, d_state0 = torch.empty_like(s_in), torch.empty_like(d_final)
        d_dec = torch.empty(BH, NC, NT, device=s_in.device, dtype=torch.float32)
        _mimo_pass_bwd[(BH, NT)](s_in, dec, d_in, d_final, d_cs, d_dec, d_state0, NC, PN, NT,
                                 BLOCK=_PASS_BLOCK, num_warps=4)
        return d_state0, d_cs, d_dec.sum(-1)


def _pass_triton(ssm0: Tensor, chunk_state: Tensor, chunk_decay: Tensor
                 ) -> tuple[Tensor, Tensor]:
    """The SISO reference's ``_pass_states`` (same arguments and results: ssm0 [B, H, P, N],
    chunk_state [B, C, H, P, N], chunk_decay [B, C, H]) through the kernels."""
    B, C, H, P, N = chunk_state.shape
    s_in, s_final = _PassFn.apply(
        ssm0.float().reshape(B * H, P * N).contiguous(),
        chunk_state.float().transpose(1, 2).reshape(B * H, C, P * N).contiguous(),
        chunk_decay.float().transpose(1, 2).reshape(B * H, C).contiguous())
    s_in = s_in.reshape(B, H, C, P, N).transpose(1, 2).to(chunk_state.dtype)
    return s_in, s_final.reshape(B, H, P, N).to(chunk_state.dtype)


def _meta(q: Tensor, x: Tensor, rank: int) -> dict:
    TR, N, P = q.shape[-2], q.shape[-1], x.shape[-1]
    config = for_device(CONFIGS, q.device)
    return {"R": rank, "TRB": max(16, next_power_of_2(TR)), "NB": max(16, next_power_of_2(N)),
            "PB": max(16, next_power_of_2(P)), "num_warps": config.num_warps}


class _IntraFn(torch.autograd.Function):
    """q, k [B, C, H, T*R, N], x [B, C, H, T*R, P] (contiguous), a / scale / gamma
    [B, C, H, T] float32, seg [B*C, T] int32 -> y [B, C, H, T*R, P] in x.dtype."""

    @staticmethod
    def forward(ctx, q, k, x, a, scale, gamma, seg, rank: int):
        B, C, H, TR, N = q.shape
        T, P = TR // rank, x.shape[-1]
        y = torch.empty_like(x)
        _mimo_intra_fwd[(B * C * H,)](q, k, x, a, scale, gamma, seg, y, H, T, TR, N, P,
                                 **_meta(q, x, rank))
        ctx.save_for_backward(q, k, x, a, scale, gamma, seg)
        ctx.rank = rank
        return y

    @staticmethod
    def backward(ctx, dy):
        q, k, x, a, scale, gamma, seg = ctx.saved_tensors
        rank = ctx.rank
        B, C, H, TR, N = q.shape
        T, P = TR // rank, x.shape[-1]
        dq, dk, dx = torch.empty_like(q), torch.empty_like(k), torch.empty_like(x)
        rows4 = torch.empty(B, C, H, 4, T, rank, device=q.device, dtype=torch.float32)
        _mimo_intra_bwd[(B * C * H,)](q, k, x, a, scale, gamma, seg, dy.contiguous(), dq, dk, dx,
                                 rows4, H, T, TR, N, P, **_meta(q, x, rank))
        per_token = rows4.sum(-1)  # [B, C, H, 4, T]: each token's R rows summed
        da = per_token[:, :, :, 0] - per_token[:, :, :, 1]
        dscale, dgamma = per_token[:, :, :, 2], per_token[:, :, :, 3]
        return dq, dk, dx, da, dscale, dgamma, None, None


def _intra_triton(q: Tensor, k: Tensor, x: Tensor, a_cs: Tensor, gamma: Tensor, scale: Tensor,
                  seg: Tensor) -> Tensor:
    """reference.py's ``_intra_chunk`` (same arguments and result) through the kernels:
    q, k [B, C, T, R, H, N], x [B, C, T, R, H, P], a_cs [B, C, H, T], gamma and scale
    [B, C, T, H], seg [B, C, T] -> [B, C, T, R, H, P]."""
    B, C, T, R, H, _ = q.shape

    def rows(t: Tensor) -> Tensor:  # [B, C, T, R, H, F] -> [B, C, H, T*R, F]
        return t.permute(0, 1, 4, 2, 3, 5).reshape(B, C, H, T * R, t.shape[-1])

    # q, k, x arrive in float32 (chunked_scan's compute dtype; mamba3_mimo_scan_triton
    # refuses float64)
    y = _IntraFn.apply(
        rows(q).contiguous(), rows(k).contiguous(), rows(x).contiguous(),
        a_cs.float().contiguous(),
        scale.transpose(2, 3).float().contiguous(), gamma.transpose(2, 3).float().contiguous(),
        seg.to(torch.int32).reshape(B * C, T).contiguous(), R)
    return y.to(x.dtype).reshape(B, C, H, T, R, -1).permute(0, 1, 3, 4, 2, 5)


def mamba3_mimo_scan_triton(
    q: Tensor, k: Tensor, v: Tensor, adt: Tensor, dt: Tensor, trap: Tensor,
    q_bias: Tensor, k_bias: Tensor, mimo_v: Tensor, angles: Tensor,
    mimo_z: Tensor | None = None, mimo_o: Tensor | None = None,
    D: Tensor | None = None, z: Tensor | None = None, reset: Tensor | None = None,
    initial_state: Mamba3ScanState | None = None, chunk_size: int = 16,
    output_final_state: bool = True,
) -> tuple[Tensor, Mamba3ScanState | None]:
    """:func:`~megacpp.kernels.ops.mamba3_mimo_scan.reference.mamba3_mimo_scan_chunked` with
    the intra-chunk form in Triton (same arguments and results; the limits in the module
    docstring raise :class:`MegaCppError`)."""
    rows = min(chunk_size, v.shape[1]) * q.shape[2]
    if v.dtype == torch.float64:
        raise MegaCppError("mamba3_mimo_scan triton: float64 is not supported (use the "
                           "reference)")
    if rows > MAX_ROWS or q.shape[-1] > MAX_D_STATE or v.shape[-1] > MAX_HEADDIM:
        raise MegaCppError(
            f"mamba3_mimo_scan triton: needs chunk_size * rank <= {MAX_ROWS}, d_state <= "
            f"{MAX_D_STATE} and headdim <= {MAX_HEADDIM}, got {rows}, {q.shape[-1]} and "
            f"{v.shape[-1]} (lower [mamba] mimo_chunk_size, or use the reference)")
    return chunked_scan(_intra_triton, _pass_triton, q, k, v, adt, dt, trap, q_bias, k_bias,
                        mimo_v, angles, mimo_z, mimo_o, D, z, reset, initial_state, chunk_size,
                        output_final_state)
