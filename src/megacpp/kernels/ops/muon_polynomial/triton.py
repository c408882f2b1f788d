"""Newton-Schulz's polynomial ``P = a I + b A + c A A`` of symmetric Gram matrices in one
Triton launch.

Each Newton-Schulz iteration forms ``A = X X^T``, then ``P``, then ``X = P X``. cuBLAS forms
P as ``torch.baddbmm(A, A, A, beta=b, alpha=c)``, which first copies A into P's buffer, then a
separate pass adds ``a`` to the diagonal. Here one launch forms P:

* A is symmetric, so P is too. Each program computes one [BM, BM] tile (i, j) with i <= j
  (about half of A A's products) and stores it twice, at (i, j) and transposed at (j, i).
* The right operand's columns A[:, j] are read as rows of A (A[k, j] = A[j, k]). So both
  operands come through one tensor-memory (TMA) descriptor over A [batch, m, m] in row-major
  [BM, BK] blocks. A block past a matrix's edge reads zeros, never the next matrix.
* The epilogue adds ``b A`` (from A's own tile) and ``a`` on the diagonal in float32. P is
  then rounded once (cuBLAS rounds twice: ``baddbmm``'s result, then the diagonal add).
* Newton-Schulz's first step passes ``normalize_eps``: A is then the Gram matrix of the
  update before its normalization, and each program sums its matrix's diagonal
  (||X||_F^2) and scales the coefficients. The iteration needs no norm or division pass
  over X (1.26 ms of nam56r-350m's Muon step on an H100: the broadcast division alone
  0.91 ms).

The input must be symmetric (a Gram matrix). Calls this kernel cannot take run the reference:
an m that is not a multiple of 8 (TMA needs rows of whole 16 bytes), a non-contiguous input,
or an empty batch. The Triton backend's requirements cover the rest (sm90+, bf16/fp16).
Launch settings: ``configs.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from megacpp.kernels.device import cdiv
from megacpp.kernels.launch import for_device
from megacpp.kernels.ops.muon_polynomial.configs import CONFIGS, PolynomialConfig
from megacpp.kernels.ops.muon_polynomial.reference import muon_polynomial_reference


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
                           normalize_eps: float | None = None,
                           config: PolynomialConfig | None = None) -> Tensor:
    """As :func:`~megacpp.kernels.ops.muon_polynomial.reference.muon_polynomial_reference` for a
    symmetric ``gram`` [batch, m, m]: one launch, half the A A products; with
    ``normalize_eps`` each program forms its matrix's scale from the diagonal and folds it
    into the coefficients (a s, b s^3, c s^5)."""
    if not polynomial_triton_ok(gram):
        return muon_polynomial_reference(gram, a, b, c, normalize_eps)
    from triton.tools.tensor_descriptor import TensorDescriptor

    config = config or for_device(CONFIGS, gram.device)
    batch, m, _ = gram.shape
    bm, bk = config.block_m, config.block_k
    out = torch.empty_like(gram)
    nt = cdiv(m, bm)
    _polynomial[(nt * (nt + 1) // 2, batch)](
        TensorDescriptor.from_tensor(gram, [1, bm, bk]), gram, out, m, nt, float(a), float(b),
        float(c), float(normalize_eps or 0.0), BM=bm, BK=bk, NORMALIZE=normalize_eps is not None,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out
