"""Plain-PyTorch reference for the Mamba-3 MIMO scan: recurrent truth and chunked form.

MIMO ("multi-input multi-output", the Mamba-3 paper; mamba_ssm's ``is_mimo``) gives each
head R = mimo_rank query/key vectors per token and R up-projected copies of its input, so
the state takes a rank-R update per token instead of a rank-1 one. Per head h
(P = headdim, N = d_state, A = rotated pairs, r = 0..R-1):

    theta_t = (theta_{t-1} + pi * tanh(angles_t) * dt_t) mod 2 pi              # [A]
    q_{t,r} = rot(C_{t,r} + C_bias_r, theta_t)   k_{t,r} = rot(B_{t,r} + B_bias_r, theta_t)  # [N]
    v_{t,r} = mimo_v_r * x_t                     z_{t,r} = mimo_z_r * z_t     # [P], elementwise
    lam_t = sigmoid(trap_t)    alpha_t = exp(adt_t)
    beta_t = (1 - lam_t) * dt_t * alpha_t    gamma_t = lam_t * dt_t
    h_t = alpha_t h_{t-1} + beta_t sum_r v_{t-1,r} k_{t-1,r}^T + gamma_t sum_r v_{t,r} k_{t,r}^T
    y_{t,r} = (h_t q_{t,r} + D v_{t,r}) * silu(z_{t,r})                         # [P]
    y_t = sum_r mimo_o_r * y_{t,r}          (when mimo_o is given; else y_{t,r} is returned)

The inputs mean what they mean for mamba_ssm's ``mamba3_mimo`` (TileLang): q, k are
``[B, L, R, G, N]`` (rank before group, as its in_proj lays B and C out), biases and the
three MIMO projections ``[H, R, N]`` / ``[H, R, P]``. ``rot`` pairs dim ``i`` with dim
``i + N/2`` for ``i < A`` (the pairing of mamba_ssm's MIMO kernels; the SISO scan pairs
adjacent dims), so the same tensors go to both. Per-head scalars are ``[B, L, H]`` (mamba_ssm:
``[B, H, L]``), and ``reset`` marks packed documents as in the SISO scan.

Both forms compute in float32 (float64 when ``v`` is float64) and return ``y`` in
``v.dtype`` plus the final :class:`~megacpp.kernels.ops.mamba3_scan.Mamba3ScanState` in the
compute dtype, its fields shaped angle [B, H, A], ssm [B, H, P, N], k [B, R, H, N] (the last
token's biased, rotated keys) and v [B, H, P] (the last token's x, before the up-projection).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from megacpp.kernels.ops.mamba3_scan.reference import (
    _TWO_PI,
    Mamba3ScanState,
    _checked_state,
    _chunk_states_weights,
    _compute_dtype,
    _keep_mask,
    _pass_states,
    _to_chunks,
    _zeros_state,
)
from megacpp.kernels.recompute import recompute_in_backward


def zero_mimo_state(
    batch: int, nheads: int, headdim: int, d_state: int, n_angles: int, rank: int,
    *, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32,
) -> Mamba3ScanState:
    """The state of an empty prefix: all zeros."""
    return _zeros_state(mimo_state_shapes(batch, nheads, headdim, d_state, n_angles, rank),
                       device, dtype)


def mimo_state_shapes(
    batch: int, nheads: int, headdim: int, d_state: int, n_angles: int, rank: int
) -> tuple[tuple[int, ...], ...]:
    """Shapes of (angle, ssm, k, v), in :class:`Mamba3ScanState` field order."""
    return (
        (batch, nheads, n_angles),
        (batch, nheads, headdim, d_state),
        (batch, rank, nheads, d_state),
        (batch, nheads, headdim),
    )


def mamba3_mimo_scan_recurrent(
    q: Tensor, k: Tensor, v: Tensor, adt: Tensor, dt: Tensor, trap: Tensor,
    q_bias: Tensor, k_bias: Tensor, mimo_v: Tensor, angles: Tensor,
    mimo_z: Tensor | None = None, mimo_o: Tensor | None = None,
    D: Tensor | None = None, z: Tensor | None = None, reset: Tensor | None = None,
    initial_state: Mamba3ScanState | None = None,
) -> tuple[Tensor, Mamba3ScanState]:
    """Token-by-token Mamba-3 MIMO recurrence (the truth the other forms are tested against).

    Args:
        q: [B, L, R, G, N] C after its RMSNorm, before bias (G groups shared by H // G heads).
        k: [B, L, R, G, N] B after its RMSNorm, before bias.
        v: [B, L, H, P] x.
        adt: [B, L, H] log decay A * dt (<= 0).  dt: [B, L, H] step size (> 0).
        trap: [B, L, H] trapezoid logits; lambda = sigmoid(trap).
        q_bias, k_bias: [H, R, N] per-head, per-rank biases added to C and B.
        mimo_v: [H, R, P] up-projection of x to the R inputs.
        angles: [B, L, H, A] angle logits, A <= N // 2; the angle rate is pi * tanh(angles).
        mimo_z: [H, R, P] up-projection of z (needed with z).
        mimo_o: [H, R, P] down-projection of the R outputs; None returns them [B, L, R, H, P].
        D: [H] skip weight, or None.  z: [B, L, H, P] gate, or None.
        reset: [B, L] bool, True at the first token of a new document; or None.
        initial_state: state to continue from; None means zeros.
    Returns:
        y: [B, L, H, P] (or [B, L, R, H, P] without mimo_o) in v.dtype, and the final state.
    """
    _check_inputs(q, k, v, adt, dt, trap, q_bias, k_bias, mimo_v, angles, mimo_z, mimo_o, D,
                  z, reset)
    batch, seqlen, nheads, _ = v.shape
    cdt = _compute_dtype(v)
    q, k = _biased_heads(q, q_bias, nheads, cdt), _biased_heads(k, k_bias, nheads, cdt)
    x, adt, dt = v.to(cdt), adt.to(cdt), dt.to(cdt)
    xr = _up(x, mimo_v, cdt)  # [B, L, R, H, P]
    lam = torch.sigmoid(trap.to(cdt))
    rate = math.pi * torch.tanh(angles.to(cdt))  # [B, L, H, A]
    keep = _keep_mask(reset, batch, seqlen, v.device, cdt)  # [B, L]
    state = _initial_state(initial_state, x, q.shape[2], q.shape[-1], angles.shape[-1])
    angle, ssm, k_prev, x_prev = state.tensors()
    v_prev = _up(x_prev[:, None], mimo_v, cdt)[:, 0]  # [B, R, H, P]

    ys = []
    for t in range(seqlen):
        angle = torch.remainder(angle + rate[:, t] * dt[:, t, :, None], _TWO_PI)
        q_t, k_t = _rotate(q[:, t], angle[:, None]), _rotate(k[:, t], angle[:, None])
        v_t = xr[:, t]  # [B, R, H, P]
        alpha = torch.exp(adt[:, t]) * keep[:, t, None]  # [B, H]; 0 at a reset
        beta = (1 - lam[:, t]) * dt[:, t] * alpha
        gamma = lam[:, t] * dt[:, t]
        ssm = (
            alpha[..., None, None] * ssm
            + beta[..., None, None] * _rank_sum_outer(v_prev, k_prev)
            + gamma[..., None, None] * _rank_sum_outer(v_t, k_t)
        )  # [B, H, P, N]
        ys.append((ssm[:, None] * q_t[:, :, :, None, :]).sum(-1))  # [B, R, H, P]
        k_prev, v_prev = k_t, v_t

    y = _skip_gate_down(torch.stack(ys, dim=1), xr, D, z, mimo_z, mimo_o, cdt)
    return y.to(v.dtype), Mamba3ScanState(angle, ssm, k_prev, x[:, -1])


def mamba3_mimo_scan_chunked(
    q: Tensor, k: Tensor, v: Tensor, adt: Tensor, dt: Tensor, trap: Tensor,
    q_bias: Tensor, k_bias: Tensor, mimo_v: Tensor, angles: Tensor,
    mimo_z: Tensor | None = None, mimo_o: Tensor | None = None,
    D: Tensor | None = None, z: Tensor | None = None, reset: Tensor | None = None,
    initial_state: Mamba3ScanState | None = None, chunk_size: int = 64,
    output_final_state: bool = True,
) -> tuple[Tensor, Mamba3ScanState | None]:
    """Chunked parallel form of :func:`mamba3_mimo_scan_recurrent`; same arguments, and
    ``output_final_state=False`` returns ``(y, None)``.

    The SISO chunked scan with every token widened to R (query, key, value) triples: the
    trapezoid's per-token weight ``scale_s`` and the decays are per token (shared by its R
    triples), so inside a chunk the masked quadratic form runs over T*R rows and columns, and
    the chunk state sums T*R outer products. L is padded to a multiple of ``min(chunk_size,
    L)`` with tokens that change nothing.
    """
    return chunked_scan(
        _intra_chunk, _pass_states, q, k, v, adt, dt, trap, q_bias, k_bias, mimo_v, angles,
        mimo_z, mimo_o, D, z, reset, initial_state, chunk_size, output_final_state)


def chunked_scan(
    intra: Callable[..., Tensor], pass_states: Callable[..., tuple[Tensor, Tensor]],
    q: Tensor, k: Tensor, v: Tensor, adt: Tensor, dt: Tensor, trap: Tensor,
    q_bias: Tensor, k_bias: Tensor, mimo_v: Tensor, angles: Tensor,
    mimo_z: Tensor | None, mimo_o: Tensor | None, D: Tensor | None, z: Tensor | None,
    reset: Tensor | None, initial_state: Mamba3ScanState | None, chunk_size: int,
    output_final_state: bool,
) -> tuple[Tensor, Mamba3ScanState | None]:
    """:func:`mamba3_mimo_scan_chunked` with its intra-chunk quadratic form computed by
    ``intra`` and the sequential pass over chunks by ``pass_states`` (the arguments and
    results of :func:`_intra_chunk` and the SISO scan's ``_pass_states``; the Triton backend
    passes its kernels).

    Under autograd it keeps only its inputs for backward and recomputes the rest there
    (:func:`~megacpp.kernels.recompute.recompute_in_backward`): the rank-expanded
    ``[B, L, R, H, P]`` / ``[B, L, R, H, N]`` float32 intermediates (rotated q and k, the R
    inputs, the two read-outs, skip, gate) and the chunk states would otherwise stay alive
    from forward to backward, several GiB per layer at training sizes (docs/mamba3.md)."""
    _check_inputs(q, k, v, adt, dt, trap, q_bias, k_bias, mimo_v, angles, mimo_z, mimo_o, D,
                  z, reset)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size}")
    state = (None,) * 4 if initial_state is None else initial_state.tensors()

    def run(*tensors: Tensor | None) -> tuple[Tensor, ...]:
        *scan_inputs, s_angle, s_ssm, s_k, s_v = tensors
        initial = None if s_angle is None else Mamba3ScanState(s_angle, s_ssm, s_k, s_v)
        y, final = _chunked_forward(intra, pass_states, *scan_inputs, reset, initial,
                                    chunk_size, output_final_state)
        return (y,) if final is None else (y, *final.tensors())

    y, *final = recompute_in_backward(run, q, k, v, adt, dt, trap, q_bias, k_bias, mimo_v,
                                      angles, mimo_z, mimo_o, D, z, *state)
    return y, (Mamba3ScanState(*final) if final else None)


def _chunked_forward(
    intra: Callable[..., Tensor], pass_states: Callable[..., tuple[Tensor, Tensor]],
    q: Tensor, k: Tensor, v: Tensor, adt: Tensor, dt: Tensor, trap: Tensor,
    q_bias: Tensor, k_bias: Tensor, mimo_v: Tensor, angles: Tensor,
    mimo_z: Tensor | None, mimo_o: Tensor | None, D: Tensor | None, z: Tensor | None,
    reset: Tensor | None, initial_state: Mamba3ScanState | None, chunk_size: int,
    output_final_state: bool,
) -> tuple[Tensor, Mamba3ScanState | None]:
    """:func:`chunked_scan`'s computation on checked inputs."""
    batch, seqlen, nheads, _ = v.shape
    cdt = _compute_dtype(v)
    x, adt, dt = v.to(cdt), adt.to(cdt), dt.to(cdt)
    xr = _up(x, mimo_v, cdt)  # [B, L, R, H, P]
    lam = torch.sigmoid(trap.to(cdt))
    state = _initial_state(initial_state, x, q.shape[2], q.shape[-1], angles.shape[-1])

    rate = math.pi * torch.tanh(angles.to(cdt))
    theta = torch.remainder(state.angle[:, None] + torch.cumsum(rate * dt[..., None], 1), _TWO_PI)
    q = _rotate(_biased_heads(q, q_bias, nheads, cdt), theta[:, :, None])  # [B, L, R, H, N]
    k = _rotate(_biased_heads(k, k_bias, nheads, cdt), theta[:, :, None])

    gamma = lam * dt  # [B, L, H]
    prev_weight = (1 - lam) * dt  # weight of token t-1's triples at t, before alpha_t
    scale = gamma + F.pad(prev_weight[:, 1:], (0, 0, 0, 1))
    # the triples carried in the state enter at t = 0; a reset there drops them with h_{-1}
    v_prev = _up(state.v[:, None], mimo_v, cdt)[:, 0]
    ssm0 = state.ssm + prev_weight[:, 0, :, None, None] * _rank_sum_outer(v_prev, state.k)
    if reset is None:
        reset = torch.zeros(batch, seqlen, dtype=torch.bool, device=v.device)

    T = min(chunk_size, seqlen)
    qc, kc, xc, adtc, gammac, scalec, resetc = (
        _to_chunks(t, T) for t in (q, k, xr, adt, gamma, scale, reset)
    )  # [B, C, T, ...]
    a_cs = torch.cumsum(adtc, dim=2).transpose(2, 3)  # [B, C, H, T] decay log from chunk start
    seg = torch.cumsum(resetc.long(), dim=2)  # [B, C, T] resets seen so far in the chunk

    y_intra = intra(qc, kc, xc, a_cs, gammac, scalec, seg)
    chunk_state, chunk_decay = _chunk_states(kc, xc, a_cs, scalec, seg)
    ssm_in, ssm_final = pass_states(ssm0, chunk_state, chunk_decay)
    carry = (torch.exp(a_cs) * (seg == 0)[:, :, None]).transpose(2, 3)  # [B, C, T, H]
    y_inter = torch.einsum("bctrhn,bchpn->bctrhp", qc, ssm_in) * carry[:, :, :, None, :, None]

    y = (y_intra + y_inter).flatten(1, 2)[:, :seqlen]  # [B, L, R, H, P]
    y = _skip_gate_down(y, xr, D, z, mimo_z, mimo_o, cdt)
    if not output_final_state:
        return y.to(v.dtype), None
    return y.to(v.dtype), Mamba3ScanState(theta[:, -1], ssm_final, k[:, -1], x[:, -1])


