"""Plain-PyTorch reference for the LM-head loss: logits = h @ W^T, mean cross-entropy.

Computed in float32 (float64 for float64 inputs) from upcast operands: this is the truth the
fused kernel's loss, dh and dW are compared with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100


def linear_cross_entropy_reference(
    h: Tensor, weight: Tensor, labels: Tensor, ignore_index: int = IGNORE_INDEX
) -> Tensor:
    """h: [T, D]; weight: [V, D]; labels: [T] (``ignore_index`` rows skipped).
    Returns the mean loss over the kept rows, a float32 (or float64) scalar."""
    compute = torch.promote_types(h.dtype, torch.float32)
    logits = F.linear(h.to(compute), weight.to(compute))  # [T, V]
    return F.cross_entropy(logits, labels, ignore_index=ignore_index)


def linear_cross_entropy_torch(
    h: Tensor, weight: Tensor, labels: Tensor, ignore_index: int = IGNORE_INDEX
) -> Tensor:
    """The plain-torch peer: ``h @ W^T`` in the operand dtype, then ``F.cross_entropy`` on
    those logits (materialises [T, V] logits and their gradient)."""
    return F.cross_entropy(h @ weight.t(), labels, ignore_index=ignore_index)
