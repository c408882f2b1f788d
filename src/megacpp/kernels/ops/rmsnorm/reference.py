"""Plain-PyTorch reference for RMSNorm with an optional residual add.

    h = x + residual            (summed in float32, stored in x.dtype)
    y = h / sqrt(mean(h^2) + eps) * weight     (float32 math, returned in out_dtype or x.dtype)

The normalisation uses the float32 sum, not the rounded ``h``; the fused kernel does the same.
``out_dtype`` lets y leave in the dtype its consumers compute in (bf16 matmuls under autocast)
while h, the residual stream, keeps x's. ``skip`` changes only how a backend computes the
gradient (see the fused kernel), never a value: the reference accepts and ignores it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def rmsnorm_reference(
    x: Tensor, weight: Tensor, residual: Tensor | None = None, eps: float = 1e-5,
    out_dtype: torch.dtype | None = None, skip: bool = False,
) -> tuple[Tensor, Tensor]:
    """x, residual: [..., D]; weight: [D]. Returns (y, h), both [..., D]: y in ``out_dtype``
    (default x.dtype), h in x.dtype."""
    del skip  # a gradient-path choice of the fused kernel; same values
    compute = torch.promote_types(x.dtype, torch.float32)
    h = x.to(compute) if residual is None else x.to(compute) + residual.to(compute)
    y = F.rms_norm(h, (x.shape[-1],), weight.to(compute), eps)
    return y.to(out_dtype or x.dtype), h.to(x.dtype)