def flops_per_token(
    seq_len: int, chunk_size: int, nheads: int, headdim: int, d_state: int, rank: int
) -> int:
    """Matmul FLOPs per token of :func:`mamba3_mimo_scan_chunked` (2*m*n*k per matmul), rounded.

    Per head and padded token: the T*R x T*R scores 2*T*R^2*N, scores @ v 2*T*R^2*P, the
    chunk state 2*R*P*N and the carried state's read-out 2*R*P*N (T = min(chunk_size,
    seq_len)). The up- and down-projections, rotation, decays and trapezoid are elementwise
    and not counted (FlopCounterMode does not count them). At R = 1 this is the SISO count.
    """
    T = min(chunk_size, seq_len)
    padded = math.ceil(seq_len / T) * T
    per_padded_token = 2 * T * rank * rank * (d_state + headdim) + 4 * rank * headdim * d_state
    return round(nheads * padded * per_padded_token / seq_len)


def _intra_chunk(
    q: Tensor, k: Tensor, x: Tensor, a_cs: Tensor, gamma: Tensor, scale: Tensor, seg: Tensor
) -> Tensor:
    """y from triples inside the same chunk: q, k [B, C, T, R, H, N], x [B, C, T, R, H, P]
    -> [B, C, T, R, H, P]."""
    T = q.shape[2]
    strictly_causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril(-1)
    same_doc = seg[..., :, None] == seg[..., None, :]  # [B, C, T, T]
    valid = (strictly_causal & same_doc)[:, :, None]  # [B, C, 1, T, T]
    log_decay = a_cs[..., :, None] - a_cs[..., None, :]  # [B, C, H, T(t), T(s)]
    decay = torch.exp(torch.where(valid, log_decay, -math.inf))  # mask before exp: no inf*0
    weights = decay * scale.transpose(2, 3)[..., None, :] + torch.diag_embed(gamma.transpose(2, 3))
    scores = torch.einsum("bctrhn,bcsuhn->bchtrsu", q, k)  # [B, C, H, T, R, T, R]
    scores = scores * weights[:, :, :, :, None, :, None]
    return torch.einsum("bchtrsu,bcsuhp->bctrhp", scores, x)


