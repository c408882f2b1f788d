"""Triton pieces the fused decode-step kernels share (imported only where Triton is)."""

from __future__ import annotations

from types import MappingProxyType

import torch
import triton
import triton.language as tl

TL_DTYPES = MappingProxyType({torch.float32: tl.float32, torch.bfloat16: tl.bfloat16,
                              torch.float16: tl.float16, torch.float64: tl.float64})


@triton.jit
def softplus(x):
    """F.softplus (threshold 20): log1p(exp(x)), with log1p accurate for small exp(x)."""
    u = tl.exp(tl.minimum(x, 20.0))
    w = 1.0 + u
    log1p = tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0)))
    return tl.where(x > 20.0, x, log1p)
