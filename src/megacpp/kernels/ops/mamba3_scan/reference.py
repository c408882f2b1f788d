"""Plain-PyTorch reference for the Mamba-3 SISO scan: recurrent truth and chunked form.

The recurrence, per head h (P = headdim, N = d_state, R = rotated pairs):

    theta_t = (theta_{t-1} + pi * tanh(angles_t) * dt_t) mod 2 pi          # [R]
    q_t = rot(C_t + C_bias, theta_t)         k_t = rot(B_t + B_bias, theta_t)   # [N]
    lam_t = sigmoid(trap_t)    alpha_t = exp(adt_t)
    beta_t = (1 - lam_t) * dt_t * alpha_t    gamma_t = lam_t * dt_t
    h_t = alpha_t h_{t-1} + beta_t v_{t-1} k_{t-1}^T + gamma_t v_t k_t^T    # [P, N]
    y_t = (h_t q_t + D v_t) * silu(z_t)                                     # [P]

``q`` plays C, ``k`` plays B and ``v`` plays x, as in ``mamba_ssm``'s
``mamba3_siso_combined``; the inputs mean what they mean there (raw ``trap`` and ``angles``
logits, biases and rotation applied inside). Layout is time-major: per-head scalars are
``[B, L, H]`` where mamba_ssm uses ``[B, H, L]``.

A document reset at t (``reset[b, t]``) zeroes ``h_{t-1}`` and the trapezoid's
previous-token term (alpha_t -> 0, hence beta_t -> 0). The angle keeps accumulating: every
interaction left after a reset is between tokens of one document, so only angle differences
inside the document matter and the absolute offset cancels.

Both forms compute in float32 (float64 when ``v`` is float64) and return ``y`` in
``v.dtype`` plus the final :class:`Mamba3ScanState` in the compute dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

_TWO_PI = 2 * math.pi


@dataclass
class Mamba3ScanState:
    """What the scan needs to continue a sequence (mamba_ssm's order: angle, ssm, k, v), and
    a Mamba-3 mixer's decode cache for ``B`` sequences (all tensors share one dtype).

    angle: [B, H, R] cumulative rotation angle of the last token, in [0, 2 pi).
    ssm:   [B, H, P, N] the state h after the last token (P = headdim, N = d_state).
    k:     [B, H, N] the last token's biased, rotated k (the trapezoid's previous term).
    v:     [B, H, P] the last token's v.
    """

    angle: Tensor
    ssm: Tensor
    k: Tensor
    v: Tensor

    def tensors(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(angle, ssm, k, v), the field order."""
        return self.angle, self.ssm, self.k, self.v

    def is_zero(self) -> bool:
        """True when every state tensor is zero (nothing seen yet): a scan continuing from it is
        the scan with no initial state. Reads the result on the host (a device sync)."""
        return not any(bool(t.any()) for t in self.tensors())

    def update_(self, state: Mamba3ScanState) -> None:
        """Overwrite in place with a scan's final state (no gradient flows into the cache)."""
        for mine, new in zip(self.tensors(), state.tensors(), strict=True):
            mine.copy_(new.detach())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


_STATE_FIELDS = ("angle", "ssm", "k", "v")  # Mamba3ScanState's (a plain tuple: torch.compile)


def zero_scan_state(
    batch: int, nheads: int, headdim: int, d_state: int, n_angles: int,
    *, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32,
) -> Mamba3ScanState:
    """The state of an empty prefix: all zeros."""
    return _zeros_state(_state_shapes(batch, nheads, headdim, d_state, n_angles), device, dtype)


def _zeros_state(
    shapes: tuple[tuple[int, ...], ...], device: torch.device | str | None, dtype: torch.dtype
) -> Mamba3ScanState:
    """A state of zeros with the given (angle, ssm, k, v) shapes."""
    return Mamba3ScanState(*(torch.zeros(s, device=device, dtype=dtype) for s in shapes))