def _chunk_states(
    k: Tensor, x: Tensor, a_cs: Tensor, scale: Tensor, seg: Tensor
) -> tuple[Tensor, Tensor]:
    """Each chunk's own contribution to the state at its end [B, C, H, P, N], and its total
    decay [B, C, H] (0 if the chunk has a reset)."""
    token_weight, chunk_decay = _chunk_states_weights(a_cs, scale, seg)  # [B, C, T, H]
    k_weighted = k * token_weight[:, :, :, None, :, None]  # [B, C, T, R, H, N]
    chunk_state = torch.einsum("bcsuhn,bcsuhp->bchpn", k_weighted, x)
    return chunk_state, chunk_decay


def _rotate(x: Tensor, theta: Tensor) -> Tensor:
    """Rotate pairs (x[i], x[i + N/2]) by theta[i] for i < A; the other dims pass through.

    x: [..., N] with N even, theta: [..., A] (broadcast against x's leading dims), A <= N/2.
    """
    half, n_rot = x.shape[-1] // 2, theta.shape[-1]
    x0, x1 = x[..., :n_rot], x[..., half: half + n_rot]
    cos, sin = torch.cos(theta), torch.sin(theta)
    return torch.cat([x0 * cos - x1 * sin, x[..., n_rot:half],
                      x0 * sin + x1 * cos, x[..., half + n_rot:]], dim=-1)


