"""Plain-PyTorch reference for causal attention and the chosen backend, PyTorch SDPA (flash).

Contract: q, k, v [B, H, L, Dh] (same H; GQA callers expand k/v first), causal, softmax scale
1/sqrt(Dh); returns [B, H, L, Dh] in q.dtype. The flash backend saves q, k, v, the output and
the per-row logsumexp [B, H, L] (float32) for backward; the reference saves the [L, L] probs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel


def causal_attention_reference(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """softmax(q k^T / sqrt(Dh) + causal mask) v, computed in float32."""
    compute = torch.promote_types(q.dtype, torch.float32)
    q32, k32, v32 = (t.to(compute) for t in (q, k, v))
    scores = q32 @ k32.transpose(-2, -1) / math.sqrt(q.shape[-1])  # [B, H, L, L]
    length = q.shape[-2]
    future = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    return (probs @ v32).to(q.dtype)


def causal_attention_sdpa_flash(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """PyTorch SDPA restricted to its FlashAttention-2 kernel (fails rather than falls back)."""
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