def _state_shapes(
    batch: int, nheads: int, headdim: int, d_state: int, n_angles: int
) -> tuple[tuple[int, ...], ...]:
    """Shapes of (angle, ssm, k, v), in :class:`Mamba3ScanState` field order."""
    return (
        (batch, nheads, n_angles),
        (batch, nheads, headdim, d_state),
        (batch, nheads, d_state),
        (batch, nheads, headdim),
    )


def mamba3_scan_recurrent(
    q: Tensor, k: Tensor, v: Tensor, adt: Tensor, dt: Tensor, trap: Tensor,
    q_bias: Tensor, k_bias: Tensor, angles: Tensor,
    D: Tensor | None = None, z: Tensor | None = None, reset: Tensor | None = None,
    initial_state: Mamba3ScanState | None = None,
) -> tuple[Tensor, Mamba3ScanState]:
    """Token-by-token Mamba-3 SISO recurrence (the truth the other forms are tested against).

    Args:
        q: [B, L, G, N] C after its RMSNorm, before bias (G groups shared by H // G heads).
        k: [B, L, G, N] B after its RMSNorm, before bias.
        v: [B, L, H, P] x.
        adt: [B, L, H] log decay A * dt (<= 0).
        dt: [B, L, H] step size (> 0).
        trap: [B, L, H] trapezoid logits; lambda = sigmoid(trap).
        q_bias, k_bias: [H, N] per-head biases added to C and B.
        angles: [B, L, H, R] angle logits, R <= N // 2; the angle rate is pi * tanh(angles).
        D: [H] skip weight, or None for no skip.
        z: [B, L, H, P] gate, or None for no gate; y is multiplied by silu(z).
        reset: [B, L] bool, True at the first token of a new document; or None.
        initial_state: state to continue from; None means zeros.
    Returns:
        y: [B, L, H, P] in v.dtype, and the final state.
    """
    _check_inputs(q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, reset)
    batch, seqlen, nheads, _ = v.shape
    cdt = _compute_dtype(v)
    q, k = _biased_heads(q, q_bias, nheads, cdt), _biased_heads(k, k_bias, nheads, cdt)
    x, adt, dt = v.to(cdt), adt.to(cdt), dt.to(cdt)
    lam = torch.sigmoid(trap.to(cdt))
    rate = math.pi * torch.tanh(angles.to(cdt))  # [B, L, H, R]
    keep = _keep_mask(reset, batch, seqlen, v.device, cdt)  # [B, L]
    angle, ssm, k_prev, v_prev = _initial_state(initial_state, x, q.shape[-1],
                                                angles.shape[-1]).tensors()

    ys = []
    for t in range(seqlen):
        angle = torch.remainder(angle + rate[:, t] * dt[:, t, :, None], _TWO_PI)
        q_t, k_t, v_t = _rotate(q[:, t], angle), _rotate(k[:, t], angle), x[:, t]
        alpha = torch.exp(adt[:, t]) * keep[:, t, None]  # [B, H]; 0 at a reset
        beta = (1 - lam[:, t]) * dt[:, t] * alpha
        gamma = lam[:, t] * dt[:, t]
        ssm = (
            alpha[..., None, None] * ssm
            + beta[..., None, None] * _outer(v_prev, k_prev)
            + gamma[..., None, None] * _outer(v_t, k_t)
        )  # [B, H, P, N]
        ys.append((ssm * q_t[:, :, None, :]).sum(-1))  # [B, H, P]
        k_prev, v_prev = k_t, v_t

    y = _skip_and_gate(torch.stack(ys, dim=1), x, D, z)
    return y.to(v.dtype), Mamba3ScanState(angle, ssm, k_prev, v_prev)


