"""The expert GEMMs of the MoE in Triton, grouped over each expert's rows, with operands read
through tensor-memory descriptors (sm90+; same contracts as the torch._grouped_mm forms in
:mod:`megacpp.kernels.ops.moe_experts.grouped`, their truth). Launch settings and where each
kernel serves: ``configs.py``.

* :func:`grouped_wgrad_triton` -- the expert weight gradients ``dW_e = A[rows_e]^T
  B[rows_e]``: K is each expert's row count, known only on the device. torch._grouped_mm does
  it in bf16 (its only output dtype) with CUTLASS 128x256 tiles, and under autocast autograd
  then casts dW to the float32 master weights' dtype in a kernel of its own. This kernel
  writes dW in the master weights' dtype straight from its float32 accumulator (no bf16
  rounding of the gradient, no cast), and lets the caller put the narrow side of the product
  on the tile's M (``transpose_out``).
* :func:`grouped_mm_triton` -- ``out[rows_e] = a[rows_e] @ W_e`` (or ``W_e^T``): the
  forward's gate|up and down projections and their input gradients. M is each expert's row
  count, known only on the device: each program finds its expert and row block from the group
  ends (no host sync; the grid is the upper bound cdiv(rows, BLOCK_M) + experts, programs
  past the last tile return). a's descriptor is [rows, K] (columns past K read as zeros), W's
  [E, *, *] (rows past its K read as zeros: a block never reads the next expert's weights); a
  row block that runs past its expert's end computes rows it does not store.
* :func:`grouped_swiglu_triton` -- gate|up with the weighted SwiGLU in the epilogue: the
  hidden of :func:`~megacpp.kernels.ops.moe_experts.swiglu.swiglu_weighted_triton` from the
  stored gate|up, bit for bit, without that pass over gate|up.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from megacpp.kernels.device import capability, cdiv, next_power_of_2, sm_count
from megacpp.kernels.launch import for_device
from megacpp.kernels.ops.moe_experts.configs import CONFIGS, MoEConfig, Tile
from megacpp.kernels.ops.moe_experts.swiglu import _weighted_swiglu


# -- the expert weight gradients: grouped GEMMs over each expert's rows (ragged K) --------------
def wgrad_setting(m: int, n: int, experts: int, sms: int, settings: tuple[Tile, ...]) -> Tile:
    """The launch setting whose tiles cover the output in the fewest waves of area: the cost of
    a setting is ceil(tiles / SMs) * tile area (each wave takes as long as its largest tile);
    ties keep the larger tile, which runs its wgmma at a better rate. On an H100 (132 SMs) the
    step's dw_out (M 272, N 768, 16 experts) takes 2 waves of 128x256 tiles, the second one
    nearly empty (144 tiles), or 2 waves of 64x256 ones: 45.1 vs 57.7 us; where the waves tie
    (dw_in, the e64 / e16 cases) 128x256 was 6-9% faster."""
    def cost(tile: Tile) -> int:
        bm, bn = tile.block_m, tile.block_n
        return cdiv(cdiv(m, bm) * cdiv(n, bn) * experts, sms) * bm * bn
    return min(settings, key=cost)  # min keeps the first of equals


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


def _descriptor_operands_ok(a: Tensor, b: Tensor) -> bool:
    """What both expert-GEMM kernels need of their operands: 16-bit, one dtype, rows of whole
    16 bytes; a GPU with tensor-memory loads (sm90+) or the interpreter in float16 (Triton
    3.6's CPU interpreter loads bf16 through a tensor descriptor wrongly: values off by ~1e9
    where float16 and float32 are exact; the torch path serves bf16 there)."""
    if a.dtype != b.dtype or a.dtype not in (torch.bfloat16, torch.float16):
        return False
    if a.shape[-1] % 8 or b.shape[-1] % 8:
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return a.dtype == torch.float16
    return a.is_cuda and capability(a.device) >= (9, 0)


def wgrad_triton_ok(a: Tensor, b: Tensor, config: MoEConfig | None = None) -> bool:
    """Whether the MoE backward hands these operands to :func:`grouped_wgrad_triton`: the
    config has settings for it (``wgrad``) and :func:`_descriptor_operands_ok`."""
    config = config or for_device(CONFIGS, a.device)
    return bool(config.wgrad) and _descriptor_operands_ok(a, b)


def grouped_wgrad_triton(a: Tensor, b: Tensor, offs: Tensor, out_dtype: torch.dtype,
                         transpose_out: bool = False, config: MoEConfig | None = None
                         ) -> Tensor:
    """a [R, M], b [R, N] (rows grouped by expert), offs [E] int32 group ends -> [E, M, N] in
    ``out_dtype``: a[rows_e]^T @ b[rows_e] per expert, float32 accumulation (zeros for an
    expert without rows). ``transpose_out``: the same products stored as [E, N, M].
    Operands must pass :func:`wgrad_triton_ok`."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    config = config or for_device(CONFIGS, a.device)
    a, b = a.contiguous(), b.contiguous()
    (_, m), n, experts = a.shape, b.shape[1], offs.numel()
    out = torch.empty((experts, n, m) if transpose_out else (experts, m, n), device=a.device,
                      dtype=out_dtype)
    s_m, s_n = (1, m) if transpose_out else (n, 1)
    sms = sm_count(a.device) if a.is_cuda else 1  # the interpreter: one program at a time
    tile = wgrad_setting(m, n, experts, sms, config.wgrad)
    bm, bn, bk = tile.block_m, tile.block_n, tile.block_k
    grid = (cdiv(m, bm) * cdiv(n, bn), experts)
    _wgrad_kernel[grid](
        TensorDescriptor.from_tensor(a, [bk, bm]), TensorDescriptor.from_tensor(b, [bk, bn]),
        out, offs, m, n, out.stride(0), s_m, s_n, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=tile.num_warps, num_stages=tile.num_stages)
    return out


