"""Triton kernels for the memory-bound steps around the grouped expert GEMMs.

* :func:`plan_indices_triton` -- token of each expert-sorted row and the inverse permutation,
  one pass over the sort order.
* :func:`gather_rows_triton` -- the permute (and the combine's backward): rows of x by token.
* :func:`gather_sum_triton` -- the combine (and the backward of the permute): each token sums
  its ``k`` rows of the expert-sorted tensor, read through the inverse permutation, in float32.
  One pass, deterministic, no atomics and no [T*k, D] temporary.
* :func:`swiglu_weighted_triton` -- ``silu(gate) * up * w`` over the grouped GEMM's [N, 2F]
  output, the routing weight folded in before the down projection.
* :func:`swiglu_weighted_backward_triton` -- d(gate|up) and the routing weight's gradient
  (a row reduction) in one pass, recomputing the activation from gate|up.

Same contracts as the plain-PyTorch versions in :mod:`megacpp.kernels.ops.moe.grouped`, which
are the truth these are tested against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _plan_kernel(ORDER, TOKEN_OF, INV, n, K: tl.constexpr, BLOCK: tl.constexpr):
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = p < n
    pair = tl.load(ORDER + p, mask=mask, other=0)
    tl.store(TOKEN_OF + p, pair // K, mask=mask)
    tl.store(INV + pair, p.to(tl.int64), mask=mask)  # the inverse permutation (a scatter)


def plan_indices_triton(order: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """order [N] (sorted row -> pair) -> token_of [N] = order // k, inv [N] = order^-1."""
    n = order.numel()
    token_of, inv = torch.empty_like(order), torch.empty_like(order)
    _plan_kernel[(triton.cdiv(n, 1024),)](order, token_of, inv, n, K=k, BLOCK=1024)
    return token_of, inv


