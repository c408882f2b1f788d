"""Triton kernels for the memory-bound steps around the grouped expert GEMMs.

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
* :func:`swiglu_weighted_triton` -- ``silu(gate) * up * w`` over the grouped GEMM's [N, 2F]
  output, the routing weight folded in before the down projection.
* :func:`swiglu_weighted_backward_triton` -- d(gate|up) and the routing weight's gradient
  (a row reduction, written straight to its (token, choice) slot) in one pass, recomputing
  the activation from gate|up.
* :func:`grouped_wgrad_triton` -- the expert weight gradients, ``a[rows_e]^T b[rows_e]`` per
  expert (a GEMM whose K is each expert's row count), written in the master weights' dtype.
* :func:`grouped_mm_triton` -- the expert GEMMs ``a[rows_e] @ W_e`` (or ``W_e^T``) at the
  shapes where it measured faster than ``torch._grouped_mm``.

Same contracts as the plain-PyTorch versions in :mod:`megacpp.kernels.ops.moe_experts.grouped`, which
are the truth these are tested against.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from megacpp.kernels.device import capability, cdiv, next_power_of_2, sm_count

MAX_PLAN_EXPERTS = 256  # the counting sort keeps one [rows, experts] one-hot tile in registers
PLAN_BLOCK = 1024  # (token, choice) pairs per program of the two plan kernels
# H100 sweep 2026-11-22: e64 115 us vs the gather's 162, e16 41 vs 51
SCATTER_TOKENS = 16  # source rows (tokens) per program of the row scatter
SCATTER_COLS = 1024  # columns per inner step of the row scatter
SCATTER_WARPS = 8


def _const(n: int) -> int:
    """A loop bound as a constexpr under the CPU interpreter (whose runtime scalars cannot bound
    a Python range under numpy 2), else 0: the kernel then loops to the runtime value."""
    return n if os.environ.get("TRITON_INTERPRET") == "1" else 0


@triton.jit
def _bound(n, N_CONST: tl.constexpr):
    if N_CONST > 0:
        return N_CONST
    else:
        return n


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


def plan_triton(expert_idx: Tensor, weights: Tensor, n_experts: int
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """expert_idx [T, k] (ids in [0, E), E <= 256), weights [T, k] -> order [N], inv [T, k]
    (int64), offs [E] int32 (group ends), w_sorted [N] float32; N = T * k.
    Stable: rows of one expert keep their (token, choice) order."""
    if n_experts > MAX_PLAN_EXPERTS:
        raise ValueError(f"plan_triton takes at most {MAX_PLAN_EXPERTS} experts, got {n_experts}")
    n = expert_idx.numel()
    if n >= 2**31:
        raise ValueError(f"plan_triton needs fewer than 2**31 (token, choice) pairs, got {n}")
    # the kernels index the flat [T * k] pairs of the [T, k] tensors (no reshape or detach:
    # host time before the first GEMM; contiguous() returns a contiguous tensor itself)
    ids, w = expert_idx.contiguous(), weights.contiguous()
    e_pad = max(16, next_power_of_2(n_experts))
    sub = min(PLAN_BLOCK, max(16, 8192 // e_pad))
    n_blocks = cdiv(n, PLAN_BLOCK)
    idx64 = torch.empty(2, n, device=ids.device, dtype=torch.int64)  # order, inv
    buf32 = torch.empty(n_blocks * e_pad + e_pad, device=ids.device, dtype=torch.int32)
    counts, offs = buf32[: n_blocks * e_pad], buf32[n_blocks * e_pad:][:n_experts]
    w_sorted = torch.empty(n, device=ids.device, dtype=torch.float32)
    _expert_counts_kernel[(n_blocks,)](ids, counts, n, E_PAD=e_pad, BLOCK=PLAN_BLOCK, SUB=sub,
                                       num_warps=4)
    _plan_scatter_kernel[(n_blocks,)](
        ids, w, counts, idx64[0], idx64[1], w_sorted, offs, n, n_blocks, n_experts, E_PAD=e_pad,
        BLOCK=PLAN_BLOCK, SUB=sub, RB=max(1, 4096 // e_pad), NB_CONST=_const(n_blocks),
        num_warps=4)
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


def scatter_rows_triton(src: Tensor, inv: Tensor) -> Tensor:
    """src [T, D], inv [T, k] (a permutation of the N = T*k sorted rows) -> [N, D] with
    out[inv[t, j]] = src[t] (the permute, and the combine's backward)."""
    n_tokens, k = inv.shape
    n_cols = src.shape[1]
    out = torch.empty(n_tokens * k, n_cols, device=src.device, dtype=src.dtype)
    block_c = min(next_power_of_2(n_cols), SCATTER_COLS)
    _scatter_rows_kernel[(cdiv(n_tokens, SCATTER_TOKENS),)](
        src.contiguous(), inv.contiguous(), out, n_tokens, n_cols, K=k, BLOCK_T=SCATTER_TOKENS,
        BLOCK_C=block_c, C_CONST=_const(n_cols), num_warps=SCATTER_WARPS)
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


def gather_sum_triton(src: Tensor, inv: Tensor, addend: Tensor | None = None) -> Tensor:
    """src [N, D] (N = T*k rows in expert order), inv [T, k] row of each (token, choice)
    -> [T, D] = sum_j src[inv[t, j]] (+ addend[t], [T, D] any float dtype), float32 sums."""
    n_tokens, k = inv.shape
    n_cols = src.shape[1]
    out = torch.empty(n_tokens, n_cols, device=src.device, dtype=src.dtype)
    block = min(next_power_of_2(n_cols), 2048)
    grid = (n_tokens, cdiv(n_cols, block))
    has_add = addend is not None
    add = addend.reshape(n_tokens, n_cols).contiguous() if has_add else out
    _gather_sum_kernel[grid](src.contiguous(), inv.contiguous(), add, out, n_cols, K=k,
                             BLOCK=block, HAS_ADD=has_add, num_warps=4)
    return out


@triton.jit
def _weighted_swiglu(gate, up, w):
    """silu(gate) * up * w in float32 (the forward kernel's and the gate|up epilogue's one
    formula, so the two give the same hidden bit for bit)."""
    gate = gate.to(tl.float32)
    return gate * tl.sigmoid(gate) * up.to(tl.float32) * w


@triton.jit
def _swiglu_fwd_kernel(GU, W, H, n_rows, ffn, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr,
                       F_CONST: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    w = tl.load(W + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    gu_row = GU + rows.to(tl.int64)[:, None] * (2 * ffn)
    h_row = H + rows.to(tl.int64)[:, None] * ffn
    for start in range(0, _bound(ffn, F_CONST), BLOCK_F):
        cols = start + tl.arange(0, BLOCK_F)[None, :]
        mask = row_ok[:, None] & (cols < ffn)
        gate = tl.load(gu_row + cols, mask=mask, other=0.0)
        up = tl.load(gu_row + ffn + cols, mask=mask, other=0.0)
        act = _weighted_swiglu(gate, up, w)
        tl.store(h_row + cols, act.to(H.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(GU, W, DH, ORDER, DGU, DW, n_rows, ffn, BLOCK_R: tl.constexpr,
                       BLOCK_F: tl.constexpr, F_CONST: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    w = tl.load(W + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    gu_row = GU + rows.to(tl.int64)[:, None] * (2 * ffn)
    dgu_row = DGU + rows.to(tl.int64)[:, None] * (2 * ffn)
    dh_row = DH + rows.to(tl.int64)[:, None] * ffn
    dw = tl.zeros((BLOCK_R,), tl.float32)
    for start in range(0, _bound(ffn, F_CONST), BLOCK_F):
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
    slot = tl.load(ORDER + rows, mask=row_ok, other=0)  # sorted row -> (token, choice)
    tl.store(DW + slot, dw.to(DW.dtype.element_ty), mask=row_ok)


def _row_blocks(ffn: int) -> tuple[int, int]:
    block_f = min(next_power_of_2(ffn), 512)
    return max(1, 4096 // block_f), block_f


def swiglu_weighted_triton(gate_up: Tensor, w: Tensor) -> Tensor:
    """gate_up [N, 2F], w [N] -> [N, F] = silu(gate) * up * w (float32 math)."""
    n_rows, ffn = gate_up.shape[0], gate_up.shape[1] // 2
    h = torch.empty(n_rows, ffn, device=gate_up.device, dtype=gate_up.dtype)
    block_r, block_f = _row_blocks(ffn)
    _swiglu_fwd_kernel[(cdiv(n_rows, block_r),)](
        gate_up.contiguous(), w.contiguous(), h, n_rows, ffn, BLOCK_R=block_r, BLOCK_F=block_f,
        F_CONST=_const(ffn), num_warps=8)
    return h


def swiglu_weighted_backward_triton(gate_up: Tensor, w: Tensor, dh: Tensor, order: Tensor,
                                    dw_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """gate_up [N, 2F], w [N], dh [N, F], order [N] (sorted row -> (token, choice) slot)
    -> d gate_up [N, 2F] (gate_up.dtype), dweights [N] in slot order (``dw_dtype``) =
    sum_f dh * silu(gate) * up, float32 sums."""
    n_rows, ffn = gate_up.shape[0], gate_up.shape[1] // 2
    dgate_up = torch.empty_like(gate_up)
    dweights = torch.empty(n_rows, device=gate_up.device, dtype=dw_dtype)
    block_r, block_f = _row_blocks(ffn)
    _swiglu_bwd_kernel[(cdiv(n_rows, block_r),)](
        gate_up.contiguous(), w.contiguous(), dh.contiguous(), order, dgate_up, dweights, n_rows,
        ffn, BLOCK_R=block_r, BLOCK_F=block_f, F_CONST=_const(ffn), num_warps=8)
    return dgate_up, dweights


# -- the expert weight gradients: grouped GEMMs over each expert's rows (ragged K) --------------
# dW_e = A[rows_e]^T B[rows_e] for every expert e: K is each expert's row count, known only on
# the device. torch._grouped_mm does it in bf16 (its only output dtype) with CUTLASS 128x256
# tiles; under autocast autograd then casts dW to the float32 master weights' dtype in a kernel
# of its own. This kernel writes dW in the master weights' dtype straight from its float32
# accumulator (no bf16 rounding of the gradient, no cast), and lets the caller put the narrow
# side of the product on the tile's M (transpose_out). Launch settings: _wgrad_config.
# On an H100 (benchmarks/results/kernels/s18/call_a_h100) it beats torch._grouped_mm + cast at
# every shape measured: the step's dw_in 64.9 vs 102.8 us, e64/e16 dw_in 534/525 vs 666/648.
WGRAD_CONFIGS = (  # the first is the default; the second only where it fills the waves better
    {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4},
    {"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4},
)
WGRAD_ON_GPU = True


def _wgrad_config(m: int, n: int, experts: int, sms: int) -> dict:
    """The launch setting whose tiles cover the output in the fewest waves of area: the cost of
    a setting is ceil(tiles / SMs) * tile area (each wave takes as long as its largest tile);
    ties keep the larger tile, which runs its wgmma at a better rate. On an H100 (132 SMs) the
    step's dw_out (M 272, N 768, 16 experts) takes 2 waves of 128x256 tiles, the second one
    nearly empty (144 tiles), or 2 waves of 64x256 ones: 45.1 vs 57.7 us; where the waves tie
    (dw_in, the e64 / e16 cases) 128x256 was 6-9% faster (s18/call_a_h100)."""
    def cost(cfg: dict) -> int:
        bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
        return cdiv(cdiv(m, bm) * cdiv(n, bn) * experts, sms) * bm * bn
    return min(WGRAD_CONFIGS, key=cost)  # min keeps the first of equals


@triton.jit
def _wgrad_kernel(A, B, C, OFFS, M, N, s_ce, s_cm, s_cn, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of C[e] = A[rows_e]^T B[rows_e] (grid: (tiles, experts);
    a tile's m index runs fastest, so neighbouring programs share the expert's rows in L2).
    A, B: tensor descriptors over the [R, M] / [R, N] row-major operands, [BLOCK_K, BLOCK_*]
    blocks; rows_e = [OFFS[e - 1], OFFS[e]). Full K blocks go straight from the loads to the
    product; the last, partial one is masked (its rows past the expert's end belong to the
    next expert). An expert without rows stores zeros."""
    tile, e = tl.program_id(0), tl.program_id(1)
    tiles_m = tl.cdiv(M, BLOCK_M)
    m0 = (tile % tiles_m) * BLOCK_M
    n0 = (tile // tiles_m) * BLOCK_N
    start = tl.load(OFFS + e - 1, mask=e > 0, other=0)
    end = tl.load(OFFS + e)
    full = (end - start) // BLOCK_K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(full):
        k0 = start + i * BLOCK_K
        acc = tl.dot(A.load([k0, m0]).T, B.load([k0, n0]), acc)
    k0 = start + full * BLOCK_K
    if k0 < end:
        live = (k0 + tl.arange(0, BLOCK_K) < end)[:, None]
        a = A.load([k0, m0])
        b = B.load([k0, n0])
        acc = tl.dot(tl.where(live, a, tl.zeros_like(a)).T, tl.where(live, b, tl.zeros_like(b)),
                     acc)
    om = m0 + tl.arange(0, BLOCK_M)
    on = n0 + tl.arange(0, BLOCK_N)
    ptr = C + e.to(tl.int64) * s_ce + om[:, None] * s_cm + on[None, :] * s_cn
    tl.store(ptr, acc.to(C.dtype.element_ty), mask=(om < M)[:, None] & (on < N)[None, :])


def _descriptor_operands_ok(a: Tensor, b: Tensor, on_gpu: bool) -> bool:
    """What both expert-GEMM kernels need of their operands: 16-bit, one dtype, rows of whole
    16 bytes; a GPU with tensor-memory loads (sm90+, and ``on_gpu``, the kernel's switch) or
    the interpreter in float16 (Triton 3.6's CPU interpreter loads bf16 through a tensor
    descriptor wrongly: values off by ~1e9 where float16 and float32 are exact; the torch path
    serves bf16 there)."""
    if a.dtype != b.dtype or a.dtype not in (torch.bfloat16, torch.float16):
        return False
    if a.shape[-1] % 8 or b.shape[-1] % 8:
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return a.dtype == torch.float16
    return on_gpu and a.is_cuda and capability(a.device) >= (9, 0)


def wgrad_triton_ok(a: Tensor, b: Tensor) -> bool:
    """Whether the MoE backward hands these operands to :func:`grouped_wgrad_triton`
    (:func:`_descriptor_operands_ok`, switched by ``WGRAD_ON_GPU``)."""
    return _descriptor_operands_ok(a, b, WGRAD_ON_GPU)


def grouped_wgrad_triton(a: Tensor, b: Tensor, offs: Tensor, out_dtype: torch.dtype,
                         transpose_out: bool = False) -> Tensor:
    """a [R, M], b [R, N] (rows grouped by expert), offs [E] int32 group ends -> [E, M, N] in
    ``out_dtype``: a[rows_e]^T @ b[rows_e] per expert, float32 accumulation (zeros for an
    expert without rows). ``transpose_out``: the same products stored as [E, N, M].
    Operands must pass :func:`wgrad_triton_ok`."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    a, b = a.contiguous(), b.contiguous()
    (_, m), n, experts = a.shape, b.shape[1], offs.numel()
    out = torch.empty((experts, n, m) if transpose_out else (experts, m, n), device=a.device,
                      dtype=out_dtype)
    s_m, s_n = (1, m) if transpose_out else (n, 1)
    sms = sm_count(a.device) if a.is_cuda else 1  # the interpreter: one program at a time
    cfg = _wgrad_config(m, n, experts, sms)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    grid = (cdiv(m, bm) * cdiv(n, bn), experts)
    _wgrad_kernel[grid](
        TensorDescriptor.from_tensor(a, [bk, bm]), TensorDescriptor.from_tensor(b, [bk, bn]),
        out, offs, m, n, out.stride(0), s_m, s_n, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


# -- the expert GEMMs: grouped over each expert's rows (ragged M) ---------------------------------
# out[rows_e] = a[rows_e] @ W_e (or W_e^T) for every expert e: the forward's gate|up and down
# projections and their input gradients. M is each expert's row count, known only on the device:
# each program finds its expert and row block from the group ends (no host sync; the grid is
# the upper bound cdiv(rows, BLOCK_M) + experts, programs past the last tile return). The
# operands are tensor descriptors: a's [rows, K] (columns past K read as zeros), W's [E, *, *]
# (rows past its K read as zeros: a block never reads the next expert's weights); a row block
# that runs past its expert's end computes rows it does not store.
# It serves only the (N, K) shapes where an H100 probe measured it faster than torch._grouped_mm
# (CUTLASS) in the same process (benchmarks/results/kernels/h100_s20, grouped_mm_probe run 1 and
# 2); every other shape stays on torch._grouped_mm. At the nam56r step's 32768 rows (16
# experts): gate|up (N 544, K 768) 72.5 vs 82.2 us, d hidden (N 272, K 768) 51.3 vs 62.8; at
# the e64_k8 bench case's d hidden (N 512, K 1024, 131072 rows) 241.5 vs 268.0. Where it lost or
# tied (down with K 272: 63.4 vs 56.2; dx, N 768 K 544: 67.7 vs 70.0, run 1 72.1 vs 71.6; the
# e16_k2 shapes) it is not used. Two programs of 4 warps per SM (3 stages of 128 x 128 x 64,
# 96 KiB of shared memory) beat one of 8 warps or 4 stages at the step's shapes.
_TILE_4W = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}
GROUPED_CONFIGS = {  # (N, K) -> launch setting
    (544, 768): _TILE_4W,
    (272, 768): _TILE_4W,
    (512, 1024): {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4},
}
# gate|up with the SwiGLU in the epilogue (grouped_swiglu_triton), (2F, K) -> launch setting:
# BLOCK_N hidden columns per program, i.e. BLOCK_N gate and BLOCK_N up columns in two
# accumulators, with the same results bit for bit. On an H100, timed as CUDA graphs of 10 calls
# against torch._grouped_mm then the SwiGLU kernel (benchmarks/results/kernels/h100_s24, call 4,
# with receipt): the nam56r step's shape 80.6 vs 106.4 us, e16_k2 (2F 4096, d 1024) 553.6 vs
# 598.1, e64_k8 (2F 1024, d 1024) 606.8 vs 600.4 (level; session 23's back-to-back timing had
# 557.5 vs 592.5 and its bench rows replayed 1-3% faster with it). Every other setting tried
# there and in sessions 22-23 was slower: 256-row blocks, K blocks of 32 / 128, 4 warps, 2 or
# 4 stages, 32 / 128 columns per program
_SWIGLU_64 = {**_TILE_4W, "BLOCK_N": 64, "num_warps": 8}
SWIGLU_CONFIGS = {
    (544, 768): _SWIGLU_64,
    (1024, 1024): _SWIGLU_64,
    (4096, 1024): _SWIGLU_64,
}
GROUPED_ON_GPU = True


@triton.jit
def _grouped_mm_kernel(A, B, C, OFFS, WS, H, E, N, K, s_cm, s_hm, TRANS_B: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       E_PAD: tl.constexpr, SWIGLU: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of C[rows_e] = A[rows_e] @ W_e (TRANS_B: W_e^T), grid
    (n tiles * row-block bound): the n index runs fastest, so neighbouring programs share the
    row block in L2. A: descriptor over [rows, K], [BLOCK_M, BLOCK_K] blocks; B: over W
    [E, K, N] ([1, BLOCK_K, BLOCK_N]) or, TRANS_B, [E, N, K] ([1, BLOCK_N, BLOCK_K]);
    rows_e = [OFFS[e - 1], OFFS[e]).
    SWIGLU (TRANS_B; W_e = [gate; up], F = N / 2 rows each): the tile is BLOCK_N hidden
    columns j, gate columns j and up columns F + j in two accumulators; both are stored in C
    (gate|up, as without) and H[:, j] = silu(gate) * up * WS[row] from their rounded values,
    as _swiglu_fwd_kernel reads them back (the same hidden, without that pass over gate|up)."""
    tiles_n = tl.cdiv(N // 2 if SWIGLU else N, BLOCK_N)
    pid_m = tl.program_id(0) // tiles_n
    n0 = (tl.program_id(0) % tiles_n) * BLOCK_N
    e = tl.arange(0, E_PAD)
    ends = tl.load(OFFS + e, mask=e < E, other=0)
    starts = tl.load(OFFS + e - 1, mask=(e > 0) & (e < E), other=0)
    blocks = tl.where(e < E, tl.cdiv(ends - starts, BLOCK_M), 0)
    last = tl.cumsum(blocks, axis=0)  # row blocks up to and including expert e
    if pid_m < tl.sum(blocks, axis=0):
        expert = tl.sum((last <= pid_m).to(tl.int32), axis=0)
        mine = e == expert
        first = tl.sum(tl.where(mine, last - blocks, 0), axis=0)
        end = tl.sum(tl.where(mine, ends, 0), axis=0)
        m0 = tl.sum(tl.where(mine, starts, 0), axis=0) + (pid_m - first) * BLOCK_M
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if SWIGLU:
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = A.load([m0, k0])
            if TRANS_B:
                b = B.load([expert, n0, k0]).reshape(BLOCK_N, BLOCK_K)
                acc = tl.dot(a, b.T, acc)
                if SWIGLU:
                    b_up = B.load([expert, N // 2 + n0, k0]).reshape(BLOCK_N, BLOCK_K)
                    acc_up = tl.dot(a, b_up.T, acc_up)
            else:
                b = B.load([expert, k0, n0]).reshape(BLOCK_K, BLOCK_N)
                acc = tl.dot(a, b, acc)
        rm = tl.arange(0, BLOCK_M)
        on = n0 + tl.arange(0, BLOCK_N)
        row_ok = m0 + rm < end
        # 64-bit only in the tile's base: per-element 64-bit offsets of a 128 x 256 tile spill
        c_tile = C + m0.to(tl.int64) * s_cm + (rm[:, None] * s_cm + on[None, :])
        if SWIGLU:
            mask = row_ok[:, None] & (on < N // 2)[None, :]
            gate = acc.to(C.dtype.element_ty)
            up = acc_up.to(C.dtype.element_ty)
            tl.store(c_tile, gate, mask=mask)
            tl.store(c_tile + N // 2, up, mask=mask)
            w = tl.load(WS + m0 + rm, mask=row_ok, other=0.0).to(tl.float32)[:, None]
            hidden = _weighted_swiglu(gate, up, w)
            tl.store(H + m0.to(tl.int64) * s_hm + (rm[:, None] * s_hm + on[None, :]),
                     hidden.to(H.dtype.element_ty), mask=mask)
        else:
            tl.store(c_tile, acc.to(C.dtype.element_ty),
                     mask=row_ok[:, None] & (on < N)[None, :])


def grouped_mm_ok(a: Tensor, w: Tensor, trans_b: bool) -> bool:
    """Whether the MoE hands ``a @ w[e]`` (``trans_b``: w[e]^T) to :func:`grouped_mm_triton`: a
    launch setting for its (N, K) in ``GROUPED_CONFIGS``, a 3-D w, and
    :func:`_descriptor_operands_ok` (switched by ``GROUPED_ON_GPU``)."""
    return _serves(GROUPED_CONFIGS, a, w, 1 if trans_b else 2)


def grouped_mm_triton(a: Tensor, w: Tensor, offs: Tensor, trans_b: bool) -> Tensor:
    """a [R, K] (rows grouped by expert), w [E, K, N] (``trans_b``: [E, N, K]), offs [E] int32
    group ends -> [R, N] in a's dtype: a[rows_e] @ w[e] (w[e]^T), float32 accumulation; rows
    past offs[-1] are left unwritten. Operands must pass :func:`grouped_mm_ok`."""
    n = w.shape[1] if trans_b else w.shape[2]
    return _grouped_mm(a, w, offs, trans_b, GROUPED_CONFIGS[(n, a.shape[1])])[0]


def grouped_swiglu_ok(a: Tensor, w_in: Tensor) -> bool:
    """Whether the MoE's gate|up GEMM ``a @ w_in[e]^T`` takes the SwiGLU in its epilogue
    (:func:`grouped_swiglu_triton`): a setting for its (2F, K) in ``SWIGLU_CONFIGS`` and the
    plain kernel's conditions."""
    return _serves(SWIGLU_CONFIGS, a, w_in, 1)


def _serves(configs: dict, a: Tensor, w: Tensor, n_dim: int) -> bool:
    """A 3-D w, a launch setting in ``configs`` for (N, K) = (w's dim ``n_dim``, a's
    columns), and :func:`_descriptor_operands_ok` (switched by ``GROUPED_ON_GPU``)."""
    if w.dim() != 3 or (w.shape[n_dim], a.shape[1]) not in configs:
        return False
    return _descriptor_operands_ok(a, w, GROUPED_ON_GPU)


def grouped_swiglu_triton(a: Tensor, w_in: Tensor, offs: Tensor, w_sorted: Tensor
                          ) -> tuple[Tensor, Tensor]:
    """The gate|up GEMM and the weighted SwiGLU in one kernel: a [R, K] (rows grouped by
    expert), w_in [E, 2F, K] (gate rows, then up rows), offs [E] int32 group ends, w_sorted
    [R] routing weights -> gate|up [R, 2F] = a[rows_e] @ w_in[e]^T (float32 accumulation,
    stored in a's dtype) and hidden [R, F] = silu(gate) * up * w_sorted of those stored
    values: what :func:`grouped_mm_triton` then :func:`swiglu_weighted_triton` return.
    Operands must pass :func:`grouped_swiglu_ok`."""
    cfg = SWIGLU_CONFIGS[(w_in.shape[1], a.shape[1])]
    return _grouped_mm(a, w_in, offs, True, cfg, w_sorted.contiguous())


def _grouped_mm(a: Tensor, w: Tensor, offs: Tensor, trans_b: bool, cfg: dict,
                w_sorted: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """Launch _grouped_mm_kernel: the product, and with ``w_sorted`` (trans_b) the SwiGLU's
    hidden."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    a, w = a.contiguous(), w.contiguous()
    rows, k = a.shape
    experts = w.shape[0]
    n = w.shape[1] if trans_b else w.shape[2]
    out = torch.empty(rows, n, device=a.device, dtype=a.dtype)
    swiglu = w_sorted is not None
    hidden = torch.empty(rows, n // 2, device=a.device, dtype=a.dtype) if swiglu else None
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    w_block = [1, bn, bk] if trans_b else [1, bk, bn]
    grid = (cdiv(n // 2 if swiglu else n, bn) * (cdiv(rows, bm) + experts),)
    _grouped_mm_kernel[grid](
        TensorDescriptor.from_tensor(a, [bm, bk]), TensorDescriptor.from_tensor(w, w_block),
        out, offs, w_sorted if swiglu else offs, hidden if swiglu else out, experts, n, k,
        out.stride(0), hidden.stride(0) if swiglu else 0, TRANS_B=trans_b, BLOCK_M=bm,
        BLOCK_N=bn, BLOCK_K=bk, E_PAD=max(16, next_power_of_2(experts)), SWIGLU=swiglu,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out, hidden
