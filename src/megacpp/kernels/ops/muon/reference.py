"""Muon's two elementwise passes in plain PyTorch (``torch._foreach_*``): the truth the fused
kernels are tested against, and what runs on CPU, on sharded (DTensor) parameters and under
``MEGACPP_KERNELS=reference``.

* momentum: ``buf = momentum * buf + grad``; the update is ``grad + momentum * buf``
  (Nesterov) or ``buf``, written into ``out`` [sum of matrices, rows, cols] (the Newton-Schulz
  input, in its dtype) matrix by matrix in parameter order, or returned when ``out`` is None.
* apply: ``p = p * (1 - lr * weight_decay) - scale * (lr * ortho)`` with ``ortho`` [matrices,
  rows, cols] split over the parameters in the same order (decoupled weight decay, then the
  RMS-matched orthogonalized step). ``lr`` is a float, or a device tensor while a CUDA graph
  is captured.

Both take ``keep``, the list where a fused backend leaves what a captured CUDA graph reads
again at replay (its address tables); the reference leaves nothing there.

No gradient flows through either (they run under ``torch.no_grad``), so a check compares the
tensors they write, not a backward.
"""

from __future__ import annotations

import torch
from torch import Tensor


def muon_momentum_reference(bufs: list[Tensor], grads: list[Tensor], momentum: float,
                            nesterov: bool, out: Tensor | None = None,
                            keep: list[Tensor] | None = None) -> list[Tensor]:
    """Update ``bufs`` in place; the updates (views of ``out`` when given)."""
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
