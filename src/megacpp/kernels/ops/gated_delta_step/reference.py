"""Plain-PyTorch reference for one Gated DeltaNet decode step on a slot-addressed state pool.

What the ``R`` mixer's paged decode step computes between its two projections, per row b of
the batch (the mixer's module docstring has the per-token equations)::

    qkv, gate, a, b = split(proj[b])                   # in_proj's output, one token
    qkv, tail = short causal conv + silu(qkv | conv_state[slots[b]])   # tail: last W-1 inputs
    q, k = l2norm(q), l2norm(k)                        # per head, rounded to proj's dtype
    g = -exp(A_log) * softplus(a + dt_bias)            beta = sigmoid(b)
    o, S = one step of gated_delta_rule_recurrent from state[slots[b]]
    state[slots[b]], conv_state[slots[b]] = S, tail
    y = rms_norm(o) * norm_weight * silu(gate)         # per head, rounded to proj's dtype

This is the mixer's own decode path (``RecurrentMixer.forward_paged``: gather the rows'
slots, ``GatedDeltaNetMixer.step``, scatter), written as one function of in_proj's output so
a fused kernel can replace it. The mixer computes its gates and output with the helpers here.
Forward only (decode is inference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from megacpp.kernels.ops.gated_delta.reference import gated_delta_rule_recurrent
from megacpp.kernels.ops.short_conv.reference import short_causal_conv

L2NORM_EPS = 1e-6  # fla's l2norm epsilon: x / sqrt(sum(x^2) + eps)


def l2norm(x: Tensor) -> Tensor:
    """Normalise the last dim to unit L2 norm (fla's ``x / sqrt(sum(x^2) + 1e-6)``), in at
    least float32."""
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    return (x32 * torch.rsqrt(x32.square().sum(-1, keepdim=True) + L2NORM_EPS)).to(x.dtype)


def decay_and_write_strength(a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor
                             ) -> tuple[Tensor, Tensor]:
    """(g, beta) from in_proj's a and b columns [..., H], in at least float32:
    g = -exp(A_log) * softplus(a + dt_bias) (the log decay, <= 0), beta = sigmoid(b)."""
    f32 = torch.promote_types(a.dtype, torch.float32)
    g = -A_log.to(f32).exp() * F.softplus(a.to(f32) + dt_bias.to(f32))
    return g, b.to(f32).sigmoid()


def gated_rms_output(o: Tensor, gate: Tensor, norm_weight: Tensor, eps: float,
                     out_dtype: torch.dtype) -> Tensor:
    """The per-head output RMSNorm and gate: o [B, L, H, V], gate [B, L, H*V] ->
    rms_norm(o) * norm_weight * silu(gate) as [B, L, H*V] in ``out_dtype`` (o_proj's
    input), float32 math (float64 for float64 ``out_dtype``)."""
    B, L, H, V = o.shape
    f32 = torch.promote_types(out_dtype, torch.float32)
    o = F.rms_norm(o.to(f32), (V,), norm_weight.to(f32), eps)
    o = o * F.silu(gate.to(f32).view(B, L, H, V))
    return o.flatten(2).to(out_dtype)


def step_split(n_heads: int, head_k_dim: int, head_v_dim: int) -> list[int]:
    """Widths of in_proj's output columns: [q | k | v (the conv's channels), gate, a, b]."""
    conv_dim = 2 * n_heads * head_k_dim + n_heads * head_v_dim
    return [conv_dim, n_heads * head_v_dim, n_heads, n_heads]


def check_step_inputs(
    proj: Tensor, state: Tensor, conv_state: Tensor, slots: Tensor, conv_weight: Tensor,
    A_log: Tensor, dt_bias: Tensor, norm_weight: Tensor,
) -> None:
    """Fail with a message naming the tensor, its shape and the expected shape."""
    if state.ndim != 4 or proj.ndim != 2 or conv_weight.ndim != 2:
        raise ValueError(f"gated_delta_step: proj must be [B, width], state [S, H, K, V] and "
                         f"conv_weight [C, W], got {tuple(proj.shape)}, {tuple(state.shape)} "
                         f"and {tuple(conv_weight.shape)}")
    n_slots, n_heads, head_k_dim, head_v_dim = state.shape
    split = step_split(n_heads, head_k_dim, head_v_dim)
    width = conv_weight.shape[1]
    if width < 2:
        raise ValueError(f"gated_delta_step: the conv needs at least 2 taps, got {width}")
    expected = {
        "proj": (proj, (proj.shape[0], sum(split))),
        "conv_state": (conv_state, (n_slots, split[0], width - 1)),
        "slots": (slots, (proj.shape[0],)),
        "conv_weight": (conv_weight, (split[0], width)),
        "A_log": (A_log, (n_heads,)),
        "dt_bias": (dt_bias, (n_heads,)),
        "norm_weight": (norm_weight, (head_v_dim,)),
    }
    for name, (tensor, shape) in expected.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"gated_delta_step: {name} has shape {tuple(tensor.shape)}, "
                             f"expected {shape}")
    if slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"gated_delta_step: slots must be int32 or int64, got {slots.dtype}")


def gated_delta_step_reference(
    proj: Tensor, state: Tensor, conv_state: Tensor, slots: Tensor, conv_weight: Tensor,
    A_log: Tensor, dt_bias: Tensor, norm_weight: Tensor, *, eps: float = 1e-5,
) -> Tensor:
    """One decode step of ``B`` rows; updates rows ``slots`` of the state pool in place.

    Args:
        proj: [B, 2*H*K + 2*H*V + 2*H] in_proj's output for each row's one token
            (q | k | v | gate | a | b).
        state, conv_state: the state pool (a ``GatedDeltaCache``'s tensors, one row per
            slot): [S, H, K, V] (fla's orientation, o = state^T q) and [S, C, W-1]
            (C = 2*H*K + H*V conv inputs, oldest first), float32 or float64.
        slots: [B] int the pool row of each batch row (distinct, except padding rows, which
            may share a scratch slot whose contents are then unspecified).
        conv_weight [C, W], A_log [H], dt_bias [H], norm_weight [V]: the mixer's parameters.
        eps: the output RMSNorm's epsilon.
    Returns:
        y [B, H*V] in proj's dtype: what o_proj multiplies.
    """
    check_step_inputs(proj, state, conv_state, slots, conv_weight, A_log, dt_bias, norm_weight)
    B = proj.shape[0]
    _, H, K, V = state.shape
    qkv, gate, a, b = proj[:, None].split(step_split(H, K, V), dim=-1)  # [B, 1, .]
    rows_state, rows_conv = state.index_select(0, slots), conv_state.index_select(0, slots)
    qkv, tail = short_causal_conv(qkv, conv_weight, rows_conv, None)  # tail [B, C, W-1]
    q, k, v = qkv.split([H * K, H * K, H * V], dim=-1)
    g, beta = decay_and_write_strength(a, b, A_log, dt_bias)  # [B, 1, H]
    o, final = gated_delta_rule_recurrent(
        l2norm(q.view(B, 1, H, K)), l2norm(k.view(B, 1, H, K)), v.view(B, 1, H, V), g, beta,
        initial_state=rows_state, output_final_state=True,
    )  # o [B, 1, H, V] in proj's dtype
    rows_state.copy_(final)
    rows_conv.copy_(tail)
    state.index_copy_(0, slots, rows_state)
    conv_state.index_copy_(0, slots, rows_conv)
    return gated_rms_output(o, gate, norm_weight, eps, proj.dtype)[:, 0]  # [B, H*V]
