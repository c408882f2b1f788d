"""Short causal depthwise conv + SiLU in Triton, forward and backward (the ``short_conv``
surface's training path: every row starts from zeros, no cache).

Under torch.compile the plain-PyTorch form (one multiply-add per tap over shifted slices of a
zero-padded copy, document masks, float32 sums) becomes several Inductor kernels per layer: at
the nam56r-350m step's shape (B 8, L 2048, 1024 channels, 4 taps) about 325 us of forward and
backward per layer on an H100, for ~170 MB of unavoidable bytes (x and
y forward; x, dy and dx backward).

Forward, one program per (BT tokens, BC channels, row)::

    y[t] = silu(acc[t]),   acc[t] = sum_{j < W} w[W-1-j] * x[t-j] * same_doc(t, t-j)

Backward, in two passes through a float32 [B, L, C] scratch::

    _short_conv_dacc   dacc[t] = dy[t] * silu'(acc[t])      (acc recomputed from x)
                       dw[W-1-j] = sum_t dacc[t] * x[t-j] * same_doc(t, t-j): each program
                       runs a few token blocks, accumulates dacc * x[t - lag] for every
                       lag elementwise in one [taps, tokens, channels] tile and reduces it once
                       (float32 partials per program, summed by ops.sum_rows in a fixed order)
    _short_conv_dx     dx[t] = sum_j w[W-1-j] * dacc[t+j] * same_doc(t+j, t)

H100, nam56r shape, fwd+bwd CUDA-graph replay: one pass that formed dacc again at each of the
W positions a token's dx reads, 0.484 ms (its backward 218 us: W * W tap loads per token); two
passes with per-block reductions over the tokens, 0.318; the [taps, tokens, channels] tile,
0.226-0.231; Inductor's compile of the reference 0.33. Launch settings: ``configs.py``.

Saved for backward: x (a view of the caller's tensor), weight and doc_ids; nothing [B, L, C]
of its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from megacpp.errors import MegaCppError
from megacpp.kernels.device import cdiv, next_power_of_2
from megacpp.kernels.launch import for_device
from megacpp.kernels.ops.short_conv.configs import CONFIGS, ShortConvConfig
from megacpp.kernels.ops.sum_rows import sum_rows

MAX_TAPS = 8


@triton.jit
def _tap(X, DOC, b, pos, d_ref, live, c, cm, sx_b, sx_l, sd_b, HAS_DOC: tl.constexpr):
    """x[pos] [BT, BC] in float32, 0 outside the row or (HAS_DOC) outside d_ref's document."""
    m = live & (pos >= 0)
    if HAS_DOC:
        d = tl.load(DOC + b * sd_b + pos, mask=m, other=-1)
        m = m & (d == d_ref)
    ptr = X + b * sx_b + pos.to(tl.int64)[:, None] * sx_l + c[None, :]
    return tl.load(ptr, mask=m[:, None] & cm[None, :], other=0.0).to(tl.float32)


@triton.jit
def _acc(X, W, DOC, b, pos, live, c, cm, sx_b, sx_l, sd_b, KW: tl.constexpr,
         HAS_DOC: tl.constexpr):
    """acc[pos] [BT, BC] (float32) and the documents of ``pos``."""
    d_ref = pos
    if HAS_DOC:
        d_ref = tl.load(DOC + b * sd_b + pos, mask=live, other=-2)
    acc = tl.zeros([pos.shape[0], c.shape[0]], dtype=tl.float32)
    for j in tl.static_range(KW):
        w = tl.load(W + c * KW + (KW - 1 - j), mask=cm, other=0.0).to(tl.float32)
        acc += _tap(X, DOC, b, pos - j, d_ref, live, c, cm, sx_b, sx_l, sd_b, HAS_DOC) * w[None, :]
    return acc, d_ref


