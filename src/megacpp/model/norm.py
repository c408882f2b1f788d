"""RMSNorm (the one norm the model uses: pre-norms, final norm, QK-norm)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megacpp.kernels.runtime import resolve


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, computed in at least float32, returned in the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        backend = resolve("rmsnorm", x)  # the reference unless MEGACPP_KERNELS picks a kernel
        if backend.role != "fallback":
            return backend.fn(x, self.weight, None, self.eps)[0]
        dtype = torch.promote_types(x.dtype, torch.float32)
        y = F.rms_norm(x.to(dtype), (x.shape[-1],), self.weight.to(dtype), self.eps)
        return y.to(x.dtype)
