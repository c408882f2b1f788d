"""Muon's two elementwise passes as one Triton launch each over all of a batch's parameters.

The foreach reference makes six passes over float32 tensors the size of the Muon parameters
(momentum: scale the buffer, add the gradient, form the Nesterov update; apply: decay the
weights, scale the update by lr, add it) plus a cast of the update into the Newton-Schulz
dtype and one of its result back to float32. At nam56r-350m (324M Muon parameters) that is
~25 GB a step, ~8 ms of an H100's bandwidth. Here:

* ``muon_momentum_triton`` reads buffer and gradient once, writes the buffer and the update,
  the update straight into the Newton-Schulz input in its dtype (bf16): 4.6 GB; it also takes
  the clipping coefficient (``grad_scale``), so the trainer's clip need not rewrite the
  gradients first (another 2.6 GB);
* ``muon_apply_triton`` reads the weights and the bf16 orthogonalized update, writes the
  weights: 3.3 GB.

Each launch covers a list of tensors of different sizes through a table of their addresses
(int64, device) -- one program per (block of a tensor, tensor) -- as a multi-tensor apply does.
One table per launch is copied from pinned host memory and kept with the optimizer state (``tables``): a
CUDA graph captures that copy, and its replays copy the same addresses again (the graph's
tensors never move). Same arithmetic as the reference in float32; products may fuse into
FMAs, so results agree to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from megacpp.kernels.ops.muon.reference import check_grad_scale

BLOCK, NUM_WARPS = 4096, 8


@triton.jit
def _momentum(TABLE, OUT, SCALE, n_tensors, momentum, NESTEROV: tl.constexpr,
              HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    # TABLE [4, n_tensors]: buffer addresses, gradient addresses, element counts, out offsets;
    # SCALE (HAS_SCALE): one float32 every gradient is multiplied by (the clipping coefficient)
    BUFS, GRADS = TABLE, TABLE + n_tensors
    NUMELS, OUT_OFFSETS = TABLE + 2 * n_tensors, TABLE + 3 * n_tensors
    t = tl.program_id(1)
    n = tl.load(NUMELS + t)
    buf = tl.load(BUFS + t).to(tl.pointer_type(tl.float32))
    grad = tl.load(GRADS + t).to(tl.pointer_type(tl.float32))
    out = OUT + tl.load(OUT_OFFSETS + t)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    g = tl.load(grad + offs, mask=live)
    if HAS_SCALE:
        g = g * tl.load(SCALE)
    b = tl.load(buf + offs, mask=live) * momentum + g
    tl.store(buf + offs, b, mask=live)
    if NESTEROV:
        b = g + momentum * b
    tl.store(out + offs, b.to(OUT.dtype.element_ty), mask=live)


@triton.jit
def _apply(TABLE, ORTHO, n_tensors, LR, lr_value, weight_decay, scale,
           LR_ON_DEVICE: tl.constexpr, BLOCK: tl.constexpr):
    # TABLE [3, n_tensors]: parameter addresses, element counts, offsets into ORTHO
    PARAMS, NUMELS, ORTHO_OFFSETS = TABLE, TABLE + n_tensors, TABLE + 2 * n_tensors
    t = tl.program_id(1)
    n = tl.load(NUMELS + t)
    param = tl.load(PARAMS + t).to(tl.pointer_type(tl.float32))
    ortho = ORTHO + tl.load(ORTHO_OFFSETS + t)
    lr = lr_value
    if LR_ON_DEVICE:
        lr = tl.load(LR).to(tl.float32)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    p = tl.load(param + offs, mask=live)
    o = tl.load(ortho + offs, mask=live).to(tl.float32)
    tl.store(param + offs, p * (1 - lr * weight_decay) - scale * (lr * o), mask=live)


def _check(name: str, tensors: list[Tensor]) -> None:
    for t in tensors:
        if t.dtype != torch.float32 or not t.is_contiguous() or not t.is_cuda:
            raise ValueError(f"{name}: the fused Muon passes take contiguous float32 CUDA "
                             f"tensors, got {t.dtype} {tuple(t.shape)} on {t.device}"
                             f"{'' if t.is_contiguous() else ' (not contiguous)'}")


def _table(rows: list[list[int]], device: torch.device, keep: list[Tensor]) -> Tensor:
    """``rows`` (addresses, element counts, offsets) as one contiguous int64 [len(rows), n]
    on ``device``, copied from pinned memory; the pinned source goes into ``keep``, alive as
    long as whoever captured the copy."""
    host = torch.tensor(rows, dtype=torch.int64).pin_memory()
    keep.append(host)
    return host.to(device, non_blocking=True)


def _offsets(tensors: list[Tensor]) -> list[int]:
    starts, total = [], 0
    for t in tensors:
        starts.append(total)
        total += t.numel()
    return starts


def _check_stacked(name: str, stacked: Tensor, tensors: list[Tensor]) -> None:
    total = sum(t.numel() for t in tensors)
    if not stacked.is_contiguous() or stacked.numel() != total:
        raise ValueError(f"{name}: a contiguous tensor of {total} elements, got "
                         f"{tuple(stacked.shape)}")


def _grid(tensors: list[Tensor]) -> tuple[int, int]:
    return triton.cdiv(max(t.numel() for t in tensors), BLOCK), len(tensors)


def muon_momentum_triton(bufs: list[Tensor], grads: list[Tensor], momentum: float,
                         nesterov: bool, out: Tensor | None = None,
                         keep: list[Tensor] | None = None,
                         grad_scale: Tensor | None = None) -> list[Tensor]:
    """As :func:`~megacpp.kernels.ops.muon.reference.muon_momentum_reference`, one launch
    (``grad_scale`` is read on the device, inside the launch)."""
    _check("momentum buffers", bufs)
    _check("gradients", grads)
    if grad_scale is not None:
        check_grad_scale(grad_scale, grads[0].device)
    if out is None:
        out = bufs[0].new_empty(sum(b.numel() for b in bufs))
    _check_stacked("out", out, bufs)
    starts = _offsets(bufs)
    table = _table([[b.data_ptr() for b in bufs], [g.data_ptr() for g in grads],
                    [b.numel() for b in bufs], starts], out.device,
                   [] if keep is None else keep)
    _momentum[_grid(bufs)](table, out, out if grad_scale is None else grad_scale,  # (unread)
                           len(bufs), momentum, NESTEROV=nesterov,
                           HAS_SCALE=grad_scale is not None, BLOCK=BLOCK, num_warps=NUM_WARPS)
    flat = out.view(-1)
    return [flat[s:s + b.numel()].view(b.shape) for s, b in zip(starts, bufs, strict=True)]


def muon_apply_triton(params: list[Tensor], ortho: Tensor, lr: float | Tensor,
                      weight_decay: float, scale: float,
                      keep: list[Tensor] | None = None) -> None:
    """As :func:`~megacpp.kernels.ops.muon.reference.muon_apply_reference`, one launch;
    ``ortho`` is the stacked Newton-Schulz result (any float dtype, contiguous)."""
    _check("parameters", params)
    _check_stacked("ortho", ortho, params)
    table = _table([[p.data_ptr() for p in params], [p.numel() for p in params],
                    _offsets(params)], ortho.device, [] if keep is None else keep)
    on_device = isinstance(lr, Tensor)
    _apply[_grid(params)](table, ortho, len(params), lr if on_device else ortho,  # not read
                          0.0 if on_device else float(lr), float(weight_decay), float(scale),
                          LR_ON_DEVICE=on_device, BLOCK=BLOCK, num_warps=NUM_WARPS)
