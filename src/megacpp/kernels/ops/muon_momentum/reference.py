"""Muon's momentum pass in plain PyTorch (``torch._foreach_*``): the truth the fused kernel
is tested against, and what runs on CPU, on sharded (DTensor) parameters and under
``MEGACPP_KERNELS=reference``.

``buf = momentum * buf + grad``; the update is ``grad + momentum * buf`` (Nesterov) or
``buf``, written into ``out`` [sum of matrices, rows, cols] (the Newton-Schulz input, in its
dtype) matrix by matrix in parameter order, or returned when ``out`` is None. With
``grad_scale`` (a one-element float32 tensor on the gradients' device: the trainer's clipping
coefficient) every ``grad`` above is ``grad * grad_scale``, and the gradients themselves are
left as they are.

``keep`` is the list where a fused backend leaves what a captured CUDA graph reads again at
replay (its address tables); the reference leaves nothing there. No gradient flows through
the pass (it runs under ``torch.no_grad``), so a check compares the tensors it writes, not a
backward.
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


def check_grad_scale(grad_scale: Tensor, device: torch.device) -> None:
    """A gradient multiplier is one float32 element on the gradients' device."""
    if (not isinstance(grad_scale, Tensor) or grad_scale.numel() != 1
            or grad_scale.dtype != torch.float32 or grad_scale.device != device):
        got = (f"{grad_scale.dtype} {tuple(grad_scale.shape)} on {grad_scale.device}"
               if isinstance(grad_scale, Tensor) else type(grad_scale).__name__)
        raise ValueError(f"muon_momentum: grad_scale must be one float32 element on {device}, "
                         f"got {got}")