@triton.jit
def _gather_rows_kernel(SRC, IDX, OUT, n_rows, n_cols, BLOCK_R: tl.constexpr,
                        BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = rows < n_rows
    src_rows = tl.load(IDX + rows, mask=row_ok, other=0).to(tl.int64)
    mask = row_ok[:, None] & (cols < n_cols)[None, :]
    vals = tl.load(SRC + src_rows[:, None] * n_cols + cols[None, :], mask=mask)
    tl.store(OUT + rows.to(tl.int64)[:, None] * n_cols + cols[None, :], vals, mask=mask)


def gather_rows_triton(src: Tensor, idx: Tensor) -> Tensor:
    """src [T, D], idx [N] -> [N, D] = src[idx] (the permute, and the combine's backward)."""
    n_rows, n_cols = idx.numel(), src.shape[1]
    out = torch.empty(n_rows, n_cols, device=src.device, dtype=src.dtype)
    block_c = min(triton.next_power_of_2(n_cols), 1024)
    block_r = max(1, 4096 // block_c)
    grid = (triton.cdiv(n_rows, block_r), triton.cdiv(n_cols, block_c))
    _gather_rows_kernel[grid](src.contiguous(), idx, out, n_rows, n_cols, BLOCK_R=block_r,
                              BLOCK_C=block_c, num_warps=4)
    return out


@triton.jit
def _gather_sum_kernel(SRC, INV, OUT, n_cols, K: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    acc = tl.zeros((BLOCK,), tl.float32)
    for j in tl.static_range(K):
        row = tl.load(INV + token * K + j).to(tl.int64)
        acc += tl.load(SRC + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + token.to(tl.int64) * n_cols + cols, acc.to(OUT.dtype.element_ty), mask=mask)


def gather_sum_triton(src: Tensor, inv: Tensor) -> Tensor:
    """src [N, D] (N = T*k rows in expert order), inv [T, k] row of each (token, choice)
    -> [T, D] = sum_j src[inv[t, j]], float32 sums."""
    n_tokens, k = inv.shape
    n_cols = src.shape[1]
    out = torch.empty(n_tokens, n_cols, device=src.device, dtype=src.dtype)
    block = min(triton.next_power_of_2(n_cols), 2048)
    grid = (n_tokens, triton.cdiv(n_cols, block))
    _gather_sum_kernel[grid](src.contiguous(), inv.contiguous(), out, n_cols, K=k, BLOCK=block,
                             num_warps=4)
    return out


@triton.jit
def _swiglu_fwd_kernel(GU, W, H, n_rows, ffn, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    w = tl.load(W + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    gu_row = GU + rows.to(tl.int64)[:, None] * (2 * ffn)
    h_row = H + rows.to(tl.int64)[:, None] * ffn
    for start in range(0, ffn, BLOCK_F):
        cols = start + tl.arange(0, BLOCK_F)[None, :]
        mask = row_ok[:, None] & (cols < ffn)
        gate = tl.load(gu_row + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gu_row + ffn + cols, mask=mask, other=0.0).to(tl.float32)
        act = gate * tl.sigmoid(gate) * up * w
        tl.store(h_row + cols, act.to(H.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(GU, W, DH, DGU, DW, n_rows, ffn, BLOCK_R: tl.constexpr,
                       BLOCK_F: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    w = tl.load(W + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    gu_row = GU + rows.to(tl.int64)[:, None] * (2 * ffn)
    dgu_row = DGU + rows.to(tl.int64)[:, None] * (2 * ffn)
    dh_row = DH + rows.to(tl.int64)[:, None] * ffn
    dw = tl.zeros((BLOCK_R,), tl.float32)
    for start in range(0, ffn, BLOCK_F):
        cols = start + tl.arange(0, BLOCK_F)[None, :]
        mask = row_ok[:, None] & (cols < ffn)
        gate = tl.load(gu_row + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gu_row + ffn + cols, mask=mask, other=0.0).to(tl.float32)
        dh = tl.load(dh_row + cols, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        silu = gate * sig
        dw += tl.sum(dh * silu * up, axis=1)
        dact = dh * w
        dgate = dact * up * sig * (1.0 + gate * (1.0 - sig))
        tl.store(dgu_row + cols, dgate.to(DGU.dtype.element_ty), mask=mask)
        tl.store(dgu_row + ffn + cols, (dact * silu).to(DGU.dtype.element_ty), mask=mask)
    tl.store(DW + rows, dw, mask=row_ok)


def _row_blocks(ffn: int) -> tuple[int, int]:
    block_f = min(triton.next_power_of_2(ffn), 512)
    return max(1, 4096 // block_f), block_f


def swiglu_weighted_triton(gate_up: Tensor, w: Tensor) -> Tensor:
    """gate_up [N, 2F], w [N] -> [N, F] = silu(gate) * up * w (float32 math)."""
    n_rows, ffn = gate_up.shape[0], gate_up.shape[1] // 2
    h = torch.empty(n_rows, ffn, device=gate_up.device, dtype=gate_up.dtype)
    block_r, block_f = _row_blocks(ffn)
    _swiglu_fwd_kernel[(triton.cdiv(n_rows, block_r),)](
        gate_up.contiguous(), w.contiguous(), h, n_rows, ffn, BLOCK_R=block_r, BLOCK_F=block_f,
        num_warps=8)
    return h


def swiglu_weighted_backward_triton(gate_up: Tensor, w: Tensor, dh: Tensor) -> tuple[Tensor, Tensor]:
    """-> d gate_up [N, 2F] (gate_up.dtype), dw [N] float32 = sum_f dh * silu(gate) * up."""
    n_rows, ffn = gate_up.shape[0], gate_up.shape[1] // 2
    dgate_up = torch.empty_like(gate_up)
    dw = torch.empty(n_rows, device=gate_up.device, dtype=torch.float32)
    block_r, block_f = _row_blocks(ffn)
    _swiglu_bwd_kernel[(triton.cdiv(n_rows, block_r),)](
        gate_up.contiguous(), w.contiguous(), dh.contiguous(), dgate_up, dw, n_rows, ffn,
        BLOCK_R=block_r, BLOCK_F=block_f, num_warps=8)
    return dgate_up, dw
