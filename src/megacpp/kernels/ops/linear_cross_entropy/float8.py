"""The fused linear cross-entropy with its three GEMMs in float8 (the FP8 lane's
``parallel.float8_head``): the LM head's logits, the hidden states' gradient and the head
weight's gradient go through ``torch._scaled_mm`` with tensor-wise scales; the
cross-entropy itself (max, sum-exp, loss, softmax - onehot) stays in float32, as in
:mod:`megacpp.kernels.ops.linear_cross_entropy.triton`, whose chunking, float32 weight
gradient accumulator and in-forward gradients this follows.

Per chunk of C token rows (h [T, D], weight W [V, D], one e4m3 copy of W and of its
transpose per call):

1. ``logits = h8_c @ W8^T`` (h_c cast to e4m3 with its own amax scale; bf16 out) [C, V]
2. the cross-entropy rows (float32) write ``G = (softmax - onehot) / n_kept`` [C, V]
3. ``G8 = e5m2(G * s)``: |G| <= 1 / n_kept, so s is a power of two under
   ``e5m2_max * n_kept / 2`` -- a scale known before G exists (no amax pass)
4. ``dh_c = G8 @ W8`` (bf16 out) [C, D]
5. ``dW += G8^T @ h8_c`` (float32 out, added to the float32 accumulator) [V, D]

A chunk whose row count is not a multiple of 16 (``torch._scaled_mm`` needs it) runs its
GEMMs in bf16. On CUDA the cross-entropy rows are the Triton kernel of the bf16 path; on the
CPU (tests) the same math in PyTorch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megacpp.errors import MegaCppError
from megacpp.kernels.amp import autocast_dtype
from megacpp.kernels.ops.linear_cross_entropy.reference import IGNORE_INDEX

ALIGN = 16  # torch._scaled_mm's dims: multiples of this
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
CHUNK_BYTES = 128 << 20  # bf16 logits of one chunk, as the bf16 path's default


def float8_head_rejection(vocab: int, d_model: int) -> str | None:
    """Why an LM head of these dims cannot take the float8 GEMMs, or None."""
    if vocab % ALIGN or d_model % ALIGN:
        return (f"vocab x d_model {vocab}x{d_model} not multiples of {ALIGN} (the float8 GEMM "
                "needs them)")
    return None


def to_e4m3(x: Tensor) -> tuple[Tensor, Tensor]:
    """x -> (e4m3 x * scale, 1 / scale) with scale = e4m3_max / amax(x) (tensor-wise)."""
    top = torch.finfo(E4M3).max
    amax = x.detach().abs().amax().float().clamp(min=1e-12)
    scale = top / amax
    return (x.float() * scale).clamp(-top, top).to(E4M3), scale.reciprocal()


def grad_scale(inv_n: Tensor) -> Tensor:
    """The e5m2 scale of G = (softmax - onehot) * inv_n, |G| <= inv_n: the power of two
    at or under e5m2_max / (2 * inv_n) (headroom for bf16 rounding of G)."""
    return torch.exp2(torch.floor(torch.log2(torch.finfo(E5M2).max / (2 * inv_n))))


def _scaled_mm(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype,
               fast: bool) -> Tensor:
    """a [M, K] (row-major) @ b [K, N] (column-major), float8 operands, dequant scales."""
    return torch._scaled_mm(a, b, scale_a.reshape(()), scale_b.reshape(()),
                            out_dtype=out_dtype, use_fast_accum=fast)


def _ce_rows_torch(logits: Tensor, labels: Tensor, inv_n: Tensor, ignore_index: int,
                   write_grad: bool) -> Tensor:
    """Per-row loss (float32) of logits [C, V]; with ``write_grad`` the gradient of the mean
    loss, (softmax - onehot) * inv_n, overwrites the logits (float32 math)."""
    values = logits.float()
    kept = labels != ignore_index
    safe = torch.where(kept, labels, 0)
    lse = torch.logsumexp(values, dim=-1)
    loss = torch.where(kept, lse - values.gather(1, safe[:, None])[:, 0], 0.0)
    if write_grad:
        grad = torch.softmax(values, dim=-1)
        grad[torch.arange(grad.shape[0], device=grad.device), safe] -= 1.0
        logits.copy_(grad * (inv_n * kept)[:, None])
    return loss


def _ce_rows(logits: Tensor, labels: Tensor, losses: Tensor, inv_n: Tensor,
             ignore_index: int, write_grad: bool) -> None:
    if not logits.is_cuda:
        losses.copy_(_ce_rows_torch(logits, labels, inv_n, ignore_index, write_grad))
        return
    from megacpp.kernels.launch import for_device
    from megacpp.kernels.ops.linear_cross_entropy import triton as fused
    from megacpp.kernels.ops.linear_cross_entropy.configs import CONFIGS

    config = for_device(CONFIGS, logits.device)
    n_rows, vocab = logits.shape
    block = min(fused.next_power_of_2(vocab), config.block)
    fused._ce_rows[(fused._ce_programs(n_rows, logits.device, config),)](
        logits, labels, losses, inv_n, n_rows, logits.stride(0), ignore_index,
        n_cols=vocab, BLOCK=block, WRITE_GRAD=write_grad,
        num_warps=max(1, min(config.num_warps, block // 32)))


def _forward(h: Tensor, weight: Tensor, labels: Tensor, ignore_index: int, chunk_tokens: int,
             need_dh: bool, need_dw: bool) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """loss (float32 scalar), dh [T, D] (h.dtype) and the float32 dW [V, D] of the mean loss
    (None where not needed)."""
    n_tokens = h.shape[0]
    n_kept = (labels != ignore_index).sum()
    inv_n = 1.0 / n_kept.clamp(min=1).to(torch.float32)  # on the device: no host sync
    losses = torch.empty(n_tokens, device=h.device, dtype=torch.float32)
    need_grad = need_dh or need_dw
    dh = torch.empty_like(h) if need_dh else None
    dw = torch.zeros(weight.shape, device=h.device, dtype=torch.float32) if need_dw else None
    w8, w_inv = to_e4m3(weight)  # [V, D]
    w8_t = w8.t().contiguous() if need_dh else None  # [D, V]: W8 column-major for dh
    g_scale = grad_scale(inv_n)
    g_inv = g_scale.reciprocal()
    for start in range(0, n_tokens, chunk_tokens):
        rows = slice(start, min(start + chunk_tokens, n_tokens))
        h_chunk = h[rows]  # [C, D]
        aligned = h_chunk.shape[0] % ALIGN == 0
        if aligned:
            h8, h_inv = to_e4m3(h_chunk)
            logits = _scaled_mm(h8, w8.t(), h_inv, w_inv, h.dtype, True)  # [C, V]
        else:
            logits = h_chunk @ weight.to(h.dtype).t()
        _ce_rows(logits, labels[rows], losses[rows], inv_n, ignore_index, need_grad)
        if not need_grad:
            continue
        if not aligned:
            if need_dh:
                torch.mm(logits, weight.to(h.dtype), out=dh[rows])
            if need_dw:
                dw.addmm_(logits.t().float(), h_chunk.float())
            continue
        g8 = (logits * g_scale.to(logits.dtype)).to(E5M2)  # [C, V]; x 2^n: exact in bf16
        if need_dh:
            dh[rows] = _scaled_mm(g8, w8_t.t(), g_inv, w_inv, h.dtype, False)
        if need_dw:  # G8^T [V, C] row-major, h8 [C, D] column-major
            dw += _scaled_mm(g8.t().contiguous(), h8.t().contiguous().t(), g_inv, h_inv,
                             torch.float32, False)
        del logits, g8
    return losses.sum() * inv_n, dh, dw


class _Float8LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, labels: Tensor, ignore_index: int,
                chunk_tokens: int, need_dh: bool, need_dw: bool) -> Tensor:
        loss, dh, dw = _forward(h, weight, labels, ignore_index, chunk_tokens, need_dh, need_dw)
        ctx.grads = (dh, dw)  # kept on ctx, not saved: backward scales them and hands them out
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        if ctx.grads is None:
            raise MegaCppError("float8 linear cross-entropy: backward ran twice on one forward "
                               "(retain_graph is not supported: the gradients are handed out)")
        (dh, dw), ctx.grads = ctx.grads, None
        scale = grad_loss.detach().to(torch.float32)
        if dh is not None:
            dh = dh.mul_(scale.to(dh.dtype))
        if dw is not None:
            dw = dw.mul_(scale).to(ctx.weight_dtype)
        return dh, dw, None, None, None, None, None


def linear_cross_entropy_float8(
    h: Tensor, weight: Tensor, labels: Tensor, ignore_index: int = IGNORE_INDEX,
    chunk_tokens: int | None = None,
) -> Tensor:
    """h [T, D], weight [V, D] (its master dtype: quantized from it), labels [T] -> mean loss
    (float32 scalar), the GEMMs in float8 (module docstring). Under autocast a float32 h runs
    in the autocast dtype; dW comes back in the weight's dtype."""
    cast = autocast_dtype(h.device.type)
    if cast is not None and h.dtype == torch.float32:
        h = h.to(cast)
    if not h.is_floating_point() or h.element_size() < 2:
        raise MegaCppError(f"float8 linear cross-entropy needs float h, got {h.dtype}")
    if float8_head_rejection(*weight.shape) is not None:
        raise MegaCppError(f"float8 linear cross-entropy: {float8_head_rejection(*weight.shape)}")
    if chunk_tokens is None:
        chunk_tokens = max(64, CHUNK_BYTES // (weight.shape[0] * h.element_size()) // 64 * 64)
    grad = torch.is_grad_enabled()
    return _Float8LinearCrossEntropy.apply(
        h.contiguous(), weight.contiguous(), labels.contiguous(), ignore_index, chunk_tokens,
        grad and h.requires_grad, grad and weight.requires_grad)