def mamba3_scan_chunked(
    q: Tensor, k: Tensor, v: Tensor, adt: Tensor, dt: Tensor, trap: Tensor,
    q_bias: Tensor, k_bias: Tensor, angles: Tensor,
    D: Tensor | None = None, z: Tensor | None = None, reset: Tensor | None = None,
    initial_state: Mamba3ScanState | None = None, chunk_size: int = 64,
    output_final_state: bool = True,
) -> tuple[Tensor, Mamba3ScanState | None]:
    """Chunked parallel (SSD-style) form of :func:`mamba3_scan_recurrent`; same arguments, and
    ``output_final_state=False`` returns ``(y, None)`` (a training step that keeps no cache:
    the fast backend then skips the kernel that forms it).

    The trapezoid folds into one weight per token: the pair (v_s, k_s) enters h_s with
    gamma_s and h_{s+1} with beta_{s+1} = (1 - lam_{s+1}) dt_{s+1} alpha_{s+1}, so for t > s
    its total weight in h_t is decay(s -> t) * scale_s with
    scale_s = gamma_s + (1 - lam_{s+1}) dt_{s+1}, and at t == s it is gamma_s.
    Inside a chunk that is a masked quadratic form; across chunks the state is passed.
    L is padded up to a multiple of ``min(chunk_size, L)`` with tokens that change nothing.
    """
    _check_inputs(q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, reset)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size}")
    batch, seqlen, nheads, _ = v.shape
    cdt = _compute_dtype(v)
    x, adt, dt = v.to(cdt), adt.to(cdt), dt.to(cdt)
    lam = torch.sigmoid(trap.to(cdt))
    state = _initial_state(initial_state, x, q.shape[-1], angles.shape[-1])

    rate = math.pi * torch.tanh(angles.to(cdt))
    theta = torch.remainder(state.angle[:, None] + torch.cumsum(rate * dt[..., None], 1), _TWO_PI)
    q = _rotate(_biased_heads(q, q_bias, nheads, cdt), theta)  # [B, L, H, N]
    k = _rotate(_biased_heads(k, k_bias, nheads, cdt), theta)

    gamma = lam * dt  # [B, L, H]
    prev_weight = (1 - lam) * dt  # weight of token t-1's pair at t, before alpha_t
    scale = gamma + F.pad(prev_weight[:, 1:], (0, 0, 0, 1))
    # The pair carried in the state enters at t = 0; a reset there drops it with h_{-1}.
    ssm0 = state.ssm + prev_weight[:, 0, :, None, None] * _outer(state.v, state.k)
    if reset is None:
        reset = torch.zeros(batch, seqlen, dtype=torch.bool, device=v.device)

    T = min(chunk_size, seqlen)
    qc, kc, xc, adtc, gammac, scalec, resetc = (
        _to_chunks(t, T) for t in (q, k, x, adt, gamma, scale, reset)
    )  # [B, C, T, ...]
    a_cs = torch.cumsum(adtc, dim=2).transpose(2, 3)  # [B, C, H, T] decay log from chunk start
    seg = torch.cumsum(resetc.long(), dim=2)  # [B, C, T] resets seen so far in the chunk

    y_intra = _intra_chunk(qc, kc, xc, a_cs, gammac, scalec, seg)
    chunk_state, chunk_decay = _chunk_states(kc, xc, a_cs, scalec, seg)
    ssm_in, ssm_final = _pass_states(ssm0, chunk_state, chunk_decay)
    carry = (torch.exp(a_cs) * (seg == 0)[:, :, None]).transpose(2, 3)  # [B, C, T, H]
    y_inter = torch.einsum("bcthn,bchpn->bcthp", qc, ssm_in) * carry[..., None]

    y = (y_intra + y_inter).flatten(1, 2)[:, :seqlen]  # [B, L, H, P]
    y = _skip_and_gate(y, x, D, z)
    if not output_final_state:
        return y.to(v.dtype), None
    return y.to(v.dtype), Mamba3ScanState(theta[:, -1], ssm_final, k[:, -1], x[:, -1])


def flops_per_token(seq_len: int, chunk_size: int, nheads: int, headdim: int, d_state: int) -> int:
    """Matmul FLOPs per token of :func:`mamba3_scan_chunked` (2*m*n*k per matmul), rounded.

    Per head and padded token: q.k scores 2*T*N, scores@v 2*T*P, chunk state 2*P*N and the
    carried state's read-out 2*P*N (T = min(chunk_size, seq_len)). Elementwise work (rotation,
    decays, the trapezoid) is not counted, as FlopCounterMode does not count it. This equals
    FlopCounterMode's count for T > 1; at T == 1 einsum turns the two length-1 contractions
    into elementwise products that it no longer sees, and this count keeps them.
    """
    T = min(chunk_size, seq_len)
    padded = math.ceil(seq_len / T) * T
    per_padded_token = 2 * T * (d_state + headdim) + 4 * headdim * d_state
    return round(nheads * padded * per_padded_token / seq_len)


