"""The weighted SwiGLU over the grouped GEMM's [N, 2F] gate|up output in Triton (same
contracts as the plain-PyTorch versions in :mod:`megacpp.kernels.ops.moe_experts.grouped`,
their truth):

* :func:`swiglu_weighted_triton` -- ``silu(gate) * up * w``, the routing weight folded in
  before the down projection.
* :func:`swiglu_weighted_backward_triton` -- d(gate|up) and the routing weight's gradient
  (a row reduction, written straight to its (token, choice) slot) in one pass, recomputing
  the activation from gate|up.

Launch settings: ``configs.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from megacpp.kernels.device import cdiv, next_power_of_2
from megacpp.kernels.launch import for_device
from megacpp.kernels.ops.moe_experts.common import _bound, _const
from megacpp.kernels.ops.moe_experts.configs import CONFIGS, MoEConfig


@triton.jit
def _weighted_swiglu(gate, up, w):
    """silu(gate) * up * w in float32 (the forward kernel's and the gate|up epilogue's one
    formula, so the two give the same hidden bit for bit)."""
    gate = gate.to(tl.float32)
    return gate * tl.sigmoid(gate) * up.to(tl.float32) * w


@triton.jit
def _swiglu_fwd_kernel(GU, W, H, n_rows, ffn, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr,
                       F_CONST: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    w = tl.load(W + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    gu_row = GU + rows.to(tl.int64)[:, None] * (2 * ffn)
    h_row = H + rows.to(tl.int64)[:, None] * ffn
    for start in range(0, _bound(ffn, F_CONST), BLOCK_F):
        cols = start + tl.arange(0, BLOCK_F)[None, :]
        mask = row_ok[:, None] & (cols < ffn)
        gate = tl.load(gu_row + cols, mask=mask, other=0.0)
        up = tl.load(gu_row + ffn + cols, mask=mask, other=0.0)
        act = _weighted_swiglu(gate, up, w)
        tl.store(h_row + cols, act.to(H.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(GU, W, DH, ORDER, DGU, DW, n_rows, ffn, BLOCK_R: tl.constexpr,
                       BLOCK_F: tl.constexpr, F_CONST: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    w = tl.load(W + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    gu_row = GU + rows.to(tl.int64)[:, None] * (2 * ffn)
    dgu_row = DGU + rows.to(tl.int64)[:, None] * (2 * ffn)
    dh_row = DH + rows.to(tl.int64)[:, None] * ffn
    dw = tl.zeros((BLOCK_R,), tl.float32)
    for start in range(0, _bound(ffn, F_CONST), BLOCK_F):
        cols = start + tl.arange(0, BLOCK_F)[None, :]
        mask = row_ok[:, None] & (cols < ffn)
        gate = tl.load(gu_row + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gu_row + ffn + cols, mask=mask, other=0.0).to(tl.float32)
        dh = tl.load(dh_row + cols, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        silu = gate * sig
        dw += tl.sum(dh * silu * up, axis=1)
        dact = dh * w
        dgate = dact * up * sig * (1.0 + gate * (1.0 - sig))
        tl.store(dgu_row + cols, dgate.to(DGU.dtype.element_ty), mask=mask)
        tl.store(dgu_row + ffn + cols, (dact * silu).to(DGU.dtype.element_ty), mask=mask)
    slot = tl.load(ORDER + rows, mask=row_ok, other=0)  # sorted row -> (token, choice)
    tl.store(DW + slot, dw.to(DW.dtype.element_ty), mask=row_ok)


def _row_blocks(ffn: int, config: MoEConfig) -> tuple[int, int]:
    block_f = min(next_power_of_2(ffn), config.swiglu_cols)
    return max(1, config.swiglu_elems // block_f), block_f


def swiglu_weighted_triton(gate_up: Tensor, w: Tensor, config: MoEConfig | None = None
                           ) -> Tensor:
    """gate_up [N, 2F], w [N] -> [N, F] = silu(gate) * up * w (float32 math)."""
    config = config or for_device(CONFIGS, gate_up.device)
    n_rows, ffn = gate_up.shape[0], gate_up.shape[1] // 2
    h = torch.empty(n_rows, ffn, device=gate_up.device, dtype=gate_up.dtype)
    block_r, block_f = _row_blocks(ffn, config)
    _swiglu_fwd_kernel[(cdiv(n_rows, block_r),)](
        gate_up.contiguous(), w.contiguous(), h, n_rows, ffn, BLOCK_R=block_r, BLOCK_F=block_f,
        F_CONST=_const(ffn), num_warps=config.swiglu_warps)
    return h


def swiglu_weighted_backward_triton(gate_up: Tensor, w: Tensor, dh: Tensor, order: Tensor,
                                    dw_dtype: torch.dtype, config: MoEConfig | None = None
                                    ) -> tuple[Tensor, Tensor]:
    """gate_up [N, 2F], w [N], dh [N, F], order [N] (sorted row -> (token, choice) slot)
    -> d gate_up [N, 2F] (gate_up.dtype), dweights [N] in slot order (``dw_dtype``) =
    sum_f dh * silu(gate) * up, float32 sums."""
    config = config or for_device(CONFIGS, gate_up.device)
    n_rows, ffn = gate_up.shape[0], gate_up.shape[1] // 2
    dgate_up = torch.empty_like(gate_up)
    dweights = torch.empty(n_rows, device=gate_up.device, dtype=dw_dtype)
    block_r, block_f = _row_blocks(ffn, config)
    _swiglu_bwd_kernel[(cdiv(n_rows, block_r),)](
        gate_up.contiguous(), w.contiguous(), dh.contiguous(), order, dgate_up, dweights, n_rows,
        ffn, BLOCK_R=block_r, BLOCK_F=block_f, F_CONST=_const(ffn),
        num_warps=config.swiglu_warps)
    return dgate_up, dweights
