"""Mamba-3 SISO chunked scan in Triton, forward and backward, chunk-parallel.

Same contract as :func:`mamba3_scan_chunked` (reference.py; equations in docs/mamba3.md) for
the training path, with these limits (the caller uses the reference outside them):
``initial_state`` must be ``None`` (a cached prefill runs the reference; the mixer picks it),
``chunk_size`` 16, 32 or 64, headdim <= 64, d_state <= 128, no float64, and no gradient
through the returned final state. ``reset`` [B, L] bool packs documents into one row.
Operands may be bf16/fp16/fp32; everything accumulates in float32. Matmul operands are bf16
unless ``v`` is float32 (then float32 with IEEE products, and chunks of at most 32 tokens to
fit shared memory). The kernels run chunks of ``min(chunk_size, config.max_chunk)`` tokens:
any chunking computes the same function (only rounding differs).

Chunk-local rotation frames. Only angle differences between tokens matter, so each chunk
rotates its q/k by the angle accumulated *inside the chunk* (``ell``, starting at 0), and the
state passed between chunks is re-expressed in the next chunk's frame by rotating it by
``-phi_c`` (phi_c = the chunk's total angle). No long cumulative angle is ever formed, and
the angle backward is chunk-local too (``d phi_c`` comes from the state's rotation).

Halves layout. ``rot`` turns pairs ``(n = 2j, n = 2j+1)``. Every kernel splits q and k into
their even and odd components, ``[T, pairs]`` each (pairs j >= R get angle 0, padding is 0),
so a rotation is elementwise on the two halves and a dot product over N is two dots, one per
half; the chunk states are stored in the same layout, ``[P, 2, N2B]``.

Rotation table. q and k are shared by a group's heads but the angle is per head, so a
rotated copy per head would be 2 x [B, H, L, N]. Instead _prep writes, per head and token,
cos and sin of the in-chunk angle of the R rotated pairs ([B, H, L, 2, RB], float16; float32
for float32 ``v``): 4x fewer bytes than the rotated copies at N = 128, R = 32, and every
kernel rotates the (L2-resident, shared) q / k rows it loads with a few multiply-adds.

Kernels (grid; C = chunks, J = tiles of pairs):
  _prep      (H, C, B)   per head: the rotation table (rows padded to whole chunks), the
                         per-token scalars a (in-chunk cumsum of adt), scale, gamma, and phi_c
  forward    _state_fwd  (J, H, B)  walks the chunks: S_in[c] (stored), the final state
             _out_fwd    (H, C, B)  y = (intra + exp(a) q S_in^T + D x) * silu(z)
             _final      (H, B)     the final state in the global frame (the returned cache;
                                    not launched with output_final_state=False)
  backward   _state_bwd  (J, H, B)  walks the chunks backwards: G_c = dL/dU_c (stored)
             _bwd_dx     (H, C, B)  dx, dz, dD
             _bwd_dqk    (H*J', C, B)  for a tile of pairs (J' tiles): d(q, k) rotated back and
                                    stored per head (operand dtype) with the bias grads'
                                    parts; d ell of the rotated pairs (float32, from the
                                    float32 d(q, k) in the rotated frame and the state's
                                    rotation); the tile's shares of the adt grad, d scale
                                    and d gamma
             _bwd_tokens (H, C, B)  the per-token grads: angles (the reverse cumsum of d ell
                                    over the chunk), adt (the tiles' shares summed), dt and
                                    trap (from d scale / d gamma; the first token of a chunk
                                    takes the previous chunk's last d scale)
             _group_sum  (B*L*G / rows)  d(q, k): each group's per-head grads summed (float32)
  host       the sums of the per-chunk bias and D partials
The sequential kernels only carry a [P, pairs-tile] state through a short per-chunk update;
all T x T and T x N work is in the chunk-parallel kernels.
Saved for backward: the inputs (q, k and their biases made contiguous), _prep's outputs,
S_in [B, H, C, P, 2, N2B] (bf16; float32 for float32 ``v``) and (with z) y before the gate,
which gives dz without forming y again from S_in.
Backward scratch: G (as S_in), d(q, k) per head [B, L, H, 2, N2B], float32 per-token partials.
Kernels: ``chunk_fwd.py`` and ``chunk_bwd.py`` (the pieces they share: ``common.py``); launch
settings and tiles per device: ``configs.py``.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton.language as tl
from torch import Tensor

from megacpp.errors import MegaCppError
from megacpp.kernels.device import cdiv, next_power_of_2, sm_count
from megacpp.kernels.launch import for_device
from megacpp.kernels.ops.mamba3_scan.chunk_bwd import (
    _bwd_dqk,
    _bwd_dx,
    _bwd_tokens,
    _group_sum,
    _state_bwd,
)
from megacpp.kernels.ops.mamba3_scan.chunk_fwd import _final, _out_fwd, _prep, _state_fwd
from megacpp.kernels.ops.mamba3_scan.configs import CONFIGS, ScanConfig
from megacpp.kernels.ops.mamba3_scan.reference import Mamba3ScanState, _check_inputs
from megacpp.kernels.ops.sum_rows import sum_rows

CHUNK_SIZES = (16, 32, 64)
MAX_HEADDIM = 64
MAX_D_STATE = 128


class _Geometry(NamedTuple):
    B: int
    L: int
    H: int
    G: int
    P: int
    N: int
    R: int
    T: int  # chunk length
    NC: int  # chunks
    BP: int  # P padded to a power of two (>= 16)
    N2B: int  # N / 2 pairs padded to a power of two (>= 16)
    RB: int  # R rotated pairs padded to a power of two (>= 16, <= N2B): the table's width
    JB: int  # pairs per program of the sequential kernels (NJ = N2B // JB tiles)
    PAIRED: bool  # N = 2 N2B: a tile's pairs are contiguous columns of q, k (one row load)


def _geometry(q: Tensor, v: Tensor, angles: Tensor, chunk_size: int, config: ScanConfig
              ) -> _Geometry:
    B, L, H, P = v.shape
    G, N, R = q.shape[2], q.shape[3], angles.shape[-1]
    if chunk_size not in CHUNK_SIZES:
        raise MegaCppError(f"mamba3_scan triton: chunk_size must be one of {CHUNK_SIZES}, "
                           f"got {chunk_size} (use the reference for other chunk sizes)")
    if P > MAX_HEADDIM or N > MAX_D_STATE:
        raise MegaCppError(f"mamba3_scan triton: needs headdim <= {MAX_HEADDIM} and d_state <= "
                           f"{MAX_D_STATE}, got {P} and {N} (use the reference)")
    N2B = max(16, next_power_of_2((N + 1) // 2))
    RB = max(16, next_power_of_2(R))  # R <= N // 2, so RB <= N2B
    T = min(chunk_size, config.max_chunk)  # any chunking computes the same function
    if v.dtype == torch.float32:
        T = min(T, 32)  # float32 operands of 64-token chunks overflow shared memory
    NC = cdiv(L, T)
    BP = max(16, next_power_of_2(P), config.min_bp if T == 64 else 16)
    if max(v.numel(), angles.numel(), B * L * H * N, B * H * NC * BP * 2 * N2B) >= 2**31:
        raise MegaCppError("mamba3_scan triton: tensors of 2**31 elements or more are not "
                           "supported (32-bit offsets); split the batch")
    sms = sm_count(v.device) if v.is_cuda else 1
    return _Geometry(B, L, H, G, P, N, R, T, NC, BP, N2B, RB,
                     _state_pairs(B * H, N2B, sms, config), N == 2 * N2B)


def _state_pairs(heads: int, n2b: int, sms: int, config: ScanConfig) -> int:
    """Pairs per program of the sequential state kernels (grid N2B / pairs x B * H) on a device
    of ``sms`` multiprocessors."""
    pairs = min(n2b, config.pairs)
    while pairs > 16 and heads * (n2b // pairs) < config.min_state_programs_per_sm * sms:
        pairs //= 2
    return pairs


def _precision(v: Tensor) -> tuple[torch.dtype, tl.dtype, bool]:
    """(rotation table dtype, matmul operand dtype, fast trig): float32 with accurate trig for
    float32 v; else float16 cos / sin (11 bits, finer than the bf16 operands they rotate),
    bf16 products and the hardware sin/cos (not in the CPU interpreter)."""
    if v.dtype == torch.float32:
        return torch.float32, tl.float32, False
    return torch.float16, tl.bfloat16, v.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"


def _operand_dtype(v: Tensor) -> torch.dtype:
    """Storage of the chunk states and the per-head d(q, k): the matmul operand dtype."""
    return torch.float32 if v.dtype == torch.float32 else torch.bfloat16


def _strides(t: Tensor | None, ndim: int) -> tuple[int, ...]:
    return tuple(t.stride()) if t is not None else (0,) * ndim


class _Operands(NamedTuple):
    """What _prep writes: the rotation table, a / scale / gamma, phi."""

    cs: Tensor  # [B, H, NC * T, 2, RB] cos, sin of the in-chunk angle (float16; float32)
    sc: Tensor  # [3, B, H, NC * T] float32
    phi: Tensor  # [B, H, NC, RB] float32


def _prep_operands(geo: _Geometry, args: tuple, st: dict, cs_dtype: torch.dtype,
                   fast: bool, config: ScanConfig) -> _Operands:
    adt, dt, trap, angles = args[3:7]
    B, H, T, NC, RB = geo.B, geo.H, geo.T, geo.NC, geo.RB
    dev = adt.device
    cs = torch.empty(B, H, NC * T, 2, RB, device=dev, dtype=cs_dtype)
    sc = torch.empty(3, B, H, NC * T, device=dev, dtype=torch.float32)
    phi = torch.empty(B, H, NC, RB, device=dev, dtype=torch.float32)
    _prep[(H, NC, B)](
        adt, dt, trap, angles, sc, phi, cs, *st["adt"], *st["dt"], *st["trap"], *st["ang"],
        B, geo.L, H, NC, geo.R, T=T, RB=RB, FAST=fast, **config.options("prep", geo.N2B))
    return _Operands(cs, sc, phi)


def _common_strides(v, z, adt, dt, trap, angles) -> dict[str, tuple]:
    return {"v": _strides(v, 4), "z": _strides(z, 4), "adt": _strides(adt, 3),
            "dt": _strides(dt, 3), "trap": _strides(trap, 3), "ang": _strides(angles, 4)}


def _final_state(geo: _Geometry, k: Tensor, v: Tensor, k_bias: Tensor, s_fin: Tensor,
                 phi: Tensor, config: ScanConfig) -> Mamba3ScanState:
    """The reference's final state in its global frame (angle mod 2 pi), without gradient."""
    B, H, P, N, R = geo.B, geo.H, geo.P, geo.N, geo.R
    f32 = {"device": v.device, "dtype": torch.float32}
    state = Mamba3ScanState(torch.empty(B, H, R, **f32), torch.empty(B, H, P, N, **f32),
                            torch.empty(B, H, N, **f32), torch.empty(B, H, P, **f32))
    _final[(H, B)](s_fin, phi, k, k_bias, v, *state.tensors(), *v.stride(), geo.L, H, geo.G,
                   geo.NC, P, N, R, BP=geo.BP, N2B=geo.N2B, RB=geo.RB, CB=config.final_chunks,
                   **config.options("final", geo.N2B))
    return state


