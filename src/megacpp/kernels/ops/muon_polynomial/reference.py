"""Newton-Schulz's polynomial in plain PyTorch (cuBLAS products): the truth the symmetric
Triton kernel is tested against, and what runs on CPU and under
``MEGACPP_KERNELS=reference``.

``P = a I + b A + c A A`` of a batch of symmetric Gram matrices A [batch, m, m]
(``A = X X^T`` in a Newton-Schulz iteration), a new tensor in A's dtype; optionally with the
normalization of X folded in (``normalize_eps``). No gradient flows through it.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Quintic Newton-Schulz coefficients of Jordan's Muon (a, b, c): chosen to maximise the slope
# at 0, so small singular values grow fast; the result lands in roughly [0.7, 1.2], not 1.
NS_COEFFS = (3.4445, -4.7750, 2.0315)


def muon_polynomial_reference(gram: Tensor, a: float, b: float, c: float,
                              normalize_eps: float | None = None) -> Tensor:
    """``a I + b A + c A A`` per matrix of ``gram`` [..., m, m]: the product and ``b A`` in
    one GEMM (``baddbmm`` copies A into its output first, then scales it in the GEMM's
    epilogue), then ``a`` added to the m diagonal elements.

    ``normalize_eps``: ``gram`` is X X^T of an X not yet normalized. Each matrix's
    ``s = 1 / (sqrt(trace A) + eps)`` (trace A = ||X||_F^2) scales A to the normalized X's
    Gram matrix ``s^2 A`` first, and the result after: ``P = s (a I + b s^2 A + c s^4 A A)``,
    so ``P X`` is the polynomial of the normalized X times it (Newton-Schulz's first step)."""
    shape = gram.shape
    flat = gram.reshape(-1, *shape[-2:])  # baddbmm takes exactly 3-D
    scale = None
    if normalize_eps is not None:
        trace = flat.diagonal(dim1=-2, dim2=-1).sum(-1, dtype=torch.promote_types(
            flat.dtype, torch.float32))
        scale = 1 / (trace.sqrt() + normalize_eps)
        flat = (flat * (scale * scale)[:, None, None]).to(gram.dtype)
    poly = torch.baddbmm(flat, flat, flat, beta=b, alpha=c)
    poly.diagonal(dim1=-2, dim2=-1).add_(a)
    if scale is not None:
        poly = (poly * scale[:, None, None]).to(gram.dtype)
    return poly.reshape(shape)
