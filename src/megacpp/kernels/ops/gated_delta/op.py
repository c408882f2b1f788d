"""The chunked gated delta rule in Triton, forward and backward.

Same contract as :func:`megacpp.kernels.ops.gated_delta.reference.gated_delta_rule_chunked`
(fla's layout: q, k [B, L, H, K], v [B, L, H, V], g, beta [B, L, H], reset [B, L] bool,
state [B, H, K, V]); float32 or bfloat16 q/k/v, any float g/beta, float32 state and
accumulation. Chunks are always ``CHUNK`` = 64 tokens: the result does not depend on the
chunk length, so ``chunk_size`` is accepted and only validated.

Per chunk of C tokens (one batch row, one head), with ``gc`` the in-chunk cumulative log decay
and ``seg`` the number of resets seen so far in the chunk (decays never cross a reset)::

    A      = strict_lower(beta_i * exp(gc_i - gc_j) * k_i.k_j)   (same segment)   [C, C]
    T      = (I + A)^-1                                                           [C, C]
    w, u   = T (beta * decay_in * k),  T (beta * v)                  (the WY / UT form)
    v_new  = u - w S                       S: the state entering the chunk        [C, V]
    o      = (scale * decay_in * q) S + (scale * q k^T * exp(gc_i - gc_j), causal) v_new
    S'     = decay_chunk * S + (decay_out * k)^T v_new

Kernels (grid in brackets; N chunks, BH = B * H):

* ``_fwd_intra``  [N, BH]   A, T (by doubling blocks, below), w, u, and
  the per-token decay_in / decay_out and per-chunk gamma the state passes read
* ``_fwd_state``  [V/BV, BH] the only sequential pass: S per chunk, v_new, final state
* ``_fwd_out``    [N, BH]   o
* ``_bwd_dv_local`` [N, BH] the intra-chunk part of dL/dv_new: P^T do
* ``_bwd_state``  [V/BV, BH] reverse pass: dL/dS per chunk, dL/dv_new, dL/d initial_state
* ``_bwd_val``    [N, BH]   the value side (a V loop): dv, dL/dP, the u part of dL/dA, the
  value part of dbeta
* ``_bwd_key``    [N * K/BKS, BH] one K slice: its V loop (dL/d(decay_in q), dL/dw,
  dL/d(decay_out k), [C, BKS] each), dq, dk but its dL/dA term, the slice's w part of dL/dA
  and its row sums for dbeta and dg
* ``_bwd_fin``    [N, BH]   dL/dA summed from the parts, the dL/dA terms of dk, dbeta, dg, and
  dg through the decays' cumsum

T is built without tiny matmuls or per-row steps: the inverse of (I + A)'s diagonal blocks of
side 2, 4, ..., 64 in turn, each from the last by ``T <- T - T E T`` (E: A's lower-left
quadrants of the new blocks), two [64, 64] products per side, all blocks at once: 10 dependent
products (a 15-step block forward substitution takes 19 and made _fwd_intra 15% slower at
H16).

Saved for backward: q, k, v, g, beta, reset, T [B, H, N*C, C], w (k's dtype), the
chunk-entry states [B, H, N, K, V] (q's dtype), v_new [B, L, H, V], the decays; u^T is
recomputed. T and v_new are bfloat16 for bfloat16 inputs, else float32. The split backward's
scratch, with NKB = K / BKS key slices (see above ``_bwd_val`` in ``chunk_bwd.py``):
dL/dP masked [B, H, N, C, C], float32 [B, H, N, 1 + NKB, C, C] (the u part of dL/dA, the w
part per K slice; transposes are reads of these through transposed pointers), [B, H, N, NKB,
2, C] (row sums per K slice) and [B, L, H, K] (dk before its dL/dA term); partials are summed
in a fixed order (no atomics: bit-reproducible gradients).
bfloat16 inputs use bfloat16 tensor-core products throughout (float32 operands rounded, as fla
does), except T's own products (tf32), and store u, v_new, dL/dv_new, T, dL/dP and dk's
partial in bfloat16 (T and dL/dP are read only by bf16 products, so their storage changes no
result); float32 inputs use 3xTF32 products and float32 intermediates.

Kernels: ``chunk_fwd.py`` and ``chunk_bwd.py`` (the pieces they share: ``common.py``); launch
settings per device: ``configs.py``.

Supported here: CUDA (or the Triton CPU interpreter, ``TRITON_INTERPRET=1``), q/k/v float32 or
bfloat16, K <= 128, initial_state and output_final_state. Anything else (float64, float16,
K > 128) is computed by the reference for that call (one warning per process).
"""

