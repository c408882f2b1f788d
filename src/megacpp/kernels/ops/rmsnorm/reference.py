"""Plain-PyTorch reference for RMSNorm with an optional residual add.

    h = x + residual            (summed in float32, stored in x.dtype)
    y = h / sqrt(mean(h^2) + eps) * weight     (float32 math, returned in x.dtype)

The normalisation uses the float32 sum, not the rounded ``h``; the fused kernel does the same.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def rmsnorm_reference(
    x: Tensor, weight: Tensor, residual: Tensor | None = None, eps: float = 1e-5
) -> tuple[Tensor, Tensor]:
    """x, residual: [..., D]; weight: [D]. Returns (y, h), both [..., D] in x.dtype."""
    compute = torch.promote_types(x.dtype, torch.float32)
    h = x.to(compute) if residual is None else x.to(compute) + residual.to(compute)
    y = F.rms_norm(h, (x.shape[-1],), weight.to(compute), eps)
    return y.to(x.dtype), h.to(x.dtype)
