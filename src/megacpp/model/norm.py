"""RMSNorm (the one norm the model uses: pre-norms, final norm, QK-norm)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megacpp.kernels.amp import effective_dtype
from megacpp.kernels.runtime import resolve


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, computed in at least float32.

    y is returned in the dtype its consumers compute in: the input dtype, or the autocast
    dtype for a float32 input while autocast is on (the norm's outputs feed matmuls that would
    cast them anyway; writing bf16 here halves the activation and its gradient, and drops the
    cast kernels on both sides)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x, skip=False)[0]

    def with_skip(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x), x) for a pre-norm residual block ``skip + mixer(norm(x))``. The values
        are those of ``(self(x), x)``; a fused backend routes the skip through its kernel, so
        the backward sums the skip branch's gradient into dx in the norm's own kernel instead
        of autograd adding the two float32 gradients of the residual stream separately."""
        return self._norm(x, skip=True)

    def _norm(self, x: torch.Tensor, skip: bool) -> tuple[torch.Tensor, torch.Tensor]:
        out_dtype = effective_dtype(x)
        backend = resolve("rmsnorm", x)  # the reference unless MEGACPP_KERNELS picks a kernel
        if backend.role != "fallback":
            return backend.fn(x, self.weight, None, self.eps, out_dtype, skip)
        dtype = torch.promote_types(x.dtype, torch.float32)
        y = F.rms_norm(x.to(dtype), (x.shape[-1],), self.weight.to(dtype), self.eps)
        return y.to(out_dtype), x
