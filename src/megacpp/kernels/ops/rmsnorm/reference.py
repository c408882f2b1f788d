"""Plain-PyTorch reference for RMSNorm with an optional residual add.

    h = x + residual            (summed in float32, stored in x.dtype)
    y = h / sqrt(mean(h^2) + eps) * weight     (float32 math, returned in out_dtype or x.dtype)

The normalisation uses the float32 sum, not the rounded ``h``; the fused kernel does the same.
``out_dtype`` lets y leave in the dtype its consumers compute in (bf16 matmuls under autocast)
while h, the residual stream, keeps x's. ``skip`` changes only how a backend computes the
gradient (see the fused kernel), never a value: the reference accepts and ignores it.
``fanout=2`` (or 3) returns y twice (three times), as tensors of their own (views of the first),
for a mixer that uses its input in two (three) places: each gets its own gradient, and a fused
backend sums them in its backward kernel instead of autograd adding them in a kernel of its own.
``rope=(cos, sin)`` (QK-norm; no residual, ``fanout=1``) rotates y before its one rounding, as
:func:`megacpp.model.rope.apply_rope` does (half-split pairs ``(i, i + D/2)``): ``cos`` and
``sin`` are [L, D/2] float tables of the positions along x's second-to-last dim, which has L
entries; a fused backend then needs no rotation kernels (nor their activation round trip)
either way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def rmsnorm_reference(
    x: Tensor, weight: Tensor, residual: Tensor | None = None, eps: float = 1e-5,
    out_dtype: torch.dtype | None = None, skip: bool = False, fanout: int = 1,
    rope: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, ...]:
    """x, residual: [..., D]; weight: [D]. Returns (y, h), both [..., D]: y in ``out_dtype``
    (default x.dtype), h in x.dtype; with ``fanout=n``, y n times then h; with ``rope``, y
    rotated (x [..., L, D], cos / sin [L, D/2])."""
    del skip  # a gradient-path choice of the fused kernel; same values
    check_fanout(fanout)
    check_rope(x, residual, fanout, rope)
    compute = torch.promote_types(x.dtype, torch.float32)
    h = x.to(compute) if residual is None else x.to(compute) + residual.to(compute)
    y = F.rms_norm(h, (x.shape[-1],), weight.to(compute), eps)
    if rope is not None:
        cos, sin = (t.to(compute) for t in rope)
        y1, y2 = y.chunk(2, dim=-1)
        y = torch.cat((y1 * cos - y2 * sin, y2 * cos + y1 * sin), dim=-1)
    y = y.to(out_dtype or x.dtype)
    return (*copies(y, fanout), h.to(x.dtype))


MAX_FANOUT = 3


def check_fanout(fanout: int) -> None:
    if fanout not in range(1, MAX_FANOUT + 1):
        raise ValueError(f"rmsnorm: fanout must be 1 to {MAX_FANOUT}, got {fanout!r}")


def copies(y: Tensor, fanout: int) -> tuple[Tensor, ...]:
    """y and ``fanout - 1`` views of it: tensors of their own, each with its own gradient."""
    return (y, *(y.view_as(y) for _ in range(fanout - 1)))


def check_rope(x: Tensor, residual: Tensor | None, fanout: int,
               rope: tuple[Tensor, Tensor] | None) -> None:
    """``rope`` is a QK-norm's: no residual, one output, an even width, and [L, D/2] tables
    for x [..., L, D]."""
    if rope is None:
        return
    if residual is not None or fanout != 1:
        raise ValueError("rmsnorm: rope is for a QK-norm (no residual, fanout 1)")
    if x.dim() < 2 or x.shape[-1] % 2:
        raise ValueError(f"rmsnorm: rope needs x [..., L, D] with D even, got {tuple(x.shape)}")
    want = (x.shape[-2], x.shape[-1] // 2)
    for name, table in zip(("cos", "sin"), rope, strict=True):
        if tuple(table.shape) != want:
            raise ValueError(f"rmsnorm: rope {name} must be {list(want)} for x "
                             f"{list(x.shape)}, got {list(table.shape)}")
