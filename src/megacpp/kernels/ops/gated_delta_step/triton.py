"""One Gated DeltaNet decode step in one Triton kernel (the ``gated_delta_step`` surface's
fast row).

The reference (``reference.py``) is the ``R`` mixer's decode path between in_proj and o_proj:
the rows' slots gathered from the state pool, the short causal conv's step and its tail, the
q / k L2 norms, the gates, one step of the gated delta rule, the state and conv tail scattered
back, the per-head output RMSNorm and the silu gate. In eager PyTorch that is dozens of small
kernels per layer; here it is one launch over (head, row): each program reads its row's slice
of in_proj's output, its slot's conv tail for the head's q, k and v channels and its [K, V]
state in place, and writes the new state, the new tail and y [V]. The projections stay GEMMs.

Rounding follows the reference: float32 math (float64 for float64 ``proj``), the conv output,
the normed q / k and the read-out rounded to ``proj``'s dtype where the mixer rounds them.
Padding rows may share a scratch slot; programs of those rows race on it (its contents are
then unspecified, as with the reference's ``index_copy_`` of repeated indices). No host syncs,
so the launch can be captured in a CUDA graph. Forward only: decode is inference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from megacpp.errors import MegaCppError
from megacpp.kernels.device import next_power_of_2
from megacpp.kernels.launch import for_device
from megacpp.kernels.ops.gated_delta_step.configs import CONFIGS
from megacpp.kernels.ops.gated_delta_step.reference import L2NORM_EPS, check_step_inputs
from megacpp.kernels.step_kernels import StepConfig
from megacpp.kernels.step_triton import TL_DTYPES, softplus

_L2NORM_EPS = tl.constexpr(L2NORM_EPS)
@triton.jit
def _conv_step(row, tail_row, weight, chan, mask, W: tl.constexpr, BW: tl.constexpr,
               IN_DT: tl.constexpr, CDT: tl.constexpr):
    """One token of the short causal conv + silu on channels ``chan``: (y [BC] rounded to
    proj's dtype, the new tail [BC, BW]: the channels' last W - 1 inputs, oldest first).
    ``tail_row`` points at the slot's [C, W - 1] conv inputs, ``weight`` at [C, W]."""
    cols = tl.arange(0, BW)
    tail = tl.zeros([chan.shape[0], BW], CDT)
    acc = tl.zeros([chan.shape[0]], CDT)
    for tap in tl.static_range(W - 1):  # the history, rounded to proj's dtype as the mixer does
        x = tl.load(tail_row + chan * (W - 1) + tap, mask=mask, other=0.0).to(IN_DT).to(CDT)
        acc = acc + x * tl.load(weight + chan * W + tap, mask=mask, other=0.0).to(CDT)
        if tap >= 1:
            tail = tl.where(cols[None, :] == tap - 1, x[:, None], tail)
    x = tl.load(row + chan, mask=mask, other=0.0).to(CDT)
    acc = acc + x * tl.load(weight + chan * W + W - 1, mask=mask, other=0.0).to(CDT)
    tail = tl.where(cols[None, :] == W - 2, x[:, None], tail)
    y = (acc / (1.0 + tl.exp(-acc))).to(IN_DT).to(CDT)  # silu
    return y, tail


@triton.jit
def _l2normed(x, IN_DT: tl.constexpr, CDT: tl.constexpr):
    """x / sqrt(sum(x^2) + 1e-6), rounded to proj's dtype (the mixer's l2norm)."""
    eps = tl.full([], _L2NORM_EPS, CDT)
    return (x * (1.0 / tl.sqrt(tl.sum(x * x, axis=0) + eps))).to(IN_DT).to(CDT)


@triton.jit
def _store_tail(tail_row, chan, mask, tail, W: tl.constexpr, BW: tl.constexpr,
                CONV_DT: tl.constexpr):
    cols = tl.arange(0, BW)
    ptrs = tail_row + chan[:, None] * (W - 1) + cols[None, :]
    tl.store(ptrs, tail.to(CONV_DT), mask=mask[:, None] & (cols[None, :] < W - 1))