# -- the expert GEMMs: grouped over each expert's rows (ragged M) ---------------------------------
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


def grouped_mm_ok(a: Tensor, w: Tensor, trans_b: bool, config: MoEConfig | None = None
                  ) -> bool:
    """Whether the MoE hands ``a @ w[e]`` (``trans_b``: w[e]^T) to :func:`grouped_mm_triton`: a
    launch setting for its (N, K) in the config's ``grouped``, a 3-D w, and
    :func:`_descriptor_operands_ok`."""
    config = config or for_device(CONFIGS, a.device)
    return _serves(config.grouped, a, w, 1 if trans_b else 2)


def grouped_mm_triton(a: Tensor, w: Tensor, offs: Tensor, trans_b: bool,
                      config: MoEConfig | None = None) -> Tensor:
    """a [R, K] (rows grouped by expert), w [E, K, N] (``trans_b``: [E, N, K]), offs [E] int32
    group ends -> [R, N] in a's dtype: a[rows_e] @ w[e] (w[e]^T), float32 accumulation; rows
    past offs[-1] are left unwritten. Operands must pass :func:`grouped_mm_ok`."""
    config = config or for_device(CONFIGS, a.device)
    n = w.shape[1] if trans_b else w.shape[2]
    return _grouped_mm(a, w, offs, trans_b, config.grouped[(n, a.shape[1])])[0]


def grouped_swiglu_ok(a: Tensor, w_in: Tensor, config: MoEConfig | None = None) -> bool:
    """Whether the MoE's gate|up GEMM ``a @ w_in[e]^T`` takes the SwiGLU in its epilogue
    (:func:`grouped_swiglu_triton`): a setting for its (2F, K) in the config's ``swiglu`` and
    the plain kernel's conditions."""
    config = config or for_device(CONFIGS, a.device)
    return _serves(config.swiglu, a, w_in, 1)


def _serves(settings, a: Tensor, w: Tensor, n_dim: int) -> bool:
    """A 3-D w, a launch setting in ``settings`` for (N, K) = (w's dim ``n_dim``, a's
    columns), and :func:`_descriptor_operands_ok`."""
    if w.dim() != 3 or (w.shape[n_dim], a.shape[1]) not in settings:
        return False
    return _descriptor_operands_ok(a, w)


def grouped_swiglu_triton(a: Tensor, w_in: Tensor, offs: Tensor, w_sorted: Tensor,
                          config: MoEConfig | None = None) -> tuple[Tensor, Tensor]:
    """The gate|up GEMM and the weighted SwiGLU in one kernel: a [R, K] (rows grouped by
    expert), w_in [E, 2F, K] (gate rows, then up rows), offs [E] int32 group ends, w_sorted
    [R] routing weights -> gate|up [R, 2F] = a[rows_e] @ w_in[e]^T (float32 accumulation,
    stored in a's dtype) and hidden [R, F] = silu(gate) * up * w_sorted of those stored
    values: what :func:`grouped_mm_triton` then
    :func:`~megacpp.kernels.ops.moe_experts.swiglu.swiglu_weighted_triton` return.
    Operands must pass :func:`grouped_swiglu_ok`."""
    config = config or for_device(CONFIGS, a.device)
    tile = config.swiglu[(w_in.shape[1], a.shape[1])]
    return _grouped_mm(a, w_in, offs, True, tile, w_sorted.contiguous())


def _grouped_mm(a: Tensor, w: Tensor, offs: Tensor, trans_b: bool, tile: Tile,
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
    bm, bn, bk = tile.block_m, tile.block_n, tile.block_k
    w_block = [1, bn, bk] if trans_b else [1, bk, bn]
    grid = (cdiv(n // 2 if swiglu else n, bn) * (cdiv(rows, bm) + experts),)
    _grouped_mm_kernel[grid](
        TensorDescriptor.from_tensor(a, [bm, bk]), TensorDescriptor.from_tensor(w, w_block),
        out, offs, w_sorted if swiglu else offs, hidden if swiglu else out, experts, n, k,
        out.stride(0), hidden.stride(0) if swiglu else 0, TRANS_B=trans_b, BLOCK_M=bm,
        BLOCK_N=bn, BLOCK_K=bk, E_PAD=max(16, next_power_of_2(experts)), SWIGLU=swiglu,
        num_warps=tile.num_warps, num_stages=tile.num_stages)
    return out, hidden