from __future__ import annotations

import os
import warnings

import torch
from torch import Tensor

from megacpp.kernels.device import cdiv, next_power_of_2, sm_count
from megacpp.kernels.launch import for_device
from megacpp.kernels.ops.gated_delta.chunk_bwd import (
    _bwd_dv_local,
    _bwd_fin,
    _bwd_key,
    _bwd_state,
    _bwd_val,
)
from megacpp.kernels.ops.gated_delta.chunk_fwd import _fwd_intra, _fwd_out, _fwd_state
from megacpp.kernels.ops.gated_delta.configs import CONFIGS, GatedDeltaConfig, KernelLaunch
from megacpp.kernels.ops.gated_delta.reference import _check_inputs, gated_delta_rule_chunked

CHUNK = 64  # tokens per chunk (the tile side of A and T)
MAX_K = 128  # head_k_dim the kernels hold in registers
# Smallest K / V tile. On the H100 (Triton 3.6) 16-wide tiles hit illegal memory accesses
# (fp32 K = V = 16; the backward with BV = 16), so narrower heads run masked 32-wide tiles.
MIN_TILE = 32
DTYPES = (torch.float32, torch.bfloat16)


def _sm_count(device: torch.device) -> int:
    """The device's SM count; for the CPU interpreter an H100's 132, so it follows the choices
    an H100 makes."""
    return sm_count(device) if device.type == "cuda" else 132


def _dot_mode(q: Tensor) -> int:
    """T's products' MODE (see ``common._dot``): 0 float32 (3xTF32 products), 1 bfloat16
    tensor cores, 2 bfloat16 emulated in float32 (the CPU interpreter); every other product
    of bfloat16 inputs runs 1 -> 3, 2 -> 4 (every operand rounded to bfloat16)."""
    if q.dtype == torch.float32:
        return 0
    return 2 if q.device.type == "cpu" else 1


