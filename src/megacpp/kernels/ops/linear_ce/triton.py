"""Fused linear cross-entropy: the [T, V] logits are never materialised.

Tokens are processed in chunks of ``chunk_tokens`` rows. Per chunk:

1. ``logits = h_c @ W^T`` (cuBLAS, float32 accumulation, stored in the operand dtype) [C, V]
2. one Triton program per row: online max / sum-exp over V in float32 -> lse, loss row;
   second sweep writes ``(softmax - onehot) / n_kept`` over the logits in place [C, V]
3. ``dh_c = G @ W`` [C, D];  ``dW += G^T @ h_c`` into a float32 accumulator [V, D]

so the loss and every gradient sum are accumulated in float32. The gradients are computed in
the forward (the loss is a scalar, so backward only scales them by ``grad_output``). Saved for
backward: dh [T, D] (operand dtype) and dW [V, D] (float32 until backward casts it).
Peak extra memory: one chunk of logits (C * V operand-dtype elements) plus dW in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from megacpp.kernels.ops.linear_ce.reference import IGNORE_INDEX

DEFAULT_CHUNK_BYTES = 256 * 2**20  # one chunk of logits at most this big


@triton.jit
def _ce_rows(LOGITS, LABELS, LOSS, INV_N, stride, ignore_index, n_cols: tl.constexpr,
             BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = LOGITS + row.to(tl.int64) * stride
    cols = tl.arange(0, BLOCK)
    label = tl.load(LABELS + row)
    # sweep 1: per-lane running max and sum of exp (float32)
    m = tl.full((BLOCK,), -1e30, tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, n_cols, BLOCK):
        v = tl.load(base + start + cols, mask=start + cols < n_cols, other=float("-inf"))
        v = v.to(tl.float32)
        m_new = tl.maximum(m, v)
        s = s * tl.exp(m - m_new) + tl.exp(v - m_new)
        m = m_new
    m_row = tl.max(m, axis=0)
    lse = m_row + tl.log(tl.sum(s * tl.exp(m - m_row), axis=0))
    kept = label != ignore_index
    safe_label = tl.where(kept, label, 0)
    target = tl.load(base + safe_label).to(tl.float32)
    tl.store(LOSS + row, tl.where(kept, lse - target, 0.0))
    # sweep 2: gradient of the mean loss, written over the logits
    scale = tl.where(kept, tl.load(INV_N), 0.0)
    for start in range(0, n_cols, BLOCK):
        idx = start + cols
        v = tl.load(base + idx, mask=idx < n_cols, other=0.0).to(tl.float32)
        g = tl.exp(v - lse) - tl.where(idx == safe_label, 1.0, 0.0)
        tl.store(base + idx, (g * scale).to(LOGITS.dtype.element_ty), mask=idx < n_cols)


def _accumulate_weight_grad(dw: Tensor, grad_logits: Tensor, h_chunk: Tensor) -> None:
    """dw [V, D] float32 += grad_logits^T [V, C] @ h_chunk [C, D] (float32 accumulation)."""
    if dw.device.type == "cuda":
        torch.addmm(dw, grad_logits.t(), h_chunk, out_dtype=torch.float32, out=dw)
    else:  # the CPU (interpreter) path: no mixed-dtype addmm there
        dw.add_(grad_logits.t().float() @ h_chunk.float())


def _forward_and_grads(
    h: Tensor, weight: Tensor, labels: Tensor, ignore_index: int, chunk_tokens: int
) -> tuple[Tensor, Tensor, Tensor]:
    """loss (float32 scalar), dh [T, D] (h.dtype), dw [V, D] (float32) of the mean loss."""
    n_tokens, vocab = h.shape[0], weight.shape[0]
    n_kept = (labels != ignore_index).sum()
    inv_n = 1.0 / n_kept.clamp(min=1).to(torch.float32)  # stays on device: no host sync
    losses = torch.empty(n_tokens, device=h.device, dtype=torch.float32)
    dh = torch.empty_like(h)
    dw = torch.zeros(vocab, h.shape[1], device=h.device, dtype=torch.float32)
    block = min(triton.next_power_of_2(vocab), 4096)
    for start in range(0, n_tokens, chunk_tokens):
        rows = slice(start, min(start + chunk_tokens, n_tokens))
        h_chunk = h[rows]  # [C, D]
        logits = h_chunk @ weight.t()  # [C, V], becomes the gradient in place
        _ce_rows[(logits.shape[0],)](logits, labels[rows], losses[rows], inv_n,
                                     logits.stride(0), ignore_index, n_cols=vocab, BLOCK=block,
                                     num_warps=16)
        torch.mm(logits, weight, out=dh[rows])
        _accumulate_weight_grad(dw, logits, h_chunk)
    return losses.sum() * inv_n, dh, dw


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, labels: Tensor, ignore_index: int,
                chunk_tokens: int) -> Tensor:
        loss, dh, dw = _forward_and_grads(h, weight, labels, ignore_index, chunk_tokens)
        ctx.save_for_backward(dh, dw)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        dh, dw = ctx.saved_tensors
        return dh * grad_loss.to(dh.dtype), (dw * grad_loss).to(ctx.weight_dtype), None, None, None


def linear_cross_entropy_triton(
    h: Tensor, weight: Tensor, labels: Tensor, ignore_index: int = IGNORE_INDEX,
    chunk_tokens: int | None = None,
) -> Tensor:
    """Same contract as the reference: h [T, D], weight [V, D], labels [T] -> mean loss
    (float32 scalar). ``chunk_tokens`` defaults to the rows whose logits fit 256 MiB."""
    if chunk_tokens is None:
        per_row = weight.shape[0] * h.element_size()
        chunk_tokens = max(16, DEFAULT_CHUNK_BYTES // per_row)
    return _FusedLinearCrossEntropy.apply(
        h.contiguous(), weight.contiguous(), labels.contiguous(), ignore_index, chunk_tokens
    )
