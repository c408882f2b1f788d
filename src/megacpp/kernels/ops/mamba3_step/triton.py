"""One Mamba-3 SISO decode step in one Triton kernel (the ``mamba3_step`` surface's fast row).

The reference (``reference.py``) is the mixer's decode path between in_proj and out_proj:
the row's slots gathered from the state pool, the gates, the B / C RMSNorms, one step of the
recurrent scan (rotation, trapezoid, read-out, skip, gate), the state scattered back and the
per-head output RMSNorm. In eager PyTorch that is ~100 small kernels per layer (elementwise
ops, copies, index_select / index_copy); here it is one launch over (head, row): each program
reads its row's slice of in_proj's output and its slot's state [P, N] in place, and writes
the new state and y [P]. The big projections stay cuBLAS GEMMs.

Rounding follows the reference: float32 math (float64 for float64 ``proj``), the normed B / C
and the gated scan output rounded to ``proj``'s dtype where the mixer rounds them. Padding
rows may share a scratch slot; programs of those rows race on it (its contents are then
unspecified, as with the reference's ``index_copy_`` of repeated indices). No host syncs, so
the launch can be captured in a CUDA graph. Forward only: decode is inference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from megacpp.errors import MegaCppError
from megacpp.kernels.device import next_power_of_2
from megacpp.kernels.launch import for_device
from megacpp.kernels.ops.mamba3_step.configs import CONFIGS
from megacpp.kernels.ops.mamba3_step.reference import check_step_inputs
from megacpp.kernels.step_kernels import StepConfig
from megacpp.kernels.step_triton import TL_DTYPES, softplus


@triton.jit
def _tanh(x):
    """tanh from exp (no tanh in triton.language that also runs in the interpreter)."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _normed(row, weight, offs, mask, rstd, IN_DT: tl.constexpr, CDT: tl.constexpr):
    """rms_norm(x)[offs] * weight[offs] rounded to proj's dtype, as the mixer's B / C norm."""
    x = tl.load(row + offs, mask=mask, other=0.0).to(CDT)
    w = tl.load(weight + offs, mask=mask, other=0.0).to(CDT)
    return (x * rstd * w).to(IN_DT).to(CDT)


@triton.jit
def _rotated(row, weight, bias, offs_n, mask_n, rot, cos, sin, N, eps,
             IN_DT: tl.constexpr, CDT: tl.constexpr):
    """One group's B or C [N] at ``row``: RMS-normed, + the head's ``bias``, its first R pairs
    (n, n ^ 1) rotated by the angle of their pair (cos, sin per n)."""
    raw = tl.load(row + offs_n, mask=mask_n, other=0.0).to(CDT)
    rstd = 1.0 / tl.sqrt(tl.sum(raw * raw, axis=0) / N + eps)
    partner = offs_n ^ 1
    x = _normed(row, weight, offs_n, mask_n, rstd, IN_DT, CDT)
    x = x + tl.load(bias + offs_n, mask=mask_n, other=0.0).to(CDT)
    x_partner = _normed(row, weight, partner, rot, rstd, IN_DT, CDT)
    x_partner = x_partner + tl.load(bias + partner, mask=rot, other=0.0).to(CDT)
    # pair (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos)
    signed_sin = tl.where(offs_n % 2 == 0, -sin, sin)
    return tl.where(rot, x * cos + x_partner * signed_sin, x)


