"""The plain-PyTorch truth of an FP8 linear layer's forward: each operand scaled into
float8 e4m3 by its own dynamic scale (one per tensor, or one per row of the GEMM's reduction),
rounded there, brought back and multiplied in float32.

The scale is ``E4M3_MAX / amax`` in float32; the rowwise recipe rounds it down to a power of
two (torchao's ``round_scales_to_power_of_2``), the tensorwise one keeps it as it is."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

RECIPES = ("tensorwise", "rowwise")
E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max
EPS = 1e-12  # torchao's floor on amax (an all-zero operand gets a finite scale)


def quantize_dequantize(t: Tensor, recipe: str) -> Tensor:
    """``t`` [..., K] rounded through float8 e4m3 with a dynamic scale: one for the tensor
    (tensorwise) or one per row along the last dim (rowwise), in float32."""
    t32 = t.float()
    if recipe == "tensorwise":
        amax = t32.abs().amax()
    elif recipe == "rowwise":
        amax = t32.abs().amax(dim=-1, keepdim=True)
    else:
        raise ValueError(f"FP8 recipe {recipe!r} not one of {', '.join(RECIPES)}")
    scale = E4M3_MAX / amax.clamp(min=EPS)
    if recipe == "rowwise":
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    rounded = (t32 * scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).float() / scale
    return t32 + (rounded - t32).detach()  # the rounding passes gradients straight through


def float8_linear_reference(x: Tensor, weight: Tensor, recipe: str = "tensorwise") -> Tensor:
    """x [..., K] @ weight [N, K]^T -> [..., N] (x's dtype) with both operands rounded
    through float8 as the recipe's forward GEMM rounds them. The backward is float32 autograd
    with the rounded operands, the rounding itself passing gradients straight through (the
    recipes also round the output gradient to float8; tests allow for that)."""
    out = F.linear(quantize_dequantize(x, recipe), quantize_dequantize(weight, recipe))
    return out.to(x.dtype)
