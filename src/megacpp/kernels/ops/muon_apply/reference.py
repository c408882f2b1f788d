"""Muon's weight update in plain PyTorch (``torch._foreach_*``): the truth the fused kernel is
tested against, and what runs on CPU, on sharded (DTensor) parameters and under
``MEGACPP_KERNELS=reference``.

``p = p * (1 - lr * weight_decay) - scale * (lr * ortho)`` with ``ortho`` [matrices, rows,
cols] split over the parameters in parameter order (decoupled weight decay, then the
RMS-matched orthogonalized step). ``lr`` is a float, or a device tensor while a CUDA graph is
captured. ``keep``: as for the momentum pass (what a fused backend's captured graph reads
again at replay). No gradient flows through it.
"""

from __future__ import annotations

import torch
from torch import Tensor


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
