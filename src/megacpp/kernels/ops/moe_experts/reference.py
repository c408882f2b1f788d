"""Plain-PyTorch reference for routed-expert compute: sort by expert, run each, combine.

This is the truth the fast grouped-GEMM path is tested against. It loops over experts on
the host (and syncs to read the per-expert counts), which is fine for a reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_experts_reference(
    x: torch.Tensor,
    expert_idx: torch.Tensor,
    weights: torch.Tensor,
    w_in: torch.Tensor,
    w_out: torch.Tensor,
    addend: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dropless top-k expert FFN, plus ``addend`` when given.

    Args:
        x: [T, D] tokens.
        expert_idx: [T, k] chosen experts per token.
        weights: [T, k] combine weights per (token, choice).
        w_in: [E, 2F, D] fused gate/up projections of each SwiGLU expert.
        w_out: [E, D, F] down projections.
        addend: [T, D] added to the combine (the shared experts' output: a fused backend adds
            it in its combine kernel instead of a kernel of its own).
    Returns:
        [T, D]: sum_j weights[t, j] * expert_{idx[t, j]}(x[t]) (+ addend[t]).
    """
    k = expert_idx.shape[1]
    n_experts = w_in.shape[0]
    flat_expert = expert_idx.reshape(-1)  # [T*k]
    order = torch.argsort(flat_expert, stable=True)  # (token, choice) pairs grouped by expert
    token_of = order // k
    counts = torch.bincount(flat_expert, minlength=n_experts).tolist()

    x_sorted = x[token_of]  # [T*k, D]
    y_sorted = torch.empty_like(x_sorted)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        chunk = x_sorted[start : start + n]
        gate, up = (chunk @ w_in[e].t()).chunk(2, dim=-1)
        y_sorted[start : start + n] = (F.silu(gate) * up) @ w_out[e].t()
        start += n

    y_sorted = y_sorted * weights.reshape(-1)[order, None].to(y_sorted.dtype)
    out = torch.zeros_like(x).index_add_(0, token_of, y_sorted)
    return out if addend is None else out + addend.to(out.dtype)
