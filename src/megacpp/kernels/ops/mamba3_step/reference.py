"""Plain-PyTorch reference for one Mamba-3 SISO decode step on a slot-addressed state pool.

What the mixer's paged decode step computes between its two projections, per row b of the
batch (docs/mamba3.md has the recurrence):

    z, x, B, C, dd_dt, dd_A, trap, angles = split(proj[b])     # in_proj's output, one token
    dt = softplus(dd_dt + dt_bias)      adt = -max(softplus(dd_A), A_floor) * dt
    q = rms_norm(C) * C_norm_weight     k = rms_norm(B) * B_norm_weight   (per group, rounded
                                                                            to proj's dtype)
    state = pool[slots[b]]; y, state = one step of mamba3_scan_recurrent; pool[slots[b]] = state
    y = rms_norm(y) * norm_weight      (per head, when norm_weight is given)

This is the mixer's own decode path (``RecurrentMixer.forward_paged``: gather the rows'
slots, ``Mamba3Mixer.step`` with its gates, B/C norms, recurrent scan and output norm,
scatter), written as one function of in_proj's output so a fused kernel can replace it.
Forward only (decode is inference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from megacpp.kernels.ops.mamba3_scan.reference import Mamba3ScanState, mamba3_scan_recurrent


def step_split(nheads: int, headdim: int, ngroups: int, d_state: int, n_angles: int
               ) -> list[int]:
    """Widths of in_proj's output columns: [z, x, B, C, dd_dt, dd_A, trap, angles]."""
    d_inner = nheads * headdim
    return [d_inner, d_inner, ngroups * d_state, ngroups * d_state, nheads, nheads, nheads,
            n_angles]


def check_step_inputs(
    proj: Tensor, angle: Tensor, ssm: Tensor, k: Tensor, v: Tensor, slots: Tensor,
    dt_bias: Tensor, B_norm_weight: Tensor, C_norm_weight: Tensor, B_bias: Tensor,
    C_bias: Tensor, D: Tensor, norm_weight: Tensor | None, ngroups: int,
) -> None:
    """Fail with a message naming the tensor, its shape and the expected shape."""
    if ssm.ndim != 4 or proj.ndim != 2:
        raise ValueError(f"mamba3_step: proj must be [B, width] and ssm [slots, H, P, N], got "
                         f"{tuple(proj.shape)} and {tuple(ssm.shape)}")
    n_slots, nheads, headdim, d_state = ssm.shape
    n_angles = angle.shape[-1]
    if ngroups < 1 or nheads % ngroups:
        raise ValueError(f"mamba3_step: nheads ({nheads}) must be a multiple of ngroups "
                         f"({ngroups})")
    if not 1 <= n_angles <= d_state // 2:
        raise ValueError(f"mamba3_step: angle.shape[-1] must be in [1, d_state // 2 = "
                         f"{d_state // 2}], got {n_angles}")
    width = sum(step_split(nheads, headdim, ngroups, d_state, n_angles))
    expected = {
        "proj": (proj, (proj.shape[0], width)),
        "angle": (angle, (n_slots, nheads, n_angles)),
        "k": (k, (n_slots, nheads, d_state)),
        "v": (v, (n_slots, nheads, headdim)),
        "slots": (slots, (proj.shape[0],)),
        "dt_bias": (dt_bias, (nheads,)),
        "B_norm_weight": (B_norm_weight, (d_state,)),
        "C_norm_weight": (C_norm_weight, (d_state,)),
        "B_bias": (B_bias, (nheads, d_state)),
        "C_bias": (C_bias, (nheads, d_state)),
        "D": (D, (nheads,)),
        "norm_weight": (norm_weight, (nheads * headdim,)),
    }
    for name, (tensor, shape) in expected.items():
        if tensor is not None and tuple(tensor.shape) != shape:
            raise ValueError(f"mamba3_step: {name} has shape {tuple(tensor.shape)}, expected "
                             f"{shape}")
    if slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"mamba3_step: slots must be int32 or int64, got {slots.dtype}")
    if len({angle.dtype, ssm.dtype, k.dtype, v.dtype}) != 1:
        raise ValueError("mamba3_step: the state tensors (angle, ssm, k, v) must share a dtype")


