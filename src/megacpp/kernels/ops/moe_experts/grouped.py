"""Routed-expert compute as grouped GEMMs with a hand-written backward. No host sync.

Forward (N = T * k routed rows, sorted by expert; offsets stay on the device)::

    plan       stable sort of the flat expert ids -> order [N], inverse inv [T, k], offs [E],
               routing weights in sorted order w_sorted [N] (on CUDA, E <= 256: a two-launch
               Triton counting sort; else torch.sort + searchsorted)
    permute    x_sorted[inv[t, j]] = x[t]   (a row scatter: each row of x read once)  [N, D]
    gate|up    grouped GEMM x_sorted @ w_in[e]^T                        [N, 2F]
    SwiGLU     hidden = silu(gate) * up * w     (routing weight folded in here)   [N, F]
               (in the gate|up GEMM's epilogue where the Triton kernel serves it)
    down       grouped GEMM hidden @ w_out[e]^T                         [N, D]
    combine    out[t] = sum_j y_sorted[inv[t, j]]      (gather-sum, float32)      [T, D]

Backward: the combine's gradient is dout permuted as x was (dy_sorted); two grouped GEMMs
give d hidden and dw_out (a K-grouped GEMM: dy_sorted^T @ hidden per expert); one fused pass
gives d(gate|up) and the routing weights' gradient (written to each row's (token, choice)
slot); two more grouped GEMMs give dx_sorted and dw_in; a gather-sum unpermutes dx. Saved:
x_sorted, gate|up, hidden and the plan. The weights come in their own dtype and are cast to
the compute dtype inside, so the two K-grouped weight-gradient GEMMs ("wgrad": on sm90+ a
Triton kernel, :func:`megacpp.kernels.ops.moe_experts.gemm.grouped_wgrad_triton`) write the
float32 masters' gradients directly from their float32 accumulators: no bf16 rounding of dW
and no cast kernel after it.

``torch._grouped_mm(a [N, K], b [E, K, M], offs)`` multiplies each expert's rows by its
matrix; ``torch._grouped_mm(a [M, N], b [N, K], offs)`` sums each expert's rows into [E, M, K].
The four expert GEMMs go through ``_Ops.mm``: on sm90+ a Triton kernel
(:func:`megacpp.kernels.ops.moe_experts.gemm.grouped_mm_triton`) at the shapes where it
measured faster than ``torch._grouped_mm``, which serves the rest (``configs.py``).
On CUDA the plan, permute, combine and SwiGLU run as Triton kernels (``dispatch.py``,
``swiglu.py``); elsewhere the plain PyTorch functions below (the truth those kernels are
tested against). Same contract as
:func:`megacpp.kernels.ops.moe_experts.reference.moe_experts_reference`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from megacpp.kernels.amp import autocast_operands, effective_dtype
from megacpp.kernels.launch import for_device
from megacpp.kernels.ops.moe_experts.configs import CONFIGS, MoEConfig


class DispatchPlan(NamedTuple):
    order: Tensor  # [N] int64: sorted row -> flat (token, choice) index
    inv: Tensor  # [T, k] int64: (token, choice) -> sorted row
    offs: Tensor  # [E] int32: cumulative row count per expert (grouped GEMM group ends)
    w_sorted: Tensor | None  # [N]: routing weight of each sorted row (detached); None if no weights


def dispatch_plan(expert_idx: Tensor, n_experts: int, weights: Tensor | None = None,
                  config: MoEConfig | None = None) -> DispatchPlan:
    """Group the T*k (token, choice) pairs by expert, all on the device (no .item/.tolist);
    ``weights`` [T, k] (optional) come back in sorted order, detached.

    On CUDA with at most 256 experts: a Triton counting sort (two launches, see
    :func:`megacpp.kernels.ops.moe_experts.dispatch.plan_triton`; its w_sorted is float32). Else a
    stable torch.sort of uint8/int32 keys and the group ends from a binary search of the
    sorted keys (no bincount: it syncs)."""
    if _use_triton(expert_idx.device) and n_experts <= 256:
        from megacpp.kernels.ops.moe_experts.dispatch import plan_triton

        if weights is None:
            weights = torch.ones(expert_idx.shape, device=expert_idx.device)
        return DispatchPlan(*plan_triton(expert_idx, weights, n_experts, config=config))
    return dispatch_plan_torch(expert_idx, n_experts, weights)


def dispatch_plan_torch(expert_idx: Tensor, n_experts: int, weights: Tensor | None = None
                        ) -> DispatchPlan:
    """The plan from torch.sort + searchsorted (any E, any device; the Triton plan's truth)."""
    key_dtype = torch.uint8 if n_experts <= 256 else torch.int32
    keys = expert_idx.reshape(-1).to(key_dtype)  # [N]
    sorted_keys, order = torch.sort(keys, stable=True)
    experts = torch.arange(n_experts, device=keys.device, dtype=key_dtype)
    offs = torch.searchsorted(sorted_keys, experts, right=True, out_int32=True)
    inv = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(),
                                                                  device=order.device))
    w_sorted = None if weights is None else weights.detach().reshape(-1).index_select(0, order)
    return DispatchPlan(order, inv.view_as(expert_idx), offs, w_sorted)


