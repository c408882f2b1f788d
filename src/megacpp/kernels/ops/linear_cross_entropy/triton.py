"""Fused linear cross-entropy: the [T, V] logits are never materialised, every sum is float32,
and the float32 weight gradient never coexists with its full-size cast copy.

Tokens are processed in chunks of ``chunk_tokens`` rows. Per chunk:

1. ``logits = h_c @ W^T`` (cuBLAS, float32 accumulation, stored in the operand dtype) [C, V]
2. :func:`_ce_rows`: per row, online max / sum-exp over V in float32 -> lse and the loss; a
   second sweep writes ``(softmax - onehot) / n_kept`` over the logits in place [C, V]
3. ``dh_c = G @ W`` (cuBLAS) [C, D]
4. ``dW += G^T @ h_c``: cuBLAS ``addmm(..., out_dtype=float32)`` into a float32 accumulator
   held as two row halves [V/2, D] (float32 accumulation inside the GEMM, the accumulator
   read and written once per chunk by the GEMM's epilogue). Backward scales and rounds the
   first half into a temporary, frees it, then writes the [V, D] result: the float32 halves
   and a full cast copy never coexist (peak = 1.25 x the float32 dW).

The loss sums in float32. Gradients are computed in the forward (the loss is a scalar, so
backward only scales them by ``grad_output``, in place). Peak extra memory: dh [T, D] + the
float32 dW (V x D x 4 bytes) + one chunk of logits (C x V operand-dtype elements).
Under ``no_grad`` (or when neither input needs a gradient) only the loss is computed.
Launch settings: ``configs.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from megacpp.errors import MegaCppError
from megacpp.kernels.amp import autocast_operands
from megacpp.kernels.device import cdiv, next_power_of_2, sm_count
from megacpp.kernels.launch import for_device
from megacpp.kernels.ops.linear_cross_entropy.configs import CONFIGS, LinearCEConfig
from megacpp.kernels.ops.linear_cross_entropy.reference import IGNORE_INDEX

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _ce_rows(LOGITS, LABELS, LOSS, INV_N, n_rows, stride, ignore_index, n_cols: tl.constexpr,
             BLOCK: tl.constexpr, WRITE_GRAD: tl.constexpr):
    """Rows pid, pid + grid, ...: loss row (float32) and, if WRITE_GRAD, the gradient of the
    mean loss written over the logits. Sweep 1 keeps a running max and sum per lane ([BLOCK]
    vectors, reduced once per row) instead of reducing every block across the warps."""
    cols = tl.arange(0, BLOCK)
    for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        base = LOGITS + tl.cast(row, tl.int64) * stride
        label = tl.load(LABELS + row)
        # sweep 1: running max and sum of exp (float32, base 2), per lane
        m_l = tl.full([BLOCK], -float("inf"), tl.float32)
        s_l = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n_cols, BLOCK):
            v = tl.load(base + start + cols, mask=start + cols < n_cols,
                        other=-float("inf")).to(tl.float32) * LOG2E
            m_new = tl.maximum(m_l, v)
            # a lane that has seen only -inf (masked) keeps s = 0: no -inf - -inf
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
            s_l = s_l * tl.exp2(m_l - m_safe) + tl.exp2(v - m_safe)
            m_l = m_new
        m = tl.max(m_l, axis=0)
        s = tl.sum(s_l * tl.exp2(m_l - m), axis=0)
        lse2 = m + tl.log2(s)  # log2-sum-exp2 of the base-2 logits
        kept = label != ignore_index
        safe_label = tl.where(kept, label, 0)
        target = tl.load(base + safe_label).to(tl.float32)
        tl.store(LOSS + row, tl.where(kept, lse2 / LOG2E - target, 0.0))
        if WRITE_GRAD:
            # sweep 2: (softmax - onehot) * scale, over the logits in place
            scale = tl.where(kept, tl.load(INV_N), 0.0)
            for start in range(0, n_cols, BLOCK):
                idx = start + cols
                v = tl.load(base + idx, mask=idx < n_cols, other=0.0).to(tl.float32)
                g = tl.exp2(v * LOG2E - lse2) - tl.where(idx == safe_label, 1.0, 0.0)
                tl.store(base + idx, (g * scale).to(LOGITS.dtype.element_ty), mask=idx < n_cols)


@triton.jit
def _scale_inplace(X, SCALE, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32) * tl.load(SCALE)
    tl.store(X + offs, x.to(X.dtype.element_ty), mask=mask)


@triton.jit
def _scale_cast(SRC, OUT, SCALE, n, BLOCK: tl.constexpr):
    """OUT (any float dtype, contiguous) <- round(scale * SRC) for a float32 SRC."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(SRC + offs, mask=mask, other=0.0) * tl.load(SCALE)
    tl.store(OUT + offs, x.to(OUT.dtype.element_ty), mask=mask)