@triton.jit
def _mamba3_step_kernel(
    PROJ, ANGLE, SSM, KS, VS, SLOTS, DT_BIAS, BW, CW, BB, CB, DSKIP, NW, Y,
    stride_proj, stride_y, s_angle, s_ssm, s_k, s_v,
    H, G, P, N, R, A_floor, eps,
    BP: tl.constexpr, BN: tl.constexpr, HAS_NORM: tl.constexpr, CDT: tl.constexpr,
    IN_DT: tl.constexpr, ST_DT: tl.constexpr,
):
    """One program per (head h, row b); CDT the compute dtype, IN_DT proj's, ST_DT the
    state's."""
    h = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    slot = tl.load(SLOTS + b).to(tl.int64)
    g = h // (H // G)
    d_inner = H * P
    row = PROJ + b * stride_proj  # [z, x, B, C, dd_dt, dd_A, trap, angles]
    o_scalars = 2 * d_inner + 2 * G * N
    offs_p = tl.arange(0, BP)
    offs_n = tl.arange(0, BN)
    mask_p = offs_p < P
    mask_n = offs_n < N
    rot = offs_n < 2 * R  # the rotated pairs, pair j = n // 2

    # gates: dt = softplus(dd_dt + dt_bias), adt = -max(softplus(dd_A), A_floor) * dt
    dd_dt = tl.load(row + o_scalars + h).to(CDT)
    dd_a = tl.load(row + o_scalars + H + h).to(CDT)
    trap = tl.load(row + o_scalars + 2 * H + h).to(CDT)
    dt = softplus(dd_dt + tl.load(DT_BIAS + h).to(CDT))
    adt = -tl.maximum(softplus(dd_a), A_floor) * dt
    lam = 1.0 / (1.0 + tl.exp(-trap))
    alpha = tl.exp(adt)
    beta = (1.0 - lam) * dt * alpha
    gamma = lam * dt

    # theta = (theta_prev + pi tanh(angles) dt) mod 2 pi, laid out per n (both of a pair's n)
    two_pi = tl.full([BN], 6.283185307179586, CDT)
    angle_row = ANGLE + slot * s_angle + h * R
    theta = tl.load(angle_row + offs_n // 2, mask=rot, other=0.0).to(CDT)
    logits = tl.load(row + o_scalars + 3 * H + offs_n // 2, mask=rot, other=0.0).to(CDT)
    theta = theta + tl.full([BN], 3.141592653589793, CDT) * _tanh(logits) * dt
    theta = theta - two_pi * tl.floor(theta / two_pi)
    cos, sin = tl.cos(theta), tl.sin(theta)

    c_row = row + 2 * d_inner + G * N + g * N
    b_row = row + 2 * d_inner + g * N
    q = _rotated(c_row, CW, CB + h * N, offs_n, mask_n, rot, cos, sin, N, eps, IN_DT, CDT)
    k = _rotated(b_row, BW, BB + h * N, offs_n, mask_n, rot, cos, sin, N, eps, IN_DT, CDT)
    z = tl.load(row + h * P + offs_p, mask=mask_p, other=0.0).to(CDT)
    x = tl.load(row + d_inner + h * P + offs_p, mask=mask_p, other=0.0).to(CDT)

    # h_t = alpha h + beta v_prev k_prev^T + gamma x k^T   [P, N]
    ssm_ptrs = SSM + slot * s_ssm + h * P * N + offs_p[:, None] * N + offs_n[None, :]
    mask_pn = mask_p[:, None] & mask_n[None, :]
    state = tl.load(ssm_ptrs, mask=mask_pn, other=0.0).to(CDT)
    k_prev = tl.load(KS + slot * s_k + h * N + offs_n, mask=mask_n, other=0.0).to(CDT)
    v_prev = tl.load(VS + slot * s_v + h * P + offs_p, mask=mask_p, other=0.0).to(CDT)
    state = (alpha * state + beta * (v_prev[:, None] * k_prev[None, :])
             + gamma * (x[:, None] * k[None, :]))

    # y = (h_t q + D x) * silu(z), rounded to proj's dtype as the scan returns it
    y = tl.sum(state * q[None, :], axis=1)
    y = y + tl.load(DSKIP + h).to(CDT) * x
    y = (y * (z / (1.0 + tl.exp(-z)))).to(IN_DT)
    if HAS_NORM:  # the per-head output RMSNorm (group size P)
        yf = tl.where(mask_p, y.to(CDT), 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(yf * yf, axis=0) / P + eps)
        weight = tl.load(NW + h * P + offs_p, mask=mask_p, other=0.0).to(CDT)
        y = (yf * rstd * weight).to(IN_DT)

    tl.store(Y + b * stride_y + h * P + offs_p, y, mask=mask_p)
    tl.store(ssm_ptrs, state.to(ST_DT), mask=mask_pn)
    tl.store(KS + slot * s_k + h * N + offs_n, k.to(ST_DT), mask=mask_n)
    tl.store(VS + slot * s_v + h * P + offs_p, x.to(ST_DT), mask=mask_p)
    tl.store(angle_row + offs_n // 2, theta.to(ST_DT), mask=rot & (offs_n % 2 == 0))


def mamba3_step_triton(
    proj: Tensor, angle: Tensor, ssm: Tensor, k: Tensor, v: Tensor, slots: Tensor,
    dt_bias: Tensor, B_norm_weight: Tensor, C_norm_weight: Tensor, B_bias: Tensor,
    C_bias: Tensor, D: Tensor, norm_weight: Tensor | None = None, *, ngroups: int = 1,
    A_floor: float = 1e-4, eps: float = 1e-5, config: StepConfig | None = None,
) -> Tensor:
    """:func:`~megacpp.kernels.ops.mamba3_step.reference.mamba3_step_reference` in one launch
    (same arguments and result; the pool rows ``slots`` are updated in place). Needs the
    state tensors and parameters contiguous and the rows of ``proj`` unit-stride. ``config``:
    the launch settings (default: ``configs.CONFIGS`` for proj's device)."""
    check_step_inputs(proj, angle, ssm, k, v, slots, dt_bias, B_norm_weight, C_norm_weight,
                      B_bias, C_bias, D, norm_weight, ngroups)
    params = (dt_bias, B_norm_weight, C_norm_weight, B_bias, C_bias, D, norm_weight)
    for name, t in zip(("angle", "ssm", "k", "v", "slots", "dt_bias", "B_norm_weight",
                        "C_norm_weight", "B_bias", "C_bias", "D", "norm_weight"),
                       (angle, ssm, k, v, slots, *params), strict=True):
        if t is not None and not t.is_contiguous():
            raise MegaCppError(f"mamba3_step triton: {name} must be contiguous")
    if proj.stride(-1) != 1:
        raise MegaCppError("mamba3_step triton: proj's rows must be unit-stride")
    if proj.dtype not in TL_DTYPES:
        raise MegaCppError(f"mamba3_step triton: proj must be one of "
                           f"{sorted(str(d) for d in TL_DTYPES)}, got {proj.dtype}")
    if ssm.dtype not in (torch.float32, torch.float64):
        raise MegaCppError(f"mamba3_step triton: the state must be float32 or float64, got "
                           f"{ssm.dtype}")
    batch = proj.shape[0]
    _, nheads, headdim, d_state = ssm.shape
    y = torch.empty(batch, nheads * headdim, device=proj.device, dtype=proj.dtype)
    if batch == 0:
        return y
    config = config or for_device(CONFIGS, proj.device)
    compute = tl.float64 if proj.dtype == torch.float64 else tl.float32
    block_p, block_n = next_power_of_2(headdim), next_power_of_2(d_state)
    _mamba3_step_kernel[(nheads, batch)](
        proj, angle, ssm, k, v, slots, dt_bias, B_norm_weight, C_norm_weight, B_bias, C_bias,
        D, norm_weight if norm_weight is not None else y, y,
        proj.stride(0), y.stride(0), angle.stride(0), ssm.stride(0), k.stride(0), v.stride(0),
        nheads, ngroups, headdim, d_state, angle.shape[-1], A_floor, eps,
        BP=block_p, BN=block_n, HAS_NORM=norm_weight is not None, CDT=compute,
        IN_DT=TL_DTYPES[proj.dtype], ST_DT=TL_DTYPES[ssm.dtype],
        num_warps=config.warps(block_p * block_n, proj.dtype == torch.float64),
    )
    return y
