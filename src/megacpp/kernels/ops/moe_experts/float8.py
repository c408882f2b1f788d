"""Routed experts with float8 grouped GEMMs (the FP8 lane's ``parallel.float8_experts``).

Same contract as :func:`megacpp.kernels.ops.moe_experts.reference.moe_experts_reference`;
the same dispatch plan as the bf16 grouped path (:func:`~megacpp.kernels.ops.moe_experts.
grouped.dispatch_plan`: routing, sort by expert, no host sync). The two expert GEMMs run
through torchao's float8 grouped GEMM (``torchao.prototype.moe_training``: row-wise e4m3
scales rounded to powers of two, ``torch._scaled_grouped_mm`` on sm_90, forward, input
gradient and weight gradient all in float8; the weight gradient comes back in bf16 and is
widened to the float32 masters by autograd).

That GEMM needs every expert's row group to start at a multiple of 16, so the sorted rows
are **padded**: expert e's c_e rows go to a buffer where its group takes
max(16, ceil(c_e / 16) * 16) rows (an expert no token chose still gets 16 rows: no empty
group reaches the GEMM or its per-group scales); the padding rows are zero, so they add nothing to either weight gradient. The buffer
has a fixed row count, ``padded_rows(T * k, E)`` (an upper bound of the padded total, so
shapes stay static for CUDA graphs); the last expert's group runs to its end (more zero
rows), so every row of the buffer belongs to a group and every GEMM output row is written. The
SwiGLU with the routing weight, the padding scatter and the combine are plain PyTorch ops
(torch.compile fuses them); the weights' dims (D, 2F and F) must be multiples of 16.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from megacpp.kernels.amp import autocast_operands

ALIGN = 16  # group starts and the GEMM dims of the float8 grouped GEMM: multiples of this

GroupedMM = Callable[[Tensor, Tensor, Tensor], Tensor]  # (a [R, K], b_t [E, K, N], ends [E])


class PaddedPlan(NamedTuple):
    slots: Tensor  # [T, k] int64: row of each (token, choice) in the padded buffer
    ends: Tensor  # [E] int32: padded group ends, each a multiple of 16
    rows: int  # the buffer's row count (static)


def padded_rows(n_rows: int, n_experts: int) -> int:
    """Rows of the padded buffer for n_rows routed rows over n_experts groups: a group of c
    rows takes max(16, round16(c)) <= c + 16, so round16(n_rows) + 16 * n_experts always
    holds them."""
    return -(-n_rows // ALIGN) * ALIGN + ALIGN * n_experts


def padded_plan(expert_idx: Tensor, inv: Tensor, ends: Tensor) -> PaddedPlan:
    """expert_idx [T, k], inv [T, k] (sorted row of each (token, choice)), ends [E] (group
    ends of the sorted rows) -> the same rows with every group padded to a multiple of 16 (the
    last to the buffer's end)."""
    ends = ends.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))  # [E]
    padded = ((counts + ALIGN - 1) // ALIGN * ALIGN).clamp(min=ALIGN)  # [E], >= 16 each
    padded_ends = padded.cumsum(0)
    shift = (padded_ends - padded) - (ends - counts)  # padded start - sorted start, per expert
    slots = inv + shift[expert_idx]  # [T, k]
    rows = padded_rows(expert_idx.numel(), ends.shape[0])
    padded_ends[-1] = rows  # the last group takes the spare zero rows: no row outside a group
    return PaddedPlan(slots, padded_ends.to(torch.int32), rows)


def float8_grouped_mm(a: Tensor, b_t: Tensor, ends: Tensor) -> Tensor:
    """a [R, K] (row groups ending at ``ends``, each a multiple of 16 rows) @ b_t [E, K, N]
    (column-major per expert) -> [R, N] bf16 through torchao's float8 grouped GEMM (row-wise
    scales; differentiable in a and b_t)."""
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

    return _to_fp8_rowwise_then_scaled_grouped_mm(
        a, b_t, ends, out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=False)


def moe_experts_float8(
    x: Tensor, expert_idx: Tensor, weights: Tensor, w_in: Tensor, w_out: Tensor,
    addend: Tensor | None = None, grouped_mm: GroupedMM = float8_grouped_mm,
) -> Tensor:
    """x [T, D]; expert_idx, weights [T, k]; w_in [E, 2F, D]; w_out [E, D, F] -> [T, D]
    (+ ``addend``), the expert GEMMs through ``grouped_mm`` (default: float8) over padded
    groups. Under autocast x runs in the autocast dtype; the weights are quantized from
    their own dtype (the float32 masters)."""
    from megacpp.kernels.ops.moe_experts.grouped import dispatch_plan

    (x,) = autocast_operands(x)
    n_tokens, k = expert_idx.shape
    n_experts = w_in.shape[0]
    _, inv, ends, _ = dispatch_plan(expert_idx, n_experts)
    slots, padded_ends, rows = padded_plan(expert_idx, inv, ends)
    flat = slots.reshape(-1)  # [T*k]
    x_padded = x.new_zeros(rows, x.shape[1]).index_copy(
        0, flat, x.repeat_interleave(k, dim=0))  # [rows, D], zero padding
    w_padded = weights.new_zeros(rows).index_copy(0, flat, weights.reshape(-1))  # [rows]
    gate_up = grouped_mm(x_padded, w_in.transpose(-2, -1), padded_ends)  # [rows, 2F]
    gate, up = gate_up.float().chunk(2, dim=-1)
    hidden = (F.silu(gate) * up * w_padded.float()[:, None]).to(x.dtype)  # [rows, F]
    y = grouped_mm(hidden, w_out.transpose(-2, -1), padded_ends)  # [rows, D]
    out = y.index_select(0, flat).view(n_tokens, k, -1).sum(1, dtype=torch.float32)
    if addend is not None:
        out = out + addend
    return out.to(x.dtype)


def float8_experts_rejection(d_model: int, expert_ffn: int) -> str | None:
    """Why an MoE layer of these dims cannot take the float8 grouped GEMM, or None."""
    dims = {"d_model": d_model, "2 * expert_ffn": 2 * expert_ffn, "expert_ffn": expert_ffn}
    odd = [f"{name} = {value}" for name, value in dims.items() if value % ALIGN]
    if odd:
        return (f"{', '.join(odd)} not a multiple of {ALIGN} (the float8 grouped GEMM needs "
                "them)")
    return None
