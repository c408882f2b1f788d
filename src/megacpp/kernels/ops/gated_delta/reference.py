"""Plain-PyTorch reference for the gated delta rule (Gated DeltaNet, Yang, Kautz & Hatamizadeh,
ICLR 2025): the token-by-token recurrence (the truth) and the chunked WY / UT-transform form.

Layout: flash-linear-attention's default (``head_first=False``), so these functions line up
argument for argument with ``fla.ops.gated_delta_rule.chunk_gated_delta_rule(q, k, v, g, beta)``:

    q, k   [B, L, H, K]   queries and keys; the gated delta rule assumes ||k|| = 1 (the mixer
                          L2-normalises q and k before calling these functions)
    v      [B, L, H, V]   values
    g      [B, L, H]      log decay, g <= 0 and finite; alpha = exp(g) in (0, 1]
    beta   [B, L, H]      write strength in (0, 1)
    reset  [B, L] bool    True at the first token of a new document in a packed row
    state  [B, H, K, V]   fla's default orientation (the transpose of the paper's S)

Per batch row and head, with h the [K, V] state:

    h_t = alpha_t (I - beta_t k_t k_t^T) h_{t-1} + beta_t k_t v_t^T
    o_t = h_t^T (scale * q_t),                    scale = K ** -0.5 by default

which is the paper's ``S_t = alpha_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T`` with
``S = h^T``. A reset at t sets alpha_t = 0: the carried state (including ``initial_state`` when
t = 0) is dropped and the new document starts from zero.

Both forms compute in float32 (float64 when q is float64), return ``o`` in q's dtype and the
final state in the compute dtype.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor


def gated_delta_rule_recurrent(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    reset: Tensor | None = None,
    output_final_state: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Token-by-token gated delta rule: the truth every other form is tested against.

    Returns ``(o [B, L, H, V], final_state [B, H, K, V] or None)``; see the module docstring
    for the layout and equations.
    """
    _check_inputs(q, k, v, g, beta, initial_state, reset)
    out_dtype, dtype = q.dtype, _compute_dtype(q)
    B, L, H, K = q.shape
    scale = K**-0.5 if scale is None else scale
    state = _initial_state(initial_state, (B, H, K, v.shape[-1]), dtype, q.device)
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    alpha = torch.exp(g)  # [B, L, H]
    if reset is not None:
        alpha = alpha.masked_fill(reset[:, :, None], 0.0)

    outputs = []
    for t in range(L):
        k_t = k[:, t]  # [B, H, K]
        state = alpha[:, t, :, None, None] * state
        v_stored = torch.einsum("bhk,bhkv->bhv", k_t, state)  # what the memory holds at k_t
        v_new = beta[:, t, :, None] * (v[:, t] - v_stored)  # [B, H, V]
        state = state + k_t[..., :, None] * v_new[..., None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, state))
    o = torch.stack(outputs, dim=1)  # [B, L, H, V]
    return o.to(out_dtype), (state if output_final_state else None)