def _intra_chunk(
    q: Tensor, k: Tensor, x: Tensor, a_cs: Tensor, gamma: Tensor, scale: Tensor, seg: Tensor
) -> Tensor:
    """y from pairs inside the same chunk: [B, C, T, H, P]."""
    T = q.shape[2]
    strictly_causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril(-1)
    same_doc = seg[..., :, None] == seg[..., None, :]  # [B, C, T, T]
    valid = (strictly_causal & same_doc)[:, :, None]  # [B, C, 1, T, T]
    log_decay = a_cs[..., :, None] - a_cs[..., None, :]  # [B, C, H, T(t), T(s)]
    decay = torch.exp(torch.where(valid, log_decay, -math.inf))  # mask before exp: no inf*0
    weights = decay * scale.transpose(2, 3)[..., None, :] + torch.diag_embed(gamma.transpose(2, 3))
    scores = torch.einsum("bcthn,bcshn->bchts", q, k) * weights
    return torch.einsum("bchts,bcshp->bcthp", scores, x)


def _chunk_states(
    k: Tensor, x: Tensor, a_cs: Tensor, scale: Tensor, seg: Tensor
) -> tuple[Tensor, Tensor]:
    """Each chunk's own contribution to the state at its end, and its total decay.

    Returns chunk_state [B, C, H, P, N] and chunk_decay [B, C, H] (0 if the chunk has a reset).
    """
    token_weight, chunk_decay = _chunk_states_weights(a_cs, scale, seg)
    k_weighted = k * token_weight[..., None]  # [B, C, T, H, N]
    chunk_state = torch.einsum("bcshn,bcshp->bchpn", k_weighted, x)
    return chunk_state, chunk_decay


def _chunk_states_weights(a_cs: Tensor, scale: Tensor, seg: Tensor) -> tuple[Tensor, Tensor]:
    """Each token's weight in its chunk's end state, [B, C, T, H] (decay to the chunk end
    times ``scale``; 0 before a later reset in the chunk), and the chunk's total decay
    [B, C, H] (0 if the chunk has a reset)."""
    to_end = torch.exp(a_cs[..., -1:] - a_cs) * (seg == seg[..., -1:])[:, :, None]  # [B, C, H, T]
    chunk_decay = torch.exp(a_cs[..., -1]) * (seg[..., -1] == 0)[:, :, None]
    return to_end.transpose(2, 3) * scale, chunk_decay


def _pass_states(
    ssm0: Tensor, chunk_state: Tensor, chunk_decay: Tensor
) -> tuple[Tensor, Tensor]:
    """Sequential pass over chunks: the state entering each chunk [B, C, H, P, N], and the last."""
    ssm = ssm0
    entering = []
    for c in range(chunk_state.shape[1]):
        entering.append(ssm)
        ssm = chunk_decay[:, c, :, None, None] * ssm + chunk_state[:, c]
    return torch.stack(entering, dim=1), ssm