def _qk_args(args: tuple, ops: _Operands) -> tuple:
    """q, k, q_bias, k_bias (contiguous) and the rotation table: what every kernel that
    rotates q or k reads."""
    q, k, q_bias, k_bias = args[0], args[1], args[7], args[8]
    return q, k, q_bias, k_bias, ops.cs


def _forward(geo: _Geometry, args: tuple, st: dict, ops: _Operands, dot, fast: bool,
             config: ScanConfig) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """_state_fwd then _out_fwd: y, S_in, the final state [B, H, P, 2, N2B], and y before the
    gate (with z, else None)."""
    _q, k, v, D, z, rst = args[0], args[1], args[2], args[9], args[10], args[11]
    B, L, H, G, P, N, R, T, NC = geo[:9]
    dev = v.device
    dims = (B, L, H, G, NC, P, N, R)
    const = {"T": T, "BP": geo.BP, "N2B": geo.N2B, "RB": geo.RB, "HAS_RESET": rst is not None,
             "DOT": dot, "PAIRED": geo.PAIRED}
    s_in = torch.empty(B, H, NC, P, 2, geo.N2B, device=dev, dtype=_operand_dtype(v))
    s_fin = torch.empty(B, H, P, 2, geo.N2B, device=dev, dtype=torch.float32)
    _state_fwd[(geo.N2B // geo.JB, H, B)](
        k, args[8], ops.cs, v, ops.sc, ops.phi, rst, s_in, s_fin, *st["v"], *dims,
        JB=geo.JB, FAST=fast, **const, **config.options("state_fwd", geo.N2B))
    y = torch.empty(B, L, H, P, device=dev, dtype=v.dtype)
    y_pre = torch.empty_like(y) if z is not None else None
    _out_fwd[(H, NC, B)](
        *_qk_args(args, ops), v, z, y, y_pre, ops.sc, D, rst, s_in, *st["v"], *st["z"], *dims,
        HAS_D=D is not None, HAS_Z=z is not None, **const,
        **config.options("out_fwd", geo.N2B))
    return y, s_in, s_fin, y_pre


def _backward(geo: _Geometry, args: tuple, st: dict, ops: _Operands, dy: Tensor,
              s_in: Tensor, y_pre: Tensor | None, dot, fast: bool, config: ScanConfig) -> tuple:
    """_state_bwd, _bwd_dx, _bwd_dqk; the input grads."""
    q, k, v, adt, dt, trap, angles, q_bias, k_bias, D, z, rst = args
    B, L, H, G, P, N, R, T, NC = geo[:9]
    dev = v.device
    f32 = {"device": dev, "dtype": torch.float32}
    dims = (B, L, H, G, NC, P, N, R)
    const = {"T": T, "BP": geo.BP, "N2B": geo.N2B, "RB": geo.RB, "HAS_Z": z is not None,
             "HAS_RESET": rst is not None, "DOT": dot, "PAIRED": geo.PAIRED}
    strides = (*st["v"], *st["z"], *dy.stride())
    g_st = torch.empty_like(s_in)
    _state_bwd[(geo.N2B // geo.JB, H, B)](
        q, q_bias, ops.cs, z, dy, ops.sc, ops.phi, rst, g_st, *st["z"], *dy.stride(), *dims,
        JB=geo.JB, FAST=fast, **const, **config.options("state_bwd", geo.N2B))

    dv = torch.empty(B, L, H, P, device=dev, dtype=v.dtype)
    dz = torch.empty(B, L, H, P, device=dev, dtype=z.dtype) if z is not None else None
    dd_part = torch.empty(B, H, NC, **f32)
    _bwd_dx[(H, NC, B)](
        *_qk_args(args, ops), v, z, dy, ops.sc, D, rst, s_in, g_st, y_pre, dv, dz, dd_part,
        *strides, *dims, HAS_D=D is not None, **const,
        **config.options("bwd_dx", geo.N2B))

    # d(q, k) per head, unrotated, in the operand dtype (summed over the group's heads below)
    dqh = torch.empty(B, L, H, 2 * geo.N2B, device=dev, dtype=_operand_dtype(v))
    dkh = torch.empty_like(dqh)
    dqb_part = torch.empty(B, NC, H, 2 * geo.N2B, **f32)
    dkb_part = torch.empty_like(dqb_part)
    dang = torch.empty(B, L, H, R, device=dev, dtype=angles.dtype)
    jd = min(geo.N2B, config.dqk_pairs)
    njd = geo.N2B // jd
    d_ell = torch.empty(B, H, NC * T, geo.RB, **f32)
    dadt_part = torch.empty(njd, B, H, NC * T, **f32)  # shares of _bwd_dqk's pair tiles
    d_sg = torch.empty(2, njd, B, H, NC * T, **f32)  # d scale, d gamma
    _bwd_dqk[(H * njd, NC, B)](
        *_qk_args(args, ops), v, z, dy, ops.sc, rst, s_in, g_st, dqh, dkh, dqb_part, dkb_part,
        d_ell, dadt_part, d_sg, *strides, *dims, JD=jd, **const,
        **config.options("bwd_dqk", geo.N2B))
    dadt = torch.empty(B, L, H, device=dev, dtype=adt.dtype)
    ddt = torch.empty(B, L, H, device=dev, dtype=dt.dtype)
    dtrap = torch.empty(B, L, H, device=dev, dtype=trap.dtype)
    _bwd_tokens[(H, NC, B)](
        d_ell, dadt_part, d_sg, dt, trap, angles, dang, dadt, ddt, dtrap, *st["dt"],
        *st["trap"], *st["ang"], B, L, H, NC, R, T=T, RB=geo.RB, NJD=njd,
        **config.options("bwd_tokens", geo.N2B))
    dD = dd_part.sum((0, 2)).to(D.dtype) if D is not None else None

    def interleaved(d: Tensor, like: Tensor) -> Tensor:  # [..., 2, N2B] -> [..., N]
        d = d.unflatten(-1, (2, geo.N2B)).transpose(-1, -2).flatten(-2)
        return d[..., :N].to(like.dtype)

    # d(q, k): each group's heads summed (in float32), the halves interleaved
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    rows = B * L * G
    _group_sum[(cdiv(rows, config.group_rows),)](
        dqh, dkh, dq, dk, rows, H // G, N, ROWS=config.group_rows,
        HGP=next_power_of_2(H // G), N2B=geo.N2B, **config.options("group_sum", geo.N2B))
    dqb, dkb = (sum_rows(part.flatten(0, 1).flatten(1)).view(H, 2 * geo.N2B)
                for part in (dqb_part, dkb_part))  # [B, C, H, 2 N2B] summed over (B, C)
    return (dq, dk, dv, dadt, ddt, dtrap, interleaved(dqb, q_bias), interleaved(dkb, k_bias),
            dang, dD, dz, None, None)


class _Mamba3ScanFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, reset, chunk_size,
                output_final_state, config):
        geo = _geometry(q, v, angles, chunk_size, config)
        cs_dtype, dot, fast = _precision(v)
        rst = reset.to(torch.int8).contiguous() if reset is not None else None
        q, k, q_bias, k_bias = (t.contiguous() for t in (q, k, q_bias, k_bias))
        st = _common_strides(v, z, adt, dt, trap, angles)
        args = (q, k, v, adt, dt, trap, angles, q_bias, k_bias, D, z, rst)
        ops = _prep_operands(geo, args, st, cs_dtype, fast, config)
        y, s_in, s_fin, y_pre = _forward(geo, args, st, ops, dot, fast, config)
        ctx.save_for_backward(q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, rst, s_in,
                              y_pre, *ops)
        ctx.geo, ctx.config = geo, config
        if not output_final_state:
            return y
        final = _final_state(geo, k, v, k_bias, s_fin, ops.phi, config)
        ctx.mark_non_differentiable(*final.tensors())
        return (y, *final.tensors())

    @staticmethod
    def backward(ctx, dy, *_state_grads):
        q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, rst, s_in, y_pre, *ops = (
            ctx.saved_tensors)
        if z is None:  # refused before any launch: it faults on an H100 (docs/mamba3.md)
            raise MegaCppError("mamba3_scan triton: no backward without z (the gate); pass z, "
                               "or run the reference (mamba3_scan_chunked)")
        _cs_dtype, dot, fast = _precision(v)
        st = _common_strides(v, z, adt, dt, trap, angles)
        args = (q, k, v, adt, dt, trap, angles, q_bias, k_bias, D, z, rst)
        grads = _backward(ctx.geo, args, st, _Operands(*ops), dy, s_in, y_pre, dot, fast,
                          ctx.config)
        return (*grads, None, None)


def mamba3_scan_triton(
    q: Tensor, k: Tensor, v: Tensor, adt: Tensor, dt: Tensor, trap: Tensor,
    q_bias: Tensor, k_bias: Tensor, angles: Tensor,
    D: Tensor | None = None, z: Tensor | None = None, reset: Tensor | None = None,
    initial_state: Mamba3ScanState | None = None, chunk_size: int = 64,
    output_final_state: bool = True, config: ScanConfig | None = None,
) -> tuple[Tensor, Mamba3ScanState | None]:
    """The chunked Mamba-3 SISO scan on the GPU (arguments as :func:`mamba3_scan_chunked`).

    Returns y [B, L, H, P] in v.dtype and the final state (float32, no gradient), or None for
    it with ``output_final_state=False`` (``_final`` is then not launched).
    ``initial_state`` is not supported (a cached prefill must call the reference); neither
    is float64 (the reference is the float64 path). ``config``: the launch settings and tiles
    (default: ``configs.CONFIGS`` for v's device).
    """
    _check_inputs(q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, reset)
    if initial_state is not None:
        raise MegaCppError("mamba3_scan triton: initial_state is not supported; a prefill that "
                           "continues a cache runs the reference (mamba3_scan_chunked)")
    if v.dtype == torch.float64:
        raise MegaCppError("mamba3_scan triton: float64 is not supported (use the reference)")
    config = config or for_device(CONFIGS, v.device)
    if not output_final_state:
        return _Mamba3ScanFn.apply(q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, reset,
                                   chunk_size, False, config), None
    y, *final = _Mamba3ScanFn.apply(q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z,
                                    reset, chunk_size, True, config)
    return y, Mamba3ScanState(*final)