# -- the plain-PyTorch elementwise steps (CPU path and the Triton kernels' truth) ---------------
def gather_sum_torch(src: Tensor, inv: Tensor, addend: Tensor | None = None) -> Tensor:
    """src [N, D], inv [T, k] -> [T, D] = sum_j src[inv[t, j]] (+ addend[t]), float32 sums."""
    n_tokens, k = inv.shape
    rows = src.index_select(0, inv.reshape(-1)).view(n_tokens, k, -1)
    acc = rows.sum(1, dtype=torch.promote_types(src.dtype, torch.float32))
    return (acc if addend is None else acc + addend).to(src.dtype)


def swiglu_weighted_torch(gate_up: Tensor, w: Tensor) -> Tensor:
    """gate_up [N, 2F], w [N] -> [N, F] = silu(gate) * up * w."""
    compute = torch.promote_types(gate_up.dtype, torch.float32)
    gate, up = gate_up.to(compute).chunk(2, dim=-1)
    return (F.silu(gate) * up * w.to(compute)[:, None]).to(gate_up.dtype)


def swiglu_weighted_backward_torch(gate_up: Tensor, w: Tensor, dh: Tensor, order: Tensor,
                                   dw_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """gate_up [N, 2F], w [N], dh [N, F], order [N] (sorted row -> (token, choice) slot)
    -> d gate_up [N, 2F], dweights [N] in slot order (``dw_dtype``) = sum_f dh * silu(gate) * up
    (float32 or wider sums)."""
    compute = torch.promote_types(gate_up.dtype, torch.float32)
    gate, up = gate_up.to(compute).chunk(2, dim=-1)
    dh = dh.to(compute)
    sig = torch.sigmoid(gate)
    silu = gate * sig
    dw = (dh * silu * up).sum(-1)
    dact = dh * w.to(compute)[:, None]
    dgate = dact * up * sig * (1 + gate * (1 - sig))
    dweights = torch.empty(dw.shape, device=dw.device, dtype=dw_dtype)
    return (torch.cat([dgate, dact * silu], dim=-1).to(gate_up.dtype),
            dweights.index_copy_(0, order, dw.to(dw_dtype)))


def scatter_rows_torch(src: Tensor, inv: Tensor) -> Tensor:
    """src [T, D], inv [T, k] (a permutation of the N = T*k rows) -> [N, D] with
    out[inv[t, j]] = src[t] (the permute: x and dout in expert order)."""
    n_tokens, k = inv.shape
    out = src.new_empty(n_tokens * k, src.shape[1])
    return out.index_copy_(0, inv.reshape(-1), src.repeat_interleave(k, dim=0))


def grouped_wgrad_torch(a: Tensor, b: Tensor, offs: Tensor, out_dtype: torch.dtype,
                        transpose_out: bool = False) -> Tensor:
    """a [R, M], b [R, N] (rows grouped by expert), offs [E] group ends -> [E, M, N] in
    ``out_dtype`` = a[rows_e]^T @ b[rows_e] per expert (a K-grouped ``torch._grouped_mm`` in
    the operands' dtype, then cast); ``transpose_out``: [E, N, M]."""
    if transpose_out:
        a, b = b, a
    return torch._grouped_mm(a.t(), b, offs=offs).to(out_dtype)


def grouped_mm_torch(a: Tensor, w: Tensor, offs: Tensor, trans_b: bool) -> Tensor:
    """a [R, K] (rows grouped by expert), w [E, K, N] (``trans_b``: [E, N, K]), offs [E] group
    ends -> [R, N]: a[rows_e] @ w[e] (w[e]^T) per expert (``torch._grouped_mm``)."""
    return torch._grouped_mm(a, w.transpose(-2, -1) if trans_b else w, offs=offs)


def _use_triton(device: torch.device) -> bool:
    """The Triton kernels run on CUDA, and on CPU tensors under the Triton interpreter."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


class _Ops(NamedTuple):
    scatter_rows: Callable[..., Tensor]
    gather_sum: Callable[..., Tensor]
    gate_up_swiglu: Callable[..., tuple[Tensor, Tensor]]  # (x_sorted, w_in, offs, w_sorted)
    swiglu_backward: Callable[..., tuple[Tensor, Tensor]]
    wgrad: Callable[..., Tensor]
    mm: Callable[..., Tensor]


def _ops(device: torch.device, config: MoEConfig) -> _Ops:
    """The elementwise steps and the grouped GEMMs for this device, with ``config``'s launch
    settings."""
    if _use_triton(device):
        from megacpp.kernels.ops.moe_experts import dispatch, gemm, swiglu

        def wgrad(a: Tensor, b: Tensor, offs: Tensor, out_dtype: torch.dtype,
                  transpose_out: bool = False) -> Tensor:
            if gemm.wgrad_triton_ok(a, b, config=config):
                return gemm.grouped_wgrad_triton(a, b, offs, out_dtype, transpose_out,
                                                 config=config)
            return grouped_wgrad_torch(a, b, offs, out_dtype, transpose_out)

        def mm(a: Tensor, w: Tensor, offs: Tensor, trans_b: bool) -> Tensor:
            if gemm.grouped_mm_ok(a, w, trans_b, config=config):
                return gemm.grouped_mm_triton(a, w, offs, trans_b, config=config)
            return grouped_mm_torch(a, w, offs, trans_b)

        def gate_up_swiglu(a: Tensor, w_in: Tensor, offs: Tensor, w_sorted: Tensor
                           ) -> tuple[Tensor, Tensor]:
            if gemm.grouped_swiglu_ok(a, w_in, config=config):
                return gemm.grouped_swiglu_triton(a, w_in, offs, w_sorted, config=config)
            gate_up = mm(a, w_in, offs, True)
            return gate_up, swiglu.swiglu_weighted_triton(gate_up, w_sorted, config=config)

        def scatter_rows(src: Tensor, inv: Tensor) -> Tensor:
            return dispatch.scatter_rows_triton(src, inv, config=config)

        def gather_sum(src: Tensor, inv: Tensor, addend: Tensor | None = None) -> Tensor:
            return dispatch.gather_sum_triton(src, inv, addend, config=config)

        def swiglu_backward(gate_up: Tensor, w: Tensor, dh: Tensor, order: Tensor,
                            dw_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
            return swiglu.swiglu_weighted_backward_triton(gate_up, w, dh, order, dw_dtype,
                                                          config=config)

        return _Ops(scatter_rows, gather_sum, gate_up_swiglu, swiglu_backward, wgrad, mm)

    def gate_up_swiglu_torch(a: Tensor, w_in: Tensor, offs: Tensor, w_sorted: Tensor
                             ) -> tuple[Tensor, Tensor]:
        gate_up = grouped_mm_torch(a, w_in, offs, True)
        return gate_up, swiglu_weighted_torch(gate_up, w_sorted)

    return _Ops(scatter_rows_torch, gather_sum_torch, gate_up_swiglu_torch,
                swiglu_weighted_backward_torch, grouped_wgrad_torch, grouped_mm_torch)


class _GroupedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weights: Tensor, w_in: Tensor, w_out: Tensor,
                order: Tensor, inv: Tensor, offs: Tensor, w_sorted: Tensor,
                addend: Tensor | None, compute_dtype: torch.dtype, config: MoEConfig) -> Tensor:
        ops = _ops(x.device, config)
        ctx.config = config
        # the weights arrive in their own dtype (float32 masters under autocast) and are cast
        # here, so that their gradients can be returned in that dtype by the wgrad GEMMs
        ctx.w_dtypes = (w_in.dtype, w_out.dtype)
        w_in, w_out = w_in.to(compute_dtype), w_out.to(compute_dtype)
        x_sorted = ops.scatter_rows(x, inv)  # [N, D]
        # [N, 2F], and [N, F] = silu(gate) * up * w (the routing weight folded in)
        gate_up, hidden = ops.gate_up_swiglu(x_sorted, w_in, offs, w_sorted)
        y_sorted = ops.mm(hidden, w_out, offs, True)  # [N, D]
        ctx.save_for_backward(x_sorted, gate_up, hidden, w_sorted, w_in, w_out, order, inv,
                              offs)
        ctx.weights_dtype = weights.dtype
        ctx.addend_dtype = None if addend is None else addend.dtype
        return ops.gather_sum(y_sorted, inv, addend)  # [T, D], + addend in the same kernel

    @staticmethod
    def backward(ctx, dout: Tensor):
        (x_sorted, gate_up, hidden, w_sorted, w_in, w_out, order, inv,
         offs) = ctx.saved_tensors
        ops = _ops(dout.device, ctx.config)
        need_x, need_w, need_in, need_out = ctx.needs_input_grad[:4]
        dy_sorted = ops.scatter_rows(dout.contiguous(), inv)  # [N, D]
        dhidden = ops.mm(dy_sorted, w_out, offs, False)  # [N, F]
        # [E, D, F] computed as hidden^T dy per expert: F (often narrow) on the tile's M
        dw_out = (ops.wgrad(hidden, dy_sorted, offs, ctx.w_dtypes[1], transpose_out=True)
                  if need_out else None)
        dgate_up, dweights = ops.swiglu_backward(gate_up, w_sorted, dhidden, order,
                                                 ctx.weights_dtype)  # [N, 2F], [N] slot order
        dx = dw_in = None
        if need_x:
            dx_sorted = ops.mm(dgate_up, w_in, offs, False)  # [N, D]
            dx = ops.gather_sum(dx_sorted, inv)
        if need_in:
            dw_in = ops.wgrad(dgate_up, x_sorted, offs, ctx.w_dtypes[0])  # [E, 2F, D]
        dweights = dweights.view(inv.shape) if need_w else None  # [T, k]
        # the addend's gradient is the output's
        daddend = dout.to(ctx.addend_dtype) if ctx.needs_input_grad[8] else None
        return dx, dweights, dw_in, dw_out, None, None, None, None, daddend, None, None


def moe_experts_grouped(
    x: Tensor, expert_idx: Tensor, weights: Tensor, w_in: Tensor, w_out: Tensor,
    addend: Tensor | None = None, config: MoEConfig | None = None,
) -> Tensor:
    """x [T, D]; expert_idx, weights [T, k]; w_in [E, 2F, D]; w_out [E, D, F] -> [T, D],
    plus ``addend`` [T, D] (added in the combine kernel). Under autocast, float32 x / w_in /
    w_out run in the autocast dtype, as the reference's matmuls do; the weights are cast
    inside (their gradients come back in their own dtype from the wgrad GEMMs). ``config``:
    the launch settings and the shapes the Triton GEMMs serve (default: ``configs.CONFIGS``
    for x's device)."""
    (x,) = autocast_operands(x)
    compute = effective_dtype(w_in)
    if effective_dtype(w_out) != compute:
        raise TypeError(f"moe_experts: w_in and w_out compute in {compute} and "
                        f"{effective_dtype(w_out)}; give both in one dtype")
    config = config or for_device(CONFIGS, x.device)
    plan = dispatch_plan(expert_idx, w_in.shape[0], weights, config)
    return _GroupedExperts.apply(x, weights, w_in, w_out, *plan, addend, compute, config)
