"""Routed-expert compute as two grouped GEMMs: permute -> grouped GEMM -> SwiGLU -> grouped
GEMM -> weight and unpermute. No host sync (the per-expert offsets stay on the device).

``torch._grouped_mm(a [N, K], b [E, K, M], offs [E] int32 cumulative ends)`` multiplies the
rows of each expert's group by that expert's matrix; autograd gives the backward (two grouped
GEMMs per product: dA by group, dB by group). Same contract as
:func:`megacpp.kernels.ops.moe.reference.moe_experts_reference`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def moe_experts_grouped(
    x: Tensor, expert_idx: Tensor, weights: Tensor, w_in: Tensor, w_out: Tensor
) -> Tensor:
    """x [T, D]; expert_idx, weights [T, k]; w_in [E, 2F, D]; w_out [E, D, F] -> [T, D]."""
    k = expert_idx.shape[1]
    n_experts = w_in.shape[0]
    flat_expert = expert_idx.reshape(-1)  # [T*k]
    order = torch.argsort(flat_expert, stable=True)  # (token, choice) pairs grouped by expert
    token_of = order // k
    offs = torch.bincount(flat_expert, minlength=n_experts).cumsum(0).to(torch.int32)  # [E]

    x_sorted = x[token_of]  # [T*k, D]   permute
    gate_up = torch._grouped_mm(x_sorted, w_in.transpose(-2, -1), offs=offs)  # [T*k, 2F]
    gate, up = gate_up.chunk(2, dim=-1)
    hidden = F.silu(gate) * up  # [T*k, F]
    y_sorted = torch._grouped_mm(hidden, w_out.transpose(-2, -1), offs=offs)  # [T*k, D]

    y_sorted = y_sorted * weights.reshape(-1)[order, None].to(y_sorted.dtype)
    return torch.zeros_like(x).index_add_(0, token_of, y_sorted)  # unpermute + combine