def gated_delta_rule_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    reset: Tensor | None = None,
    output_final_state: bool = True,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor | None]:
    """Chunked gated delta rule: the same result as :func:`gated_delta_rule_recurrent`.

    Within a chunk of C tokens, what each token writes (``v_new``, the WY / UT representation)
    satisfies one unit-lower-triangular system
    ``(I + A) v_new = beta * v - (beta * decay_in * k) @ state`` with
    ``A[i, j] = beta_i * decay(j -> i) * (k_i . k_j)`` for j < i. Solving it once per chunk,
    for every chunk at once, gives fla's ``u = (I + A)^-1 (beta * v)`` and
    ``w = (I + A)^-1 (beta * decay_in * k)``, so that ``v_new = u - w @ state``; only the
    [K, V] state is then passed from chunk to chunk. A sequence length that is not a multiple
    of ``chunk_size`` is zero-padded (the padding has alpha = 1, beta = 0 and so leaves the
    state untouched); ``chunk_size`` is clipped to L when L is shorter.
    """
    _check_inputs(q, k, v, g, beta, initial_state, reset)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size}")
    out_dtype, dtype = q.dtype, _compute_dtype(q)
    B, L, H, K = q.shape
    chunk, n_chunks = chunk_layout(L, chunk_size)
    scale = K**-0.5 if scale is None else scale
    state = _initial_state(initial_state, (B, H, K, v.shape[-1]), dtype, q.device)
    if reset is None:
        reset = torch.zeros(B, L, dtype=torch.bool, device=q.device)

    # [B, L, H, D] -> [B, H, N, C, D];  [B, L, H] -> [B, H, N, C]
    q, k, v = (_to_chunks(x.to(dtype), chunk, n_chunks) for x in (q, k, v))
    q = q * scale
    g, beta = (_to_chunks(x.to(dtype)[..., None], chunk, n_chunks)[..., 0] for x in (g, beta))
    reset = _to_chunks(reset[:, :, None, None], chunk, n_chunks)[..., 0]  # [B, 1, N, C]

    decay_in, decay_pair = _chunk_decays(g, reset)
    decay_out = decay_pair[..., -1, :]  # [B, H, N, C]: decay from token j to the chunk's end
    decay_chunk = decay_in[..., -1]  # [B, H, N]: decay across the whole chunk

    # Intra-chunk work for every chunk at once.
    kk = torch.einsum("bhnik,bhnjk->bhnij", k, k)  # [B, H, N, C, C]
    qk = torch.einsum("bhnik,bhnjk->bhnij", q, k) * decay_pair  # causal, decayed scores
    eye = torch.eye(chunk, dtype=dtype, device=q.device)
    system = eye + (beta[..., :, None] * decay_pair * kk).tril(-1)  # I + A, unit lower
    solve = partial(torch.linalg.solve_triangular, system, upper=False, unitriangular=True)
    u = solve(beta[..., None] * v)  # [B, H, N, C, V]
    w = solve((beta * decay_in)[..., None] * k)  # [B, H, N, C, K]

    # Inter-chunk recurrence over the [K, V] state.
    outputs = []
    for n in range(n_chunks):
        v_new = u[:, :, n] - w[:, :, n] @ state  # [B, H, C, V] pseudo-values given the state
        q_decayed = q[:, :, n] * decay_in[:, :, n, :, None]
        outputs.append(q_decayed @ state + qk[:, :, n] @ v_new)
        k_decayed = k[:, :, n] * decay_out[:, :, n, :, None]  # [B, H, C, K]
        state = decay_chunk[:, :, n, None, None] * state + k_decayed.transpose(-1, -2) @ v_new

    o = torch.stack(outputs, dim=2).flatten(2, 3)[:, :, :L]  # [B, H, L, V]
    o = o.transpose(1, 2).to(out_dtype)  # [B, L, H, V]
    return o, (state if output_final_state else None)


def chunk_layout(seq_len: int, chunk_size: int) -> tuple[int, int]:
    """The (chunk length, number of chunks) the chunked form uses for ``seq_len`` tokens."""
    chunk = max(1, min(chunk_size, seq_len))
    return chunk, math.ceil(seq_len / chunk)