def _to_chunks(t: Tensor, chunk: int) -> Tensor:
    """[B, L, ...] -> [B, C, chunk, ...], zero-padding L (zeros: no decay, no input, no reset)."""
    pad = (-t.shape[1]) % chunk
    if pad:
        t = torch.cat([t, t.new_zeros(t.shape[0], pad, *t.shape[2:])], dim=1)
    return t.unflatten(1, (t.shape[1] // chunk, chunk))


def _rotate(x: Tensor, theta: Tensor) -> Tensor:
    """Rotate pairs (x[2i], x[2i+1]) by theta[i] for i < R; the other dims pass through.

    x: [..., N], theta: [..., R] with 2R <= N.
    """
    n_rot = 2 * theta.shape[-1]
    pairs = x[..., :n_rot].unflatten(-1, (-1, 2))  # [..., R, 2]
    x0, x1 = pairs[..., 0], pairs[..., 1]
    cos, sin = torch.cos(theta), torch.sin(theta)
    rotated = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)
    return torch.cat([rotated, x[..., n_rot:]], dim=-1)


def _biased_heads(x: Tensor, bias: Tensor, nheads: int, dtype: torch.dtype) -> Tensor:
    """[B, L, G, N] grouped -> [B, L, H, N] per head (head h reads group h // (H // G)), + bias."""
    return x.to(dtype).repeat_interleave(nheads // x.shape[2], dim=2) + bias.to(dtype)


def _outer(v: Tensor, k: Tensor) -> Tensor:
    """[B, H, P] x [B, H, N] -> [B, H, P, N] (broadcast, so it costs no matmul FLOPs)."""
    return v[..., :, None] * k[..., None, :]


def _skip_and_gate(y: Tensor, x: Tensor, D: Tensor | None, z: Tensor | None) -> Tensor:
    if D is not None:
        y = y + D.to(y.dtype)[:, None] * x
    if z is not None:
        y = y * F.silu(z.to(y.dtype))
    return y


def _keep_mask(
    reset: Tensor | None, batch: int, seqlen: int, device: torch.device, dtype: torch.dtype
) -> Tensor:
    if reset is None:
        return torch.ones(batch, seqlen, device=device, dtype=dtype)
    return (~reset).to(dtype)


def _initial_state(
    state: Mamba3ScanState | None, x: Tensor, d_state: int, n_angles: int
) -> Mamba3ScanState:
    """The given state checked and cast to x's dtype, or zeros. x: [B, L, H, P]."""
    batch, _, nheads, headdim = x.shape
    return _checked_state(state, _state_shapes(batch, nheads, headdim, d_state, n_angles), x)


def _checked_state(
    state: Mamba3ScanState | None, expected: tuple[tuple[int, ...], ...], x: Tensor
) -> Mamba3ScanState:
    """``state`` with its fields checked against the ``expected`` shapes and cast to x's
    dtype, or zeros of those shapes on x's device."""
    if state is None:
        return _zeros_state(expected, x.device, x.dtype)
    for name, got, want in zip(_STATE_FIELDS, state.tensors(), expected, strict=True):
        if tuple(got.shape) != want:
            raise ValueError(f"initial_state.{name} has shape {tuple(got.shape)}, expected {want}")
    return Mamba3ScanState(*(s.to(x.dtype) for s in state.tensors()))


def _compute_dtype(v: Tensor) -> torch.dtype:
    return torch.float64 if v.dtype == torch.float64 else torch.float32


def _check_inputs(
    q: Tensor, k: Tensor, v: Tensor, adt: Tensor, dt: Tensor, trap: Tensor,
    q_bias: Tensor, k_bias: Tensor, angles: Tensor,
    D: Tensor | None, z: Tensor | None, reset: Tensor | None,
) -> None:
    """Fail with a message naming the tensor, its shape and the expected shape."""
    if v.ndim != 4 or q.ndim != 4:
        raise ValueError(f"q and v must be 4-D, got q {tuple(q.shape)} and v {tuple(v.shape)}")
    batch, seqlen, nheads, headdim = v.shape
    groups, d_state = q.shape[2], q.shape[3]
    if seqlen == 0:
        raise ValueError("the scan needs at least one token (L >= 1)")
    if nheads % groups:
        raise ValueError(f"nheads ({nheads}) must be a multiple of the q/k groups ({groups})")
    expected = {
        "q": (q, (batch, seqlen, groups, d_state)),
        "k": (k, (batch, seqlen, groups, d_state)),
        "adt": (adt, (batch, seqlen, nheads)),
        "dt": (dt, (batch, seqlen, nheads)),
        "trap": (trap, (batch, seqlen, nheads)),
        "q_bias": (q_bias, (nheads, d_state)),
        "k_bias": (k_bias, (nheads, d_state)),
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
