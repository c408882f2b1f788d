"""Thin adapters to peer (donor) implementations, imported only when a donor row is run.

They adapt call conventions to the surface contracts; none of them is on the training path.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from megacpp.kernels.ops.rmsnorm.reference import rmsnorm_reference


@functools.cache
def _compiled_rmsnorm():
    return torch.compile(rmsnorm_reference, dynamic=False)


def rmsnorm_compiled(
    x: Tensor, weight: Tensor, residual: Tensor | None = None, eps: float = 1e-5
) -> tuple[Tensor, Tensor]:
    """torch.compile of the reference (inductor generates one fused Triton kernel each way)."""
    return _compiled_rmsnorm()(x, weight, residual, eps)


def liger_linear_cross_entropy(
    h: Tensor, weight: Tensor, labels: Tensor, ignore_index: int = -100,
    accum_dtype: torch.dtype | None = torch.float32,
) -> Tensor:
    """Liger-kernel's fused linear cross-entropy (mean reduction)."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy(
        h, weight, labels, ignore_index=ignore_index, accum_dtype=accum_dtype
    )


def mamba3_siso_combined(*args: Any, **kwargs: Any) -> Any:
    """mamba_ssm's fused Mamba-3 SISO kernel, called in its own [B, H, L] layout."""
    from mamba_ssm.ops.triton.mamba3 import mamba3_siso_combined as peer

    return peer(*args, **kwargs)


def fla_chunk_gated_delta_rule(*args: Any, **kwargs: Any) -> Any:
    """flash-linear-attention's chunked gated delta rule, in its own conventions."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule(*args, **kwargs)
