"""Rotary position embeddings (half-split convention, as in Llama/NeoX)."""

from __future__ import annotations

import torch


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, base: float, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for integer ``positions`` [..., L] -> two [..., L, head_dim/2].

    ``dtype`` is the table precision (float32, or float64 for float64 models)."""
    inv_freq = base ** (
        -torch.arange(0, head_dim, 2, device=positions.device, dtype=dtype) / head_dim
    )
    angles = positions.to(dtype)[..., None] * inv_freq  # [..., L, hd/2]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, L, hd] by cos/sin [L, hd/2] (or [B, 1, L, hd/2])."""
    x1, x2 = x.to(cos.dtype).chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