@triton.jit
def _short_conv_fwd(X, W, DOC, Y, L, C, sx_b, sx_l, sd_b, KW: tl.constexpr, BT: tl.constexpr,
                    BC: tl.constexpr, HAS_DOC: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    b = tl.program_id(2)
    live, cm = t < L, c < C
    acc, _d = _acc(X, W, DOC, b, t, live, c, cm, sx_b, sx_l, sd_b, KW, HAS_DOC)
    y = acc * tl.sigmoid(acc)
    out = (b * L + t).to(tl.int64)[:, None] * C + c[None, :]
    tl.store(Y + out, y.to(Y.dtype.element_ty), mask=live[:, None] & cm[None, :])


@triton.jit
def _short_conv_dacc(X, W, DOC, DY, DACC, DWP, L, C, sx_b, sx_l, sd_b, sy_b, sy_l,
                     KW: tl.constexpr, KWP: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                     TPP: tl.constexpr, HAS_DOC: tl.constexpr):
    """Backward, first pass, over TPP blocks of BT tokens: dacc = dy * silu'(acc) (float32,
    for _short_conv_dx) and the weight's partials sum_t dacc[t] * x[t-j], accumulated
    elementwise in a [KWP taps, BT, BC] tile and reduced over the tokens once at the end."""
    pid_g = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    b = tl.program_id(2)
    cm = c < C
    lag = tl.arange(0, KWP)
    dw = tl.zeros([KWP, BT, BC], dtype=tl.float32)
    for it in range(TPP):
        t = (pid_g * TPP + it) * BT + tl.arange(0, BT)
        live = t < L
        acc, d_t = _acc(X, W, DOC, b, t, live, c, cm, sx_b, sx_l, sd_b, KW, HAS_DOC)
        dy = tl.load(DY + b * sy_b + t.to(tl.int64)[:, None] * sy_l + c[None, :],
                     mask=live[:, None] & cm[None, :], other=0.0).to(tl.float32)
        sig = tl.sigmoid(acc)
        dacc = dy * sig * (1.0 + acc * (1.0 - sig))
        out = (b * L + t).to(tl.int64)[:, None] * C + c[None, :]
        tl.store(DACC + out, dacc, mask=live[:, None] & cm[None, :])
        # x[t - lag] for every lag as one [KWP, BT, BC] tile (cached rows), same document
        pos = t[None, :] - lag[:, None]  # [KWP, BT]
        m = live[None, :] & (pos >= 0) & (lag < KW)[:, None]
        if HAS_DOC:
            m = m & (tl.load(DOC + b * sd_b + pos, mask=m, other=-1) == d_t[None, :])
        xs = tl.load(X + b * sx_b + pos.to(tl.int64)[:, :, None] * sx_l + c[None, None, :],
                     mask=m[:, :, None] & cm[None, None, :], other=0.0).to(tl.float32)
        dw += dacc[None, :, :] * xs
    part = ((b * tl.num_programs(0) + pid_g).to(tl.int64) * C + c[None, :]) * KW
    tl.store(DWP + part + (KW - 1 - lag)[:, None], tl.sum(dw, axis=1),
             mask=(lag < KW)[:, None] & cm[None, :])


@triton.jit
def _short_conv_dx(DACC, W, DOC, DX, L, C, sd_b, KW: tl.constexpr, BT: tl.constexpr,
                   BC: tl.constexpr, HAS_DOC: tl.constexpr):
    """Backward, second pass: dx[t] = sum_j w[W-1-j] * dacc[t+j], inside t's document."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    b = tl.program_id(2)
    live, cm = t < L, c < C
    d_t = t
    if HAS_DOC:
        d_t = tl.load(DOC + b * sd_b + t, mask=live, other=-3)
    dx = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(KW):
        u = t + j
        same = live & (u < L)
        if HAS_DOC:
            same = same & (tl.load(DOC + b * sd_b + u, mask=same, other=-4) == d_t)
        dacc = tl.load(DACC + (b * L + u).to(tl.int64)[:, None] * C + c[None, :],
                       mask=same[:, None] & cm[None, :], other=0.0)
        w = tl.load(W + c * KW + (KW - 1 - j), mask=cm, other=0.0).to(tl.float32)
        dx += dacc * w[None, :]
    out = (b * L + t).to(tl.int64)[:, None] * C + c[None, :]
    tl.store(DX + out, dx.to(DX.dtype.element_ty), mask=live[:, None] & cm[None, :])


def _checked(x: Tensor, weight: Tensor, doc_ids: Tensor | None) -> Tensor | None:
    if x.dim() != 3 or x.stride(-1) != 1:
        raise MegaCppError(f"short_conv triton: x must be [B, L, C] with unit channel stride, "
                           f"got shape {tuple(x.shape)} strides {x.stride()}")
    if weight.shape != (x.shape[-1], weight.shape[-1]) or not 1 <= weight.shape[-1] <= MAX_TAPS:
        raise MegaCppError(f"short_conv triton: weight must be [C={x.shape[-1]}, W <= {MAX_TAPS}], "
                           f"got {tuple(weight.shape)}")
    if x.dtype == torch.float64:
        raise MegaCppError("short_conv triton: float64 is not supported (use the reference)")
    B, L, C = x.shape
    if max(B * L * C, (B - 1) * x.stride(0) + (L - 1) * x.stride(1) + C) >= 2**31:
        raise MegaCppError("short_conv triton: tensors of 2**31 elements or more are not "
                           "supported (32-bit row offsets); split the batch")
    if doc_ids is None:
        return None
    if tuple(doc_ids.shape) != tuple(x.shape[:2]) or doc_ids.is_floating_point():
        raise MegaCppError(f"short_conv triton: doc_ids must be integer [B, L] = "
                           f"{list(x.shape[:2])}, got {doc_ids.dtype} {list(doc_ids.shape)}")
    return doc_ids.to(torch.int32).contiguous()


def _grid(x: Tensor, config: ShortConvConfig) -> tuple[int, int, int]:
    B, L, C = x.shape
    return cdiv(L, config.block_t), cdiv(C, config.block_c), B


class _ShortConvFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, doc: Tensor | None,
                config: ShortConvConfig) -> Tensor:
        B, L, C = x.shape
        w = weight.contiguous()
        y = torch.empty(B, L, C, device=x.device, dtype=x.dtype)
        _short_conv_fwd[_grid(x, config)](
            x, w, doc, y, L, C, x.stride(0), x.stride(1), L, KW=w.shape[1], BT=config.block_t,
            BC=config.block_c, HAS_DOC=doc is not None, num_warps=config.num_warps)
        ctx.save_for_backward(x, w, doc)
        ctx.weight_dtype, ctx.config = weight.dtype, config
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w, doc = ctx.saved_tensors
        config = ctx.config
        dy = dy if dy.stride(-1) == 1 else dy.contiguous()
        B, L, C = x.shape
        grid = _grid(x, config)
        meta = {"KW": w.shape[1], "BT": config.block_t, "BC": config.block_c,
                "HAS_DOC": doc is not None, "num_warps": config.num_warps}
        groups = cdiv(grid[0], config.dacc_blocks)
        dacc = torch.empty(B, L, C, device=x.device, dtype=torch.float32)
        parts = torch.empty(B * groups, C, w.shape[1], device=x.device, dtype=torch.float32)
        _short_conv_dacc[(groups, grid[1], B)](
            x, w, doc, dy, dacc, parts, L, C, x.stride(0), x.stride(1), L, dy.stride(0),
            dy.stride(1), KWP=next_power_of_2(w.shape[1]), TPP=config.dacc_blocks, **meta)
        dx = torch.empty(B, L, C, device=x.device, dtype=x.dtype)
        _short_conv_dx[grid](dacc, w, doc, dx, L, C, L, **meta)
        dw = sum_rows(parts.view(parts.shape[0], -1)).view(C, w.shape[1])
        return dx, dw.to(ctx.weight_dtype), None, None


def short_conv_triton(x: Tensor, weight: Tensor, doc_ids: Tensor | None = None,
                      config: ShortConvConfig | None = None) -> Tensor:
    """Same contract as :func:`megacpp.kernels.ops.short_conv.reference.short_conv_reference`:
    x [B, L, C] (unit channel stride; bf16, fp16 or fp32), weight [C, W <= 8], doc_ids [B, L]
    or None -> silu(causal depthwise conv) [B, L, C] in x.dtype, float32 sums. ``config``:
    the launch setting (default: ``configs.CONFIGS`` for x's device)."""
    doc = _checked(x, weight, doc_ids)
    return _ShortConvFn.apply(x, weight, doc, config or for_device(CONFIGS, x.device))
