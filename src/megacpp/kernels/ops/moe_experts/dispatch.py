"""The MoE's dispatch and combine in Triton, no host sync (same contracts as the
plain-PyTorch versions in :mod:`megacpp.kernels.ops.moe_experts.grouped`, their truth):

* :func:`plan_triton` -- the dispatch plan as a stable counting sort in two launches (no
  sort, no searchsorted, no host sync), for up to 256 experts: per-block expert counts, then
  each block's rows scattered to ``expert start + rows of that expert in earlier blocks +
  rank in this block``, writing the sort order, the inverse permutation, the routing weights
  in sorted order and the grouped GEMM's group ends.
* :func:`scatter_rows_triton` -- the permute (and the combine's backward): each token's row
  read once, in token order, and written to its ``k`` sorted rows through the inverse
  permutation.
* :func:`gather_sum_triton` -- the combine (and the backward of the permute): each token sums
  its ``k`` rows of the expert-sorted tensor, read through the inverse permutation, in float32.
  One pass, deterministic, no atomics and no [T*k, D] temporary.

Launch settings: ``configs.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from megacpp.kernels.device import cdiv, next_power_of_2
from megacpp.kernels.launch import for_device
from megacpp.kernels.ops.moe_experts.common import _bound, _const
from megacpp.kernels.ops.moe_experts.configs import CONFIGS, MoEConfig

MAX_PLAN_EXPERTS = 256  # the counting sort keeps one [rows, experts] one-hot tile in registers


# -- dispatch plan: a stable counting sort --------------------------------------------------------
@triton.jit
def _expert_counts_kernel(IDS, COUNTS, n, E_PAD: tl.constexpr, BLOCK: tl.constexpr,
                          SUB: tl.constexpr):
    pid = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    acc = tl.zeros((E_PAD,), tl.int32)
    for s in range(0, BLOCK, SUB):
        p = pid * BLOCK + s + tl.arange(0, SUB)
        e = tl.load(IDS + p, mask=p < n, other=-1).to(tl.int32)  # [SUB]; -1 counts nowhere
        acc += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
    tl.store(COUNTS + pid * E_PAD + experts, acc)


@triton.jit
def _plan_scatter_kernel(IDS, W, COUNTS, ORDER, INV, W_SORTED, OFFS, n, n_blocks, n_experts,
                         E_PAD: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr,
                         RB: tl.constexpr, NB_CONST: tl.constexpr):
    pid = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    total = tl.zeros((E_PAD,), tl.int32)  # rows of each expert, all blocks
    before = tl.zeros((E_PAD,), tl.int32)  # rows of each expert in blocks before this one
    for b0 in range(0, _bound(n_blocks, NB_CONST), RB):
        b = b0 + tl.arange(0, RB)
        tile = tl.load(COUNTS + b[:, None] * E_PAD + experts[None, :],
                       mask=(b < n_blocks)[:, None], other=0)  # [RB, E_PAD]
        total += tl.sum(tile, axis=0)
        before += tl.sum(tl.where((b < pid)[:, None], tile, 0), axis=0)
    ends = tl.cumsum(total, axis=0)  # group ends of the grouped GEMM
    tl.store(OFFS + experts, ends, mask=(experts < n_experts) & (pid == 0))
    base = ends - total + before  # [E_PAD] first sorted row of this block's rows of each expert
    for s in range(0, BLOCK, SUB):
        p = pid * BLOCK + s + tl.arange(0, SUB)
        e = tl.load(IDS + p, mask=p < n, other=-1).to(tl.int32)  # [SUB]
        hit = e[:, None] == experts[None, :]  # [SUB, E_PAD] one-hot
        rank = tl.cumsum(hit.to(tl.int32), axis=0)  # inclusive rank within the expert
        pos = tl.sum(tl.where(hit, base[None, :] + rank - 1, 0), axis=1)  # [SUB] sorted row
        base += tl.sum(hit.to(tl.int32), axis=0)
        ok = (p < n) & (e >= 0) & (e < E_PAD)  # an id out of range writes nothing
        pair = p.to(tl.int64)
        pos64 = pos.to(tl.int64)
        tl.store(ORDER + pos64, pair, mask=ok)
        tl.store(INV + pair, pos64, mask=ok)
        w = tl.load(W + p, mask=ok, other=0.0).to(tl.float32)
        tl.store(W_SORTED + pos64, w, mask=ok)


def plan_triton(expert_idx: Tensor, weights: Tensor, n_experts: int,
                config: MoEConfig | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """expert_idx [T, k] (ids in [0, E), E <= 256), weights [T, k] -> order [N], inv [T, k]
    (int64), offs [E] int32 (group ends), w_sorted [N] float32; N = T * k.
    Stable: rows of one expert keep their (token, choice) order. ``config``: the launch
    settings (default: ``configs.CONFIGS`` for the device)."""
    if n_experts > MAX_PLAN_EXPERTS:
        raise ValueError(f"plan_triton takes at most {MAX_PLAN_EXPERTS} experts, got {n_experts}")
    n = expert_idx.numel()
    if n >= 2**31:
        raise ValueError(f"plan_triton needs fewer than 2**31 (token, choice) pairs, got {n}")
    # the kernels index the flat [T * k] pairs of the [T, k] tensors (no reshape or detach:
    # host time before the first GEMM; contiguous() returns a contiguous tensor itself)
    ids, w = expert_idx.contiguous(), weights.contiguous()
    config = config or for_device(CONFIGS, ids.device)
    block = config.plan_block
    e_pad = max(16, next_power_of_2(n_experts))
    sub = min(block, max(16, 8192 // e_pad))
    n_blocks = cdiv(n, block)
    idx64 = torch.empty(2, n, device=ids.device, dtype=torch.int64)  # order, inv
    buf32 = torch.empty(n_blocks * e_pad + e_pad, device=ids.device, dtype=torch.int32)
    counts, offs = buf32[: n_blocks * e_pad], buf32[n_blocks * e_pad:][:n_experts]
    w_sorted = torch.empty(n, device=ids.device, dtype=torch.float32)
    _expert_counts_kernel[(n_blocks,)](ids, counts, n, E_PAD=e_pad, BLOCK=block, SUB=sub,
                                       num_warps=config.plan_warps)
    _plan_scatter_kernel[(n_blocks,)](
        ids, w, counts, idx64[0], idx64[1], w_sorted, offs, n, n_blocks, n_experts, E_PAD=e_pad,
        BLOCK=block, SUB=sub, RB=max(1, 4096 // e_pad), NB_CONST=_const(n_blocks),
        num_warps=config.plan_warps)
    return idx64[0], idx64[1].view(expert_idx.shape), offs, w_sorted


# -- the row scatter (the permute) and the gather-sum (the combine) -------------------------------
@triton.jit
def _scatter_rows_kernel(SRC, INV, OUT, n_tokens, n_cols, K: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_C: tl.constexpr, C_CONST: tl.constexpr):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_ok = tokens < n_tokens
    src = SRC + tokens.to(tl.int64)[:, None] * n_cols
    inv = INV + tokens.to(tl.int64) * K  # [BLOCK_T] first of each token's k sorted rows
    for c0 in range(0, _bound(n_cols, C_CONST), BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)[None, :]
        mask = token_ok[:, None] & (cols < n_cols)
        tile = tl.load(src + cols, mask=mask)  # read once, written k times
        for j in tl.static_range(K):
            row = tl.load(inv + j, mask=token_ok, other=0).to(tl.int64)
            tl.store(OUT + row[:, None] * n_cols + cols, tile, mask=mask)


def scatter_rows_triton(src: Tensor, inv: Tensor, config: MoEConfig | None = None) -> Tensor:
    """src [T, D], inv [T, k] (a permutation of the N = T*k sorted rows) -> [N, D] with
    out[inv[t, j]] = src[t] (the permute, and the combine's backward)."""
    config = config or for_device(CONFIGS, src.device)
    n_tokens, k = inv.shape
    n_cols = src.shape[1]
    out = torch.empty(n_tokens * k, n_cols, device=src.device, dtype=src.dtype)
    block_c = min(next_power_of_2(n_cols), config.scatter_cols)
    _scatter_rows_kernel[(cdiv(n_tokens, config.scatter_tokens),)](
        src.contiguous(), inv.contiguous(), out, n_tokens, n_cols, K=k,
        BLOCK_T=config.scatter_tokens, BLOCK_C=block_c, C_CONST=_const(n_cols),
        num_warps=config.scatter_warps)
    return out


@triton.jit
def _gather_sum_kernel(SRC, INV, ADD, OUT, n_cols, K: tl.constexpr, BLOCK: tl.constexpr,
                       HAS_ADD: tl.constexpr):
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    if HAS_ADD:  # the addend's row starts the float32 sum
        acc = tl.load(ADD + token.to(tl.int64) * n_cols + cols, mask=mask, other=0.0)
        acc = acc.to(tl.float32)
    else:
        acc = tl.zeros((BLOCK,), tl.float32)
    for j in tl.static_range(K):
        row = tl.load(INV + token * K + j).to(tl.int64)
        acc += tl.load(SRC + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + token.to(tl.int64) * n_cols + cols, acc.to(OUT.dtype.element_ty), mask=mask)


def gather_sum_triton(src: Tensor, inv: Tensor, addend: Tensor | None = None,
                      config: MoEConfig | None = None) -> Tensor:
    """src [N, D] (N = T*k rows in expert order), inv [T, k] row of each (token, choice)
    -> [T, D] = sum_j src[inv[t, j]] (+ addend[t], [T, D] any float dtype), float32 sums."""
    config = config or for_device(CONFIGS, src.device)
    n_tokens, k = inv.shape
    n_cols = src.shape[1]
    out = torch.empty(n_tokens, n_cols, device=src.device, dtype=src.dtype)
    block = min(next_power_of_2(n_cols), config.gather_block)
    grid = (n_tokens, cdiv(n_cols, block))
    has_add = addend is not None
    add = addend.reshape(n_tokens, n_cols).contiguous() if has_add else out
    _gather_sum_kernel[grid](src.contiguous(), inv.contiguous(), add, out, n_cols, K=k,
                             BLOCK=block, HAS_ADD=has_add, num_warps=config.gather_warps)
    return out