class _Launcher:
    """Grid and constexpr arguments shared by the kernels for one call's shapes."""

    def __init__(self, q: Tensor, v: Tensor, reset: Tensor | None, g: Tensor,
                 config: GatedDeltaConfig) -> None:
        B, L, H, K = q.shape
        V = v.shape[-1]
        self.B, self.L, self.H, self.K, self.V = B, L, H, K, V
        self.N = cdiv(L, CHUNK)
        self.rst = reset.view(torch.uint8) if reset is not None else g  # unused without reset
        self.on_cpu = q.device.type == "cpu"
        self.config = config
        self.const = {"H": H, "DK": K, "DV": V, "BK": max(MIN_TILE, next_power_of_2(K)),
                      "BT": CHUNK, "MODE": _dot_mode(q), "HAS_RESET": reset is not None}
        self.q = q

    def k_slice(self, name: str) -> int:
        """The kernel's bks clamped to [MIN_TILE, BK]: the key columns of one slice."""
        return max(MIN_TILE, min(self.config.kernels[name].bks, self.const["BK"]))

    def v_tile(self, launch: KernelLaunch) -> int:
        """A setting's bv (64 if it has none) clamped to [MIN_TILE, V rounded up to a power
        of two]: the value columns of one tile."""
        return max(MIN_TILE, min(launch.bv or 64, next_power_of_2(self.V)))

    def __call__(self, kernel, name: str, per_chunk: bool, *args, slices: int = 1, **const):
        """Launch ``kernel`` over [N * slices, B*H] (per_chunk) or [V / BV, B*H] with the
        config's setting for ``name`` (its bks, if any, clamped by ``k_slice``, and bv then
        to at most bks), or its ``small_grid`` one when the latter grid would not fill the
        device's SMs."""
        launch = self.config.kernels[name]
        if not per_chunk:
            const["N_CONST"] = self.N if self.on_cpu else 0  # see _loop_count
            programs = cdiv(self.V, self.v_tile(launch)) * self.B * self.H
            if name in self.config.small_grid and programs < _sm_count(self.q.device):
                launch = self.config.small_grid[name]
        bv = self.v_tile(launch)
        if launch.prefetch is not None:
            const["PREFETCH"] = int(launch.prefetch)
        if launch.bks is not None:
            const["BKS"] = self.k_slice(name)
            # no value tile wider than the key slice: _bwd_key at BKS 32 (K = 32) with BV 64
            # faults or computes a wrong dq on the H100 (Triton 3.6)
            bv = min(bv, const["BKS"])
        grid = (self.N * slices if per_chunk else cdiv(self.V, bv), self.B * self.H)
        launch_cfg = {} if self.on_cpu else launch.launch().options()
        mode = self.const["MODE"]
        if mode in (1, 2):  # bfloat16 inputs: every kernel's products in bfloat16
            const["MODE"] = mode + 2
        return kernel[grid](*args, BV=bv, **{**self.const, **const}, **launch_cfg)

    def store(self, name: str) -> dict:
        """torch.empty keywords of the intermediate ``name``: bfloat16 for bfloat16 inputs,
        else float32."""
        dtype = self.q.dtype if self.q.dtype == torch.bfloat16 else torch.float32
        return {"device": self.q.device, "dtype": dtype}


class _ChunkedGatedDelta(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, reset, scale: float, config: GatedDeltaConfig):
        run = _Launcher(q, v, reset, g, config)
        B, L, H, K, V, N, rst = run.B, run.L, run.H, run.K, run.V, run.N, run.rst
        f32 = {"device": q.device, "dtype": torch.float32}
        tm = torch.empty(B, H, N * CHUNK, CHUNK, **run.store("T"))
        w, u = torch.empty_like(k), torch.empty(B, L, H, V, **run.store("u"))
        decay_in, decay_out = (torch.empty(B, H, N * CHUNK, **f32) for _ in range(2))
        gamma = torch.empty(B, H, N, **f32)
        run(_fwd_intra, "fwd_intra", True, k, v, g, beta, rst, w, u, tm, decay_in, decay_out,
            gamma, L, N, SOLVE=run.const["MODE"])
        hs = torch.empty(B, H, N, K, V, device=q.device, dtype=q.dtype)
        v_new = torch.empty(B, L, H, V, **run.store("v_new"))
        ht = torch.empty(B, H, K, V, **f32)
        run(_fwd_state, "fwd_state", False, k, w, u, decay_out, gamma,
            ht if h0 is None else h0, hs, v_new, ht, L, N, HAS_H0=h0 is not None, STORE_HT=True)
        del u
        o = torch.empty_like(v)
        run(_fwd_out, "fwd_out", True, q, k, g, beta, rst, hs, v_new, o, L, N, scale)
        ctx.save_for_backward(q, k, v, g, beta, reset, tm, w, hs, v_new, decay_in, decay_out,
                              gamma)
        ctx.scale, ctx.has_h0, ctx.config = scale, h0 is not None, config
        ctx.set_materialize_grads(False)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, reset, tm, w, hs, v_new, decay_in, decay_out, gamma = ctx.saved_tensors
        run = _Launcher(q, v, reset, g, ctx.config)
        B, L, H, K, V, N, rst = run.B, run.L, run.H, run.K, run.V, run.N, run.rst
        f32 = {"device": q.device, "dtype": torch.float32}
        do = torch.zeros_like(v) if do is None else do.to(v.dtype).contiguous()
        # dL/dv_new: the local part, then all of it
        dvn = torch.empty(B, L, H, V, **run.store("dvn"))
        run(_bwd_dv_local, "bwd_dv_local", True, q, k, g, beta, rst, do, dvn, L, ctx.scale)
        dhs = torch.empty_like(hs)
        dh0 = torch.empty(B, H, K, V, **f32) if ctx.has_h0 else None
        dht_arg = dvn if dht is None else dht.float().contiguous()
        run(_bwd_state, "bwd_state", False, q, k, w, decay_in, decay_out, gamma, do, dvn,
            dht_arg, dhs, dvn if dh0 is None else dh0, L, N, ctx.scale,
            HAS_DHT=dht is not None, STORE_DH0=ctx.has_h0)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dg, db = torch.empty_like(g), torch.empty_like(beta)
        # the scratch is described above _bwd_val
        nkb = cdiv(K, run.k_slice("bwd_key"))
        ns = 1 + nkb
        d_qk = torch.empty(B, H, N, CHUNK, CHUNK, **run.store("dqk"))
        scratch = torch.empty(B, H, N, ns, CHUNK, CHUNK, **f32)
        vec = torch.empty(B, H, N, nkb, 2, CHUNK, **f32)
        dk_part = torch.empty(B, L, H, K, **run.store("dk_part"))
        assert db.dtype == torch.float32  # it carries _bwd_val's d_beta part to _bwd_fin
        run(_bwd_val, "bwd_val", True, v, g, beta, rst, tm, v_new, do, dvn, d_qk, scratch, dv,
            db, L, N, NS=ns)
        run(_bwd_key, "bwd_key", True, q, k, g, beta, rst, tm, w, hs, v_new, dhs, do, dvn,
            d_qk, scratch, vec, dq, dk_part, L, N, ctx.scale, slices=nkb, NKB=nkb, NS=ns)
        run(_bwd_fin, "bwd_fin", True, k, g, beta, rst, scratch, vec, dk_part, dk, dg, db, L, N,
            NKB=nkb, NS=ns)
        return dq, dk, dv, dg, db, dh0, None, None, None


