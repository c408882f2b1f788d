"""Plain-PyTorch reference for RMSNorm with an optional residual add.

    h = x + residual            (summed in float32, stored in x.dtype)
    y = h / sqrt(mean(h^2) + eps) * weight     (float32 math, returned in out_dtype or x.dtype)

The normalisation uses the float32 sum, not the rounded ``h``; the fused kernel does the same.
``out_dtype`` lets y leave in the dtype its consumers compute in (bf16 matmuls under autocast)
while h, the residual stream, keeps x's. ``skip`` changes only how a backend computes the
gradient (see the fused kernel), never a value: the reference accepts and ignores it.
``fanout=2`` returns y twice, as two tensors (the second a view of the first), for a mixer
that uses its input in two places: each gets its own gradient, and a fused backend sums them
in its backward kernel instead of autograd adding them in a kernel of its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def rmsnorm_reference(
    x: Tensor, weight: Tensor, residual: Tensor | None = None, eps: float = 1e-5,
    out_dtype: torch.dtype | None = None, skip: bool = False, fanout: int = 1,
) -> tuple[Tensor, ...]:
    """x, residual: [..., D]; weight: [D]. Returns (y, h), both [..., D]: y in ``out_dtype``
    (default x.dtype), h in x.dtype; with ``fanout=2``, (y, y again, h)."""
    del skip  # a gradient-path choice of the fused kernel; same values
    check_fanout(fanout)
    compute = torch.promote_types(x.dtype, torch.float32)
    h = x.to(compute) if residual is None else x.to(compute) + residual.to(compute)
    y = F.rms_norm(h, (x.shape[-1],), weight.to(compute), eps).to(out_dtype or x.dtype)
    return (y, y.view_as(y), h.to(x.dtype)) if fanout == 2 else (y, h.to(x.dtype))


def check_fanout(fanout: int) -> None:
    if fanout not in (1, 2):
        raise ValueError(f"rmsnorm: fanout must be 1 or 2, got {fanout!r}")
