"""Muon's two elementwise passes as one Triton launch each over all of a batch's parameters,
and Newton-Schulz's symmetric polynomial (below, after the passes).

The foreach reference makes six passes over float32 tensors the size of the Muon parameters
(momentum: scale the buffer, add the gradient, form the Nesterov update; apply: decay the
weights, scale the update by lr, add it) plus a cast of the update into the Newton-Schulz
dtype and one of its result back to float32. At nam56r-350m (324M Muon parameters) that is
~25 GB a step, ~8 ms of an H100's bandwidth. Here:

* ``muon_momentum_triton`` reads buffer and gradient once, writes the buffer and the update,
  the update straight into the Newton-Schulz input in its dtype (bf16): 4.6 GB; it also takes
  the clipping coefficient (``grad_scale``), so the trainer's clip need not rewrite the
  gradients first (another 2.6 GB);
* ``muon_apply_triton`` reads the weights and the bf16 orthogonalized update, writes the
  weights: 3.3 GB.

Each launch covers a list of tensors of different sizes through a table of their addresses
(int64, device) -- one program per (block of a tensor, tensor) -- as a multi-tensor apply does.
One table per launch is copied from pinned host memory and kept with the optimizer state (``tables``): a
CUDA graph captures that copy, and its replays copy the same addresses again (the graph's
tensors never move). Same arithmetic as the reference in float32; products may fuse into
FMAs, so results agree to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from megacpp.kernels.device import cdiv
from megacpp.kernels.ops.muon.reference import check_grad_scale, muon_polynomial_reference

BLOCK, NUM_WARPS = 4096, 8


@triton.jit
def _momentum(TABLE, OUT, SCALE, n_tensors, momentum, NESTEROV: tl.constexpr,
              HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    # TABLE [4, n_tensors]: buffer addresses, gradient addresses, element counts, out offsets;
    # SCALE (HAS_SCALE): one float32 every gradient is multiplied by (the clipping coefficient)
    BUFS, GRADS = TABLE, TABLE + n_tensors
    NUMELS, OUT_OFFSETS = TABLE + 2 * n_tensors, TABLE + 3 * n_tensors
    t = tl.program_id(1)
    n = tl.load(NUMELS + t)
    buf = tl.load(BUFS + t).to(tl.pointer_type(tl.float32))
    grad = tl.load(GRADS + t).to(tl.pointer_type(tl.float32))
    out = OUT + tl.load(OUT_OFFSETS + t)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    g = tl.load(grad + offs, mask=live)
    if HAS_SCALE:
        g = g * tl.load(SCALE)
    b = tl.load(buf + offs, mask=live) * momentum + g
    tl.store(buf + offs, b, mask=live)
    if NESTEROV:
        b = g + momentum * b
    tl.store(out + offs, b.to(OUT.dtype.element_ty), mask=live)


@triton.jit
def _apply(TABLE, ORTHO, n_tensors, LR, lr_value, weight_decay, scale,
           LR_ON_DEVICE: tl.constexpr, BLOCK: tl.constexpr):
    # TABLE [3, n_tensors]: parameter addresses, element counts, offsets into ORTHO
    PARAMS, NUMELS, ORTHO_OFFSETS = TABLE, TABLE + n_tensors, TABLE + 2 * n_tensors
    t = tl.program_id(1)
    n = tl.load(NUMELS + t)
    param = tl.load(PARAMS + t).to(tl.pointer_type(tl.float32))
    ortho = ORTHO + tl.load(ORTHO_OFFSETS + t)
    lr = lr_value
    if LR_ON_DEVICE:
        lr = tl.load(LR).to(tl.float32)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    p = tl.load(param + offs, mask=live)
    o = tl.load(ortho + offs, mask=live).to(tl.float32)
    tl.store(param + offs, p * (1 - lr * weight_decay) - scale * (lr * o), mask=live)


def _check(name: str, tensors: list[Tensor]) -> None:
    for t in tensors:
        if t.dtype != torch.float32 or not t.is_contiguous() or not t.is_cuda:
            raise ValueError(f"{name}: the fused Muon passes take contiguous float32 CUDA "
                             f"tensors, got {t.dtype} {tuple(t.shape)} on {t.device}"
                             f"{'' if t.is_contiguous() else ' (not contiguous)'}")


def _table(rows: list[list[int]], device: torch.device, keep: list[Tensor]) -> Tensor:
    """``rows`` (addresses, element counts, offsets) as one contiguous int64 [len(rows), n]
    on ``device``, copied from pinned memory; the pinned source goes into ``keep``, alive as
    long as whoever captured the copy."""
    host = torch.tensor(rows, dtype=torch.int64).pin_memory()
    keep.append(host)
    return host.to(device, non_blocking=True)


def _offsets(tensors: list[Tensor]) -> list[int]:
    starts, total = [], 0
    for t in tensors:
        starts.append(total)
        total += t.numel()
    return starts


def _check_stacked(name: str, stacked: Tensor, tensors: list[Tensor]) -> None:
    total = sum(t.numel() for t in tensors)
    if not stacked.is_contiguous() or stacked.numel() != total:
        raise ValueError(f"{name}: a contiguous tensor of {total} elements, got "
                         f"{tuple(stacked.shape)}")


def _grid(tensors: list[Tensor]) -> tuple[int, int]:
    return cdiv(max(t.numel() for t in tensors), BLOCK), len(tensors)


def muon_momentum_triton(bufs: list[Tensor], grads: list[Tensor], momentum: float,
                         nesterov: bool, out: Tensor | None = None,
                         keep: list[Tensor] | None = None,
                         grad_scale: Tensor | None = None) -> list[Tensor]:
    """As :func:`~megacpp.kernels.ops.muon.reference.muon_momentum_reference`, one launch
    (``grad_scale`` is read on the device, inside the launch)."""
    _check("momentum buffers", bufs)
    _check("gradients", grads)
    if grad_scale is not None:
        check_grad_scale(grad_scale, grads[0].device)
    if out is None:
        out = bufs[0].new_empty(sum(b.numel() for b in bufs))
    _check_stacked("out", out, bufs)
    starts = _offsets(bufs)
    table = _table([[b.data_ptr() for b in bufs], [g.data_ptr() for g in grads],
                    [b.numel() for b in bufs], starts], out.device,
                   [] if keep is None else keep)
    _momentum[_grid(bufs)](table, out, out if grad_scale is None else grad_scale,  # (unread)
                           len(bufs), momentum, NESTEROV=nesterov,
                           HAS_SCALE=grad_scale is not None, BLOCK=BLOCK, num_warps=NUM_WARPS)
    flat = out.view(-1)
    return [flat[s:s + b.numel()].view(b.shape) for s, b in zip(starts, bufs, strict=True)]


def muon_apply_triton(params: list[Tensor], ortho: Tensor, lr: float | Tensor,
                      weight_decay: float, scale: float,
                      keep: list[Tensor] | None = None) -> None:
    """As :func:`~megacpp.kernels.ops.muon.reference.muon_apply_reference`, one launch;
    ``ortho`` is the stacked Newton-Schulz result (any float dtype, contiguous)."""
    _check("parameters", params)
    _check_stacked("ortho", ortho, params)
    table = _table([[p.data_ptr() for p in params], [p.numel() for p in params],
                    _offsets(params)], ortho.device, [] if keep is None else keep)
    on_device = isinstance(lr, Tensor)
    _apply[_grid(params)](table, ortho, len(params), lr if on_device else ortho,  # not read
                          0.0 if on_device else float(lr), float(weight_decay), float(scale),
                          LR_ON_DEVICE=on_device, BLOCK=BLOCK, num_warps=NUM_WARPS)


# -- Newton-Schulz's polynomial ---------------------------------------------------------------
# ``P = a I + b A + c A A`` of symmetric Gram matrices. Each Newton-Schulz iteration forms
# ``A = X X^T``, then ``P``, then ``X = P X``. cuBLAS forms P as ``torch.baddbmm(A, A, A,
# beta=b, alpha=c)``, which first copies A into P's buffer, then a separate pass adds ``a`` to
# the diagonal. Here one launch forms P:
#
# * A is symmetric, so P is too. Each program computes one [BM, BM] tile (i, j) with i <= j
#   (about half of A A's products) and stores it twice, at (i, j) and transposed at (j, i).
# * The right operand's columns A[:, j] are read as rows of A (A[k, j] = A[j, k]). So both
#   operands come through one tensor-memory (TMA) descriptor over A [batch, m, m] in row-major
#   [BM, BK] blocks. A block past a matrix's edge reads zeros, never the next matrix.
# * The epilogue adds ``b A`` (from A's own tile) and ``a`` on the diagonal in float32. P is
#   then rounded once (cuBLAS rounds twice: ``baddbmm``'s result, then the diagonal add).
# * Newton-Schulz's first step passes ``normalize_eps``: A is then the Gram matrix of the
#   update before its normalization, and each program sums its matrix's diagonal
#   (||X||_F^2) and scales the coefficients. The iteration needs no norm or division pass
#   over X (1.26 ms of nam56r-350m's Muon step on an H100: the broadcast division alone
#   0.91 ms).
#
# The input must be symmetric (a Gram matrix). Calls this kernel cannot take run the reference:
# an m that is not a multiple of 8 (TMA needs rows of whole 16 bytes), a non-contiguous input,
# or an empty batch. The Triton backend's requirements cover the rest (sm90+, bf16/fp16).
#
# Launch setting: BM 128, BK 64, 4 warps, 3 stages. This was the fastest of 14 settings, or
# within 2% of it, at every nam56r-350m Muon shape on an H100, swept in
# ``benchmarks/results/kernels/h100_s30/ns_probe2.py``. At the MoE experts' 391 x [544, 544]
# it took 305 us per call against cuBLAS's 515.
POLY_LAUNCH = {"BM": 128, "BK": 64, "num_warps": 4, "num_stages": 3}


@triton.jit
def _upper(t, NT):
    """(i, j), i <= j: the t-th tile on or above the diagonal of an NT x NT grid, by rows."""
    i = 0
    rem = t
    while rem >= NT - i:
        rem -= NT - i
        i += 1
    return i, i + rem


@triton.jit
def _polynomial(A, A_PTR, P, M, NT, ca, cb, cc, eps, BM: tl.constexpr, BK: tl.constexpr,
                NORMALIZE: tl.constexpr):
    # grid (tiles on and above the diagonal, batch): a matrix's tiles run side by side in L2.
    # A: descriptor over [batch, M, M], [1, BM, BK] blocks; A_PTR: the same memory (epilogue)
    i, j = _upper(tl.program_id(0), NT)
    b = tl.program_id(1)
    base = b.to(tl.int64) * M * M
    if NORMALIZE:  # s = 1 / (sqrt(trace A) + eps): every program sums its matrix's diagonal
        trace = tl.zeros((1024,), dtype=tl.float32)
        for d0 in range(0, M, 1024):
            d = d0 + tl.arange(0, 1024)
            trace += tl.load(A_PTR + base + d * (M + 1), mask=d < M, other=0.0).to(tl.float32)
        s = 1 / (tl.sqrt(tl.sum(trace, axis=0)) + eps)
        ca = ca * s
        cb = cb * s * s * s
        cc = cc * s * s * s * s * s
    acc = tl.zeros((BM, BM), dtype=tl.float32)
    for k0 in range(0, M, BK):
        left = A.load([b, i * BM, k0]).reshape(BM, BK)
        right = A.load([b, j * BM, k0]).reshape(BM, BK)  # rows j of A: its columns j
        acc = tl.dot(left, right.T, acc)
    ri = i * BM + tl.arange(0, BM)
    rj = j * BM + tl.arange(0, BM)
    live = (ri[:, None] < M) & (rj[None, :] < M)
    a_ij = tl.load(A_PTR + base + ri[:, None] * M + rj[None, :], mask=live, other=0.0)
    val = cc * acc + cb * a_ij.to(tl.float32) + tl.where(ri[:, None] == rj[None, :], ca, 0.0)
    val = val.to(P.dtype.element_ty)
    tl.store(P + base + ri[:, None] * M + rj[None, :], val, mask=live)
    if i != j:
        tl.store(P + base + rj[:, None] * M + ri[None, :], val.T,
                 mask=(rj[:, None] < M) & (ri[None, :] < M))


def polynomial_triton_ok(gram: Tensor) -> bool:
    """Whether :func:`muon_polynomial_triton` launches its kernel for ``gram`` (else it runs
    the reference): a contiguous 3-D CUDA tensor, m a multiple of 8, at least one matrix."""
    return (gram.is_cuda and gram.ndim == 3 and gram.is_contiguous() and gram.shape[0] > 0
            and gram.shape[-1] == gram.shape[-2] and gram.shape[-1] % 8 == 0
            and gram.data_ptr() % 16 == 0)


def muon_polynomial_triton(gram: Tensor, a: float, b: float, c: float,
                           normalize_eps: float | None = None) -> Tensor:
    """As :func:`~megacpp.kernels.ops.muon.reference.muon_polynomial_reference` for a
    symmetric ``gram`` [batch, m, m]: one launch, half the A A products; with
    ``normalize_eps`` each program forms its matrix's scale from the diagonal and folds it
    into the coefficients (a s, b s^3, c s^5)."""
    if not polynomial_triton_ok(gram):
        return muon_polynomial_reference(gram, a, b, c, normalize_eps)
    from triton.tools.tensor_descriptor import TensorDescriptor

    batch, m, _ = gram.shape
    bm, bk = POLY_LAUNCH["BM"], POLY_LAUNCH["BK"]
    out = torch.empty_like(gram)
    nt = cdiv(m, bm)
    _polynomial[(nt * (nt + 1) // 2, batch)](
        TensorDescriptor.from_tensor(gram, [1, bm, bk]), gram, out, m, nt, float(a), float(b),
        float(c), float(normalize_eps or 0.0), BM=bm, BK=bk, NORMALIZE=normalize_eps is not None,
        num_warps=POLY_LAUNCH["num_warps"],
        num_stages=POLY_LAUNCH["num_stages"])
    return out