# -- entry point --------------------------------------------------------------------------------
def unsupported_reason(q: Tensor, k: Tensor, v: Tensor) -> str | None:
    """Why the Triton kernels cannot take this call (the reference then does), or None."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if q.device.type != "cuda" and not (interpret and q.device.type == "cpu"):
        return f"device {q.device.type} (CUDA, or the CPU under TRITON_INTERPRET=1)"
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"q/k/v dtypes {q.dtype}/{k.dtype}/{v.dtype} (float32 or bfloat16, all equal)"
    if q.shape[-1] > MAX_K:
        return f"head_k_dim {q.shape[-1]} > {MAX_K}"
    return None


_warned: set[str] = set()


def gated_delta_rule_triton(
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
    config: GatedDeltaConfig | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Chunked gated delta rule in Triton; the arguments and results of
    :func:`~megacpp.kernels.ops.gated_delta.reference.gated_delta_rule_chunked`.

    ``chunk_size`` is validated but the kernels always use 64-token chunks (same result).
    Calls the kernels cannot take (see :func:`unsupported_reason`) run the reference.
    ``config``: the launch settings (default: ``configs.CONFIGS`` for q's device).
    """
    _check_inputs(q, k, v, g, beta, initial_state, reset)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size}")
    why = unsupported_reason(q, k, v)
    if why is not None:
        if why not in _warned:
            _warned.add(why)
            warnings.warn(f"gated_delta triton: {why}; this call uses the reference",
                          stacklevel=2)
        return gated_delta_rule_chunked(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, reset=reset,
            output_final_state=output_final_state, chunk_size=chunk_size)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    h0 = None if initial_state is None else initial_state.float().contiguous()
    o, state = _ChunkedGatedDelta.apply(
        q.contiguous(), k.contiguous(), v.contiguous(), g.float().contiguous(),
        beta.float().contiguous(), h0, None if reset is None else reset.contiguous(),
        float(scale), config or for_device(CONFIGS, q.device))
    return o, (state if output_final_state else None)