def _ce_programs(n_rows: int, device: torch.device, config: LinearCEConfig) -> int:
    if device.type != "cuda":
        return n_rows
    return max(1, min(n_rows, config.programs_per_sm * sm_count(device)))


def _scale_(x: Tensor, scale: Tensor) -> Tensor:
    block = 4096
    _scale_inplace[(cdiv(x.numel(), block),)](x, scale, x.numel(), BLOCK=block)
    return x


def _fp32_halves(weight: Tensor) -> list[Tensor]:
    """Zeroed float32 accumulator for dW as two separate row halves [V/2, D] (two allocations,
    so backward can free the first before the result is allocated)."""
    vocab = weight.shape[0]
    split = min(vocab, ((vocab + 1) // 2 + 7) // 8 * 8)  # 16-byte aligned second half
    return [torch.zeros(rows, weight.shape[1], device=weight.device, dtype=torch.float32)
            for rows in (split, vocab - split) if rows > 0]


def accumulate_weight_grad_fp32(halves: list[Tensor], grad_logits: Tensor, h_chunk: Tensor
                                ) -> None:
    """float32 halves [V_i, D] += grad_logits[:, V_i]^T @ h_chunk (float32 accumulation)."""
    start = 0
    for acc in halves:
        g = grad_logits[:, start:start + acc.shape[0]].t()  # [V_i, C], column-major view
        if acc.is_cuda:
            torch.addmm(acc, g, h_chunk, out_dtype=torch.float32, out=acc)
        else:  # CPU (the interpreter tests): no mixed-dtype addmm there
            acc.addmm_(g.float(), h_chunk.float())
        start += acc.shape[0]


def _scale_cast_into(src: Tensor, out: Tensor, scale: Tensor) -> None:
    block = 4096
    _scale_cast[(cdiv(src.numel(), block),)](src, out, scale, src.numel(), BLOCK=block)


def finish_weight_grad_fp32(halves: list[Tensor], scale: Tensor, dtype: torch.dtype) -> Tensor:
    """round(scale * float32 dW) as one [V, D] ``dtype`` tensor; empties ``halves``. The first
    half is cast into a temporary and freed before the result is allocated (peak: the float32
    dW + a quarter of it, never float32 + a full cast copy)."""
    first = halves.pop(0)
    rows, hidden = first.shape
    tmp = torch.empty(first.shape, device=first.device, dtype=dtype)
    _scale_cast_into(first, tmp, scale)
    del first
    out = torch.empty(rows + sum(a.shape[0] for a in halves), hidden, device=tmp.device,
                      dtype=dtype)
    out[:rows].copy_(tmp)
    del tmp
    if halves:
        _scale_cast_into(halves.pop(0), out[rows:], scale)
    return out


def _forward(h: Tensor, weight: Tensor, labels: Tensor, ignore_index: int, chunk_tokens: int,
             need_dh: bool, need_dw: bool, config: LinearCEConfig
             ) -> tuple[Tensor, Tensor | None, list[Tensor] | None]:
    """loss (float32 scalar), dh [T, D] (h.dtype) and the float32 dW halves of the mean loss
    (None where not needed)."""
    n_tokens, vocab = h.shape[0], weight.shape[0]
    n_kept = (labels != ignore_index).sum()
    inv_n = 1.0 / n_kept.clamp(min=1).to(torch.float32)  # stays on device: no host sync
    losses = torch.empty(n_tokens, device=h.device, dtype=torch.float32)
    need_grad = need_dh or need_dw
    dh = torch.empty_like(h) if need_dh else None
    acc = _fp32_halves(weight) if need_dw else None
    block = min(next_power_of_2(vocab), config.block)
    for start in range(0, n_tokens, chunk_tokens):
        rows = slice(start, min(start + chunk_tokens, n_tokens))
        h_chunk = h[rows]  # [C, D]
        logits = h_chunk @ weight.t()  # [C, V], becomes the gradient in place
        n_rows = logits.shape[0]
        _ce_rows[(_ce_programs(n_rows, h.device, config),)](
            logits, labels[rows], losses[rows], inv_n, n_rows, logits.stride(0), ignore_index,
            n_cols=vocab, BLOCK=block, WRITE_GRAD=need_grad,
            num_warps=max(1, min(config.num_warps, block // 32)))  # >= 1 column a thread
        if need_dh:
            torch.mm(logits, weight, out=dh[rows])
        if need_dw:
            accumulate_weight_grad_fp32(acc, logits, h_chunk)
        del logits
    return losses.sum() * inv_n, dh, acc


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, labels: Tensor, ignore_index: int,
                chunk_tokens: int, need_dh: bool, need_dw: bool, config: LinearCEConfig
                ) -> Tensor:
        loss, dh, acc = _forward(h, weight, labels, ignore_index, chunk_tokens, need_dh,
                                 need_dw, config)
        # kept on ctx, not saved: backward scales them in place and hands them out
        ctx.grads = (dh, acc)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        if ctx.grads is None:
            raise MegaCppError("fused linear cross-entropy: backward ran twice on one forward "
                               "(retain_graph is not supported: the gradients are handed out)")
        (dh, acc), ctx.grads = ctx.grads, None
        scale = grad_loss.detach().to(torch.float32).reshape(1)
        if dh is not None:
            dh = _scale_(dh, scale)
        dw = finish_weight_grad_fp32(acc, scale, ctx.weight_dtype) if acc is not None else None
        return dh, dw, None, None, None, None, None, None


def default_chunk_tokens(vocab: int, element_size: int, config: LinearCEConfig) -> int:
    """Rows whose logits fit ``config.chunk_bytes`` (a multiple of 64, at least 64)."""
    return max(64, config.chunk_bytes // (vocab * element_size) // 64 * 64)


def linear_cross_entropy_triton(
    h: Tensor, weight: Tensor, labels: Tensor, ignore_index: int = IGNORE_INDEX,
    chunk_tokens: int | None = None, config: LinearCEConfig | None = None,
) -> Tensor:
    """Same contract as the reference: h [T, D], weight [V, D], labels [T] -> mean loss
    (float32 scalar). ``chunk_tokens`` defaults to the rows whose logits fit the config's
    ``chunk_bytes`` (128 MiB); ``config``: the launch setting (default: ``configs.CONFIGS``
    for h's device). Under autocast, float32 h / weight run in the autocast dtype (as the
    reference's ``h @ W.T`` does)."""
    h, weight = autocast_operands(h, weight)
    if h.dtype != weight.dtype or h.dtype not in (torch.bfloat16, torch.float16):
        raise MegaCppError(f"fused linear cross-entropy needs bf16/fp16 h and weight of one "
                           f"dtype, got {h.dtype} and {weight.dtype}")
    config = config or for_device(CONFIGS, h.device)
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(weight.shape[0], h.element_size(), config)
    grad = torch.is_grad_enabled()
    return _FusedLinearCrossEntropy.apply(
        h.contiguous(), weight.contiguous(), labels.contiguous(), ignore_index, chunk_tokens,
        grad and h.requires_grad, grad and weight.requires_grad, config)
