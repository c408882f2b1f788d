"""RMSNorm (the one norm the model uses: pre-norms, final norm, QK-norm)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megacpp.kernels.amp import effective_dtype
from megacpp.kernels.ops.rmsnorm.reference import check_rope, copies
from megacpp.kernels.runtime import resolve
from megacpp.model.rope import apply_rope


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

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """norm(x); with ``rope=(cos, sin)`` ([L, D/2] tables for x [..., L, D]), rotated by
        :func:`megacpp.model.rope.apply_rope`'s rule in the same op (a QK-norm: a fused
        backend then runs no rotation kernels, forward or backward)."""
        return self._norm(x, skip=False, rope=rope)[0]

    def with_skip(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, fanout: int = 1
    ) -> tuple[torch.Tensor, ...]:
        """(norm(s), s) with s = x + residual (or x) in x's dtype, for a pre-norm residual block
        ``s + mixer(norm(s))``. A fused backend adds the residual in the norm's own kernel and
        routes s through it, so its backward also sums the skip branch's gradient into ds
        (without it, autograd adds the two float32 gradients of the residual stream in a kernel
        of its own). ``fanout=n`` (2 or 3): norm(s) n times, then s, for a mixer that uses its
        input in n places (``INPUT_FANOUT``): a fused backend sums their gradients in its
        backward kernel too."""
        return self._norm(x, skip=True, residual=residual, fanout=fanout)

    def _norm(
        self, x: torch.Tensor, skip: bool, residual: torch.Tensor | None = None, fanout: int = 1,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, ...]:
        out_dtype = effective_dtype(x)
        backend = resolve("rmsnorm", x)  # the reference unless MEGACPP_KERNELS picks a kernel
        if backend.role != "fallback":
            return backend.fn(x, self.weight, residual, self.eps, out_dtype, skip, fanout, rope)
        check_rope(x, residual, fanout, rope)
        if residual is not None:
            x = (x + residual).to(x.dtype)
        dtype = torch.promote_types(x.dtype, torch.float32)
        y = F.rms_norm(x.to(dtype), (x.shape[-1],), self.weight.to(dtype), self.eps)
        if rope is not None:
            y = apply_rope(y, *rope)
        y = y.to(out_dtype)
        return (*copies(y, fanout), x)