def decode_gates(dd_dt: Tensor, dd_a: Tensor, dt_bias: Tensor, a_floor: float
                 ) -> tuple[Tensor, Tensor]:
    """(A * dt, dt) in at least float32, as the mixer's gates compute them:
    dt = softplus(dd_dt + dt_bias), A = -max(softplus(dd_A), A_floor)."""
    up = torch.promote_types(dd_dt.dtype, torch.float32)
    dt = F.softplus(dd_dt.to(up) + dt_bias)
    a = -F.softplus(dd_a.to(up)).clamp(min=a_floor)
    return a * dt, dt


def _group_norm(x: Tensor, weight: Tensor, d_state: int, ngroups: int, eps: float) -> Tensor:
    """The mixer's B / C RMSNorm: [B, 1, G*N] -> [B, 1, G, N], float32 math, x's dtype out."""
    f32 = torch.promote_types(x.dtype, torch.float32)
    grouped = x.unflatten(-1, (ngroups, d_state)).to(f32)
    return F.rms_norm(grouped, (d_state,), weight.to(f32), eps).to(x.dtype)


def mamba3_step_reference(
    proj: Tensor, angle: Tensor, ssm: Tensor, k: Tensor, v: Tensor, slots: Tensor,
    dt_bias: Tensor, B_norm_weight: Tensor, C_norm_weight: Tensor, B_bias: Tensor,
    C_bias: Tensor, D: Tensor, norm_weight: Tensor | None = None, *, ngroups: int = 1,
    A_floor: float = 1e-4, eps: float = 1e-5,
) -> Tensor:
    """One decode step of ``B`` rows; updates rows ``slots`` of the state pool in place.

    Args:
        proj: [B, 2*H*P + 2*G*N + 3*H + R] in_proj's output for each row's one token.
        angle, ssm, k, v: the state pool (a :class:`Mamba3ScanState`'s tensors, one row per
            slot): [S, H, R], [S, H, P, N], [S, H, N], [S, H, P] (float32 or float64).
        slots: [B] int the pool row of each batch row (distinct, except padding rows, which
            may share a scratch slot whose contents are then unspecified).
        dt_bias [H], B_norm_weight / C_norm_weight [N], B_bias / C_bias [H, N], D [H]: the
            mixer's parameters; norm_weight [H*P] the output norm's weight, or None (no
            output norm).
        ngroups: G, groups of B / C; A_floor, eps: the mixer's.
    Returns:
        y [B, H*P] in proj's dtype: what out_proj multiplies.
    """
    check_step_inputs(proj, angle, ssm, k, v, slots, dt_bias, B_norm_weight, C_norm_weight,
                      B_bias, C_bias, D, norm_weight, ngroups)
    _, nheads, headdim, d_state = ssm.shape
    split = step_split(nheads, headdim, ngroups, d_state, angle.shape[-1])
    z, x, b, c, dd_dt, dd_a, trap, angles = proj[:, None].split(split, dim=-1)  # [B, 1, .]
    adt, dt = decode_gates(dd_dt, dd_a, dt_bias, A_floor)  # [B, 1, H]
    state = Mamba3ScanState(*(t.index_select(0, slots) for t in (angle, ssm, k, v)))
    y, final = mamba3_scan_recurrent(
        q=_group_norm(c, C_norm_weight, d_state, ngroups, eps),
        k=_group_norm(b, B_norm_weight, d_state, ngroups, eps),
        v=x.unflatten(-1, (nheads, headdim)), adt=adt, dt=dt, trap=trap,
        q_bias=C_bias, k_bias=B_bias,
        angles=angles[:, :, None, :].expand(-1, -1, nheads, -1),  # shared by the heads
        D=D, z=z.unflatten(-1, (nheads, headdim)), initial_state=state,
    )  # y [B, 1, H, P] in proj's dtype
    state.update_(final)
    for pool, new in zip((angle, ssm, k, v), state.tensors(), strict=True):
        pool.index_copy_(0, slots, new)
    if norm_weight is not None:
        f32 = torch.promote_types(y.dtype, torch.float32)
        weight = norm_weight.to(f32).view(nheads, headdim)
        y = (F.rms_norm(y.to(f32), (headdim,), eps=eps) * weight).to(y.dtype)
    return y.flatten(1)  # [B, 1, H, P] -> [B, H*P]