@triton.jit
def _gated_delta_step_kernel(
    PROJ, STATE, CONV, SLOTS, CONV_W, A_LOG, DT_BIAS, NORM_W, Y,
    stride_proj, stride_y, s_state, s_conv, H,
    K: tl.constexpr, V: tl.constexpr, W: tl.constexpr, EPS: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BW: tl.constexpr, CDT: tl.constexpr,
    IN_DT: tl.constexpr, ST_DT: tl.constexpr, CONV_DT: tl.constexpr,
):
    """One program per (head h, row b); CDT the compute dtype, IN_DT proj's, ST_DT / CONV_DT
    the state's and the conv tail's."""
    h = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    slot = tl.load(SLOTS + b).to(tl.int64)
    key_dim = H * K
    conv_dim = 2 * key_dim + H * V
    row = PROJ + b * stride_proj  # [q | k | v | gate | a | b]
    tail_row = CONV + slot * s_conv
    offs_k = tl.arange(0, BK)
    offs_v = tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V

    # the conv step on the head's q, k and v channels; q, k L2-normed
    q_chan = h * K + offs_k
    k_chan = key_dim + h * K + offs_k
    v_chan = 2 * key_dim + h * V + offs_v
    q, q_tail = _conv_step(row, tail_row, CONV_W, q_chan, mask_k, W, BW, IN_DT, CDT)
    k, k_tail = _conv_step(row, tail_row, CONV_W, k_chan, mask_k, W, BW, IN_DT, CDT)
    v, v_tail = _conv_step(row, tail_row, CONV_W, v_chan, mask_v, W, BW, IN_DT, CDT)
    tl.debug_barrier()  # every thread's reads of the slot's conv inputs come before the writes
    _store_tail(tail_row, q_chan, mask_k, q_tail, W, BW, CONV_DT)
    _store_tail(tail_row, k_chan, mask_k, k_tail, W, BW, CONV_DT)
    _store_tail(tail_row, v_chan, mask_v, v_tail, W, BW, CONV_DT)
    q = _l2normed(q, IN_DT, CDT)
    k = _l2normed(k, IN_DT, CDT)

    # gates: g = -exp(A_log) softplus(a + dt_bias) (alpha = exp(g)), beta = sigmoid(b)
    a = tl.load(row + conv_dim + H * V + h).to(CDT)
    b_logit = tl.load(row + conv_dim + H * V + H + h).to(CDT)
    g = -tl.exp(tl.load(A_LOG + h).to(CDT)) * softplus(a + tl.load(DT_BIAS + h).to(CDT))
    alpha = tl.exp(g)
    beta = 1.0 / (1.0 + tl.exp(-b_logit))

    # S = alpha S;  S += k (beta (v - S^T k))^T;  o = S^T (q K^-1/2)   [K, V]
    state_ptrs = (STATE + slot * s_state + h * K * V + offs_k[:, None] * V + offs_v[None, :])
    mask_kv = mask_k[:, None] & mask_v[None, :]
    state = alpha * tl.load(state_ptrs, mask=mask_kv, other=0.0).to(CDT)
    v_stored = tl.sum(k[:, None] * state, axis=0)  # [BV] what the memory holds at k
    v_new = beta * (v - v_stored)
    state = state + k[:, None] * v_new[None, :]
    scale = 1.0 / tl.sqrt(tl.full([BK], K, CDT))
    o = tl.sum((q * scale)[:, None] * state, axis=0).to(IN_DT).to(CDT)  # [BV]

    # y = rms_norm(o) * norm_weight * silu(gate)
    rstd = 1.0 / tl.sqrt(tl.sum(o * o, axis=0) / V + tl.full([], EPS, CDT))
    weight = tl.load(NORM_W + offs_v, mask=mask_v, other=0.0).to(CDT)
    gate = tl.load(row + conv_dim + h * V + offs_v, mask=mask_v, other=0.0).to(CDT)
    y = o * rstd * weight * (gate / (1.0 + tl.exp(-gate)))

    tl.debug_barrier()  # every thread's reads of the slot's state come before the writes
    tl.store(state_ptrs, state.to(ST_DT), mask=mask_kv)
    tl.store(Y + b * stride_y + h * V + offs_v, y.to(IN_DT), mask=mask_v)


def gated_delta_step_triton(
    proj: Tensor, state: Tensor, conv_state: Tensor, slots: Tensor, conv_weight: Tensor,
    A_log: Tensor, dt_bias: Tensor, norm_weight: Tensor, *, eps: float = 1e-5,
    config: StepConfig | None = None,
) -> Tensor:
    """:func:`~megacpp.kernels.ops.gated_delta_step.reference.gated_delta_step_reference` in
    one launch (same arguments and result; the pool rows ``slots`` are updated in place).
    Needs the pool tensors and parameters contiguous and the rows of ``proj`` unit-stride.
    ``config``: the launch settings (default: ``configs.CONFIGS`` for proj's device)."""
    check_step_inputs(proj, state, conv_state, slots, conv_weight, A_log, dt_bias, norm_weight)
    for name, t in (("state", state), ("conv_state", conv_state), ("slots", slots),
                    ("conv_weight", conv_weight), ("A_log", A_log), ("dt_bias", dt_bias),
                    ("norm_weight", norm_weight)):
        if not t.is_contiguous():
            raise MegaCppError(f"gated_delta_step triton: {name} must be contiguous")
    if proj.stride(-1) != 1:
        raise MegaCppError("gated_delta_step triton: proj's rows must be unit-stride")
    if proj.dtype not in TL_DTYPES:
        raise MegaCppError(f"gated_delta_step triton: proj must be one of "
                           f"{sorted(str(d) for d in TL_DTYPES)}, got {proj.dtype}")
    for name, t in (("state", state), ("conv_state", conv_state)):
        if t.dtype not in (torch.float32, torch.float64):
            raise MegaCppError(f"gated_delta_step triton: {name} must be float32 or float64, "
                               f"got {t.dtype}")
    batch = proj.shape[0]
    _, n_heads, head_k_dim, head_v_dim = state.shape
    width = conv_weight.shape[1]
    y = torch.empty(batch, n_heads * head_v_dim, device=proj.device, dtype=proj.dtype)
    if batch == 0:
        return y
    config = config or for_device(CONFIGS, proj.device)
    block_k, block_v = next_power_of_2(head_k_dim), next_power_of_2(head_v_dim)
    _gated_delta_step_kernel[(n_heads, batch)](
        proj, state, conv_state, slots, conv_weight, A_log, dt_bias, norm_weight, y,
        proj.stride(0), y.stride(0), state.stride(0), conv_state.stride(0), n_heads,
        K=head_k_dim, V=head_v_dim, W=width, EPS=float(eps),
        BK=block_k, BV=block_v, BW=next_power_of_2(width - 1),
        CDT=tl.float64 if proj.dtype == torch.float64 else tl.float32,
        IN_DT=TL_DTYPES[proj.dtype], ST_DT=TL_DTYPES[state.dtype],
        CONV_DT=TL_DTYPES[conv_state.dtype],
        num_warps=config.warps(block_k * block_v, proj.dtype == torch.float64),
    )
    return y