def _biased_heads(x: Tensor, bias: Tensor, nheads: int, dtype: torch.dtype) -> Tensor:
    """[B, L, R, G, N] grouped -> [B, L, R, H, N] per head (head h reads group h // (H // G)),
    + bias [H, R, N]."""
    heads = x.to(dtype).repeat_interleave(nheads // x.shape[3], dim=3)
    return heads + bias.to(dtype).transpose(0, 1)


def _up(x: Tensor, proj: Tensor, dtype: torch.dtype) -> Tensor:
    """[B, L, H, P] times proj [H, R, P] per channel -> [B, L, R, H, P] (elementwise)."""
    return x.to(dtype)[:, :, None] * proj.to(dtype).transpose(0, 1)


def _rank_sum_outer(v: Tensor, k: Tensor) -> Tensor:
    """sum_r v_r k_r^T: [B, R, H, P] x [B, R, H, N] -> [B, H, P, N] (broadcast and sum, so it
    costs no matmul FLOPs)."""
    return (v[..., :, None] * k[..., None, :]).sum(1)


def _skip_gate_down(
    y: Tensor, xr: Tensor, D: Tensor | None, z: Tensor | None, mimo_z: Tensor | None,
    mimo_o: Tensor | None, dtype: torch.dtype,
) -> Tensor:
    """y [B, L, R, H, P] + D v_r, times silu(mimo_z_r z), summed over r with mimo_o."""
    if D is not None:
        y = y + D.to(dtype)[:, None] * xr
    if z is not None:
        y = y * F.silu(_up(z, mimo_z, dtype))
    if mimo_o is not None:
        y = (y * mimo_o.to(dtype).transpose(0, 1)).sum(2)  # [B, L, H, P]
    return y


def _initial_state(
    state: Mamba3ScanState | None, x: Tensor, rank: int, d_state: int, n_angles: int
) -> Mamba3ScanState:
    """The given state checked and cast to x's dtype, or zeros. x: [B, L, H, P]."""
    batch, _, nheads, headdim = x.shape
    expected = mimo_state_shapes(batch, nheads, headdim, d_state, n_angles, rank)
    return _checked_state(state, expected, x)


def _check_inputs(
    q: Tensor, k: Tensor, v: Tensor, adt: Tensor, dt: Tensor, trap: Tensor,
    q_bias: Tensor, k_bias: Tensor, mimo_v: Tensor, angles: Tensor,
    mimo_z: Tensor | None, mimo_o: Tensor | None, D: Tensor | None, z: Tensor | None,
    reset: Tensor | None,
) -> None:
    """Fail with a message naming the tensor, its shape and the expected shape."""
    if v.ndim != 4 or q.ndim != 5:
        raise ValueError(f"q must be 5-D [B, L, R, G, N] and v 4-D [B, L, H, P], got q "
                         f"{tuple(q.shape)} and v {tuple(v.shape)}")
    batch, seqlen, nheads, headdim = v.shape
    rank, groups, d_state = q.shape[2:]
    if seqlen == 0:
        raise ValueError("the scan needs at least one token (L >= 1)")
    if nheads % groups:
        raise ValueError(f"nheads ({nheads}) must be a multiple of the q/k groups ({groups})")
    if d_state % 2:
        raise ValueError(
            f"d_state must be even (dims i and i + N/2 rotate together), got {d_state}")
    if (z is None) != (mimo_z is None):
        raise ValueError("z and mimo_z come together: pass both or neither")
    expected = {
        "q": (q, (batch, seqlen, rank, groups, d_state)),
        "k": (k, (batch, seqlen, rank, groups, d_state)),
        "adt": (adt, (batch, seqlen, nheads)),
        "dt": (dt, (batch, seqlen, nheads)),
        "trap": (trap, (batch, seqlen, nheads)),
        "q_bias": (q_bias, (nheads, rank, d_state)),
        "k_bias": (k_bias, (nheads, rank, d_state)),
        "mimo_v": (mimo_v, (nheads, rank, headdim)),
        "mimo_z": (mimo_z, (nheads, rank, headdim)),
        "mimo_o": (mimo_o, (nheads, rank, headdim)),
        "angles": (angles, (batch, seqlen, nheads, angles.shape[-1])),
        "D": (D, (nheads,)),
        "z": (z, (batch, seqlen, nheads, headdim)),
        "reset": (reset, (batch, seqlen)),
    }
    for name, (tensor, shape) in expected.items():
        if tensor is not None and tuple(tensor.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {shape}")
    if not 1 <= angles.shape[-1] <= d_state // 2:
        raise ValueError(f"angles.shape[-1] must be in [1, d_state // 2 = {d_state // 2}]")
    if reset is not None and reset.dtype != torch.bool:
        raise ValueError(f"reset must be a bool tensor, got {reset.dtype}")