def flops_per_token(
    seq_len: int, n_heads: int, head_k_dim: int, head_v_dim: int, chunk_size: int = 64
) -> int:
    """FLOPs per token of :func:`gated_delta_rule_chunked`, counted the way
    ``torch.utils.flop_counter.FlopCounterMode`` counts them: 2*m*n*k per matmul / einsum.

    Per chunk of C tokens and head (K = head_k_dim, V = head_v_dim):
      k k^T and q k^T            2 * 2*C*C*K
      w @ state, q @ state       2 * 2*C*K*V
      scores @ v_new             2*C*C*V
      k^T @ v_new (state write)  2*C*K*V
    Padding of the last chunk is counted (the padded tokens are really computed).

    Not counted, because FlopCounterMode cannot see them: the two triangular solves
    (``linalg.solve_triangular`` has no FLOP formula; forward substitution costs about
    C*(C-1)*(K+V) FLOPs per chunk and head) and elementwise work (decays, exp, masks),
    which is O(C*C + C*(K+V)) per chunk and head. The result is rounded to an integer.
    """
    chunk, n_chunks = chunk_layout(seq_len, chunk_size)
    K, V = head_k_dim, head_v_dim
    per_chunk = 4 * chunk * chunk * K + 2 * chunk * chunk * V + 6 * chunk * K * V
    return round(n_heads * n_chunks * per_chunk / seq_len)


def _chunk_decays(g: Tensor, reset: Tensor) -> tuple[Tensor, Tensor]:
    """Within-chunk decays from log decays ``g`` [B, H, N, C] and ``reset`` [B, 1, N, C].

    Returns ``decay_in`` [B, H, N, C] (product of alpha over chunk tokens 0..i, the decay of the
    incoming state at token i) and ``decay_pair`` [B, H, N, C, C] (product of alpha over tokens
    (j, i] for j <= i, zero above the diagonal).

    Resets are not folded in as alpha = 0 (log = -inf would give inf - inf = NaN in the
    pairwise differences). Instead each reset opens a new segment: cumulative sums run over a
    finite stand-in, and any decay that spans a reset is masked to zero *before* the exp, so no
    inf is formed and no NaN reaches the gradients.
    """
    log_in = g.masked_fill(reset, 0.0).cumsum(-1)  # [B, H, N, C], <= 0
    segment = reset.long().cumsum(-1)  # [B, 1, N, C]: resets seen so far in the chunk
    decay_in = torch.exp(log_in).masked_fill(segment > 0, 0.0)

    log_pair = log_in[..., :, None] - log_in[..., None, :]  # [B, H, N, C, C]: rows i, cols j
    causal = torch.ones_like(log_pair[0, 0, 0], dtype=torch.bool).tril()
    connected = (segment[..., :, None] == segment[..., None, :]) & causal
    decay_pair = torch.exp(log_pair.masked_fill(~connected, -math.inf))
    return decay_in, decay_pair


def _to_chunks(x: Tensor, chunk: int, n_chunks: int) -> Tensor:
    """[B, L, H, D] -> [B, H, N, C, D], zero-padding L up to N * C."""
    B, L, H, D = x.shape
    x = F.pad(x, (0, 0, 0, 0, 0, n_chunks * chunk - L))
    return x.reshape(B, n_chunks, chunk, H, D).permute(0, 3, 1, 2, 4)


def _initial_state(
    initial_state: Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> Tensor:
    """The state [B, H, K, V] entering the first token: ``initial_state`` or zeros."""
    if initial_state is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    return initial_state.to(dtype)


def _compute_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _check_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    reset: Tensor | None,
) -> None:
    """Fail closed on any layout mismatch, naming the tensor and the shape that is accepted."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, L, H, K] (4-D), got shape {tuple(q.shape)}")
    B, L, H, K = q.shape
    V = v.shape[-1] if v.dim() == 4 else -1
    expected = {
        "k": (k, (B, L, H, K)),
        "v": (v, (B, L, H, V)),
        "g": (g, (B, L, H)),
        "beta": (beta, (B, L, H)),
    }
    if initial_state is not None:
        expected["initial_state"] = (initial_state, (B, H, K, V))
    if reset is not None:
        expected["reset"] = (reset, (B, L))
    for name, (tensor, shape) in expected.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"{name} must have shape {list(shape)} (layout [B, L, H, D], from q "
                f"{list(q.shape)}), got {list(tensor.shape)}"
            )
    if reset is not None and reset.dtype != torch.bool:
        raise ValueError(f"reset must be a bool tensor, got dtype {reset.dtype}")
