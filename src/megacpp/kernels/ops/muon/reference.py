"""Muon's two elementwise passes in plain PyTorch (``torch._foreach_*``) and Newton-Schulz's
polynomial (cuBLAS products): the truth the fused kernels are tested against, and what runs
on CPU, on sharded (DTensor) parameters and under ``MEGACPP_KERNELS=reference``.

* momentum: ``buf = momentum * buf + grad``; the update is ``grad + momentum * buf``
  (Nesterov) or ``buf``, written into ``out`` [sum of matrices, rows, cols] (the Newton-Schulz
  input, in its dtype) matrix by matrix in parameter order, or returned when ``out`` is None.
  With ``grad_scale`` (a one-element float32 tensor on the gradients' device: the trainer's
  clipping coefficient) every ``grad`` above is ``grad * grad_scale``, and the gradients
  themselves are left as they are.
* apply: ``p = p * (1 - lr * weight_decay) - scale * (lr * ortho)`` with ``ortho`` [matrices,
  rows, cols] split over the parameters in the same order (decoupled weight decay, then the
  RMS-matched orthogonalized step). ``lr`` is a float, or a device tensor while a CUDA graph
  is captured.

* polynomial: ``P = a I + b A + c A A`` of a batch of symmetric Gram matrices A [batch, m, m]
  (``A = X X^T`` in a Newton-Schulz iteration), a new tensor in A's dtype; optionally with
  the normalization of X folded in (``normalize_eps``).

The two passes take ``keep``, the list where a fused backend leaves what a captured CUDA graph reads
again at replay (its address tables); the reference leaves nothing there.

No gradient flows through any of them (they run under ``torch.no_grad``), so a check compares
the tensors they write, not a backward.
"""

from __future__ import annotations

import torch
from torch import Tensor


def muon_momentum_reference(bufs: list[Tensor], grads: list[Tensor], momentum: float,
                            nesterov: bool, out: Tensor | None = None,
                            keep: list[Tensor] | None = None,
                            grad_scale: Tensor | None = None) -> list[Tensor]:
    """Update ``bufs`` in place; the updates (views of ``out`` when given)."""
    if grad_scale is not None:
        check_grad_scale(grad_scale, grads[0].device)
        grads = torch._foreach_mul(grads, grad_scale)  # new tensors: the gradients stay
    torch._foreach_mul_(bufs, momentum)
    torch._foreach_add_(bufs, grads)
    updates = torch._foreach_add(grads, bufs, alpha=momentum) if nesterov else bufs
    if out is None:
        return list(updates)
    parts = out.split([u.numel() // (out.shape[-2] * out.shape[-1]) for u in updates])
    for u, part in zip(updates, parts, strict=True):
        part.copy_(u.reshape(part.shape))
    return [part.view(u.shape) for u, part in zip(updates, parts, strict=True)]


def muon_apply_reference(params: list[Tensor], ortho: Tensor | list[Tensor],
                         lr: float | Tensor, weight_decay: float, scale: float,
                         keep: list[Tensor] | None = None) -> None:
    """Weight decay, then ``- scale * lr * ortho``, in place on ``params``."""
    if isinstance(ortho, Tensor):
        parts = ortho.to(params[0].dtype).split(
            [p.numel() // (ortho.shape[-2] * ortho.shape[-1]) for p in params])
        ortho = [part.view(p.shape) for part, p in zip(parts, params, strict=True)]
    torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_add_(params, torch._foreach_mul(ortho, lr), alpha=-scale)


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


def check_grad_scale(grad_scale: Tensor, device: torch.device) -> None:
    """A gradient multiplier is one float32 element on the gradients' device."""
    if (not isinstance(grad_scale, Tensor) or grad_scale.numel() != 1
            or grad_scale.dtype != torch.float32 or grad_scale.device != device):
        got = (f"{grad_scale.dtype} {tuple(grad_scale.shape)} on {grad_scale.device}"
               if isinstance(grad_scale, Tensor) else type(grad_scale).__name__)
        raise ValueError(f"muon_momentum: grad_scale must be one float32 element on {device}, "
                         f"got {got}")
