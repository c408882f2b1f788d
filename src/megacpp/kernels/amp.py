"""Autocast and the catalog: which dtype a backend really runs in.

Under ``torch.autocast`` the model's activations and parameters stay float32 while its
matmuls run in the autocast dtype (bf16). A backend that fuses matmuls (grouped-GEMM MoE,
fused linear cross-entropy) must then be *selected* for the autocast dtype and must *cast*
its matmul operands the way autocast would -- otherwise a float32 tensor would make selection
fail closed (or pick a float32 kernel) for what is a bf16 computation in the reference.
"""

from __future__ import annotations

import torch
from torch import Tensor


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The lower-precision dtype autocast applies on ``device_type`` now, or None when off."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def effective_dtype(like: Tensor) -> torch.dtype:
    """The dtype a matmul on ``like`` runs in: the autocast dtype for a float32 tensor while
    autocast is on for its device, else ``like.dtype``."""
    cast = autocast_dtype(like.device.type) if like.dtype == torch.float32 else None
    return cast if cast is not None else like.dtype


def autocast_operands(*tensors: Tensor) -> tuple[Tensor, ...]:
    """Cast float32 matmul operands to the autocast dtype when autocast is on (a no-op
    otherwise). Differentiable: gradients flow back to the float32 originals."""
    cast = autocast_dtype(tensors[0].device.type)
    if cast is None:
        return tensors
    return tuple(t.to(cast) if t.dtype == torch.float32 else t for t in tensors)
