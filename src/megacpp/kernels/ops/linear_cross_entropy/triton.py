"""Fused linear cross-entropy: the [T, V] logits are never materialised, every sum is float32,
and the float32 weight gradient never coexists with its full-size cast copy.

Tokens are processed in chunks of ``chunk_tokens`` rows. Per chunk:

1. ``logits = h_c @ W^T`` (cuBLAS, float32 accumulation, stored in the operand dtype) [C, V]
2. :func:`_ce_rows`: per row, online max / sum-exp over V in float32 -> lse and the loss; a
   second sweep writes ``(softmax - onehot) / n_kept`` over the logits in place [C, V]
3. ``dh_c = G @ W`` (cuBLAS) [C, D]
4. ``dW += G^T @ h_c`` in float32, one of two ways (``strategy``):

   * ``"addmm"`` (default on CUDA): cuBLAS ``addmm(..., out_dtype=float32)`` into a float32
     accumulator held as two row halves [V/2, D] (float32 accumulation inside the GEMM, the
     accumulator read and written once per chunk by the GEMM's epilogue). Backward scales and
     rounds the first half into a temporary, frees it, then writes the [V, D] result: the
     float32 halves and a full cast copy never coexist (peak = 1.25 x the float32 dW).
   * ``"planes"``: a Triton GEMM whose epilogue adds the tile to a float32 accumulator kept as
     two 16-bit planes [V, D]: ``hi`` (the top half of each float32's bits -- exactly a
     bfloat16) and ``lo`` (the bottom half); backward rounds ``grad_output * (hi, lo)`` into
     ``hi`` in place. Same 4 bytes per element, no cast copy at all, but its GEMM runs slower
     than cuBLAS (kept for the probe and for reference).

The loss sums in float32. Gradients are computed in the forward (the loss is a scalar, so
backward only scales them by ``grad_output``, in place). Peak extra memory: dh [T, D] + the
float32 dW (V x D x 4 bytes) + one chunk of logits (C x V operand-dtype elements).
Under ``no_grad`` (or when neither input needs a gradient) only the loss is computed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from megacpp.errors import MegaCppError
from megacpp.kernels.amp import autocast_operands
from megacpp.kernels.device import cdiv, next_power_of_2, sm_count
from megacpp.kernels.ops.linear_cross_entropy.reference import IGNORE_INDEX

DEFAULT_CHUNK_BYTES = 128 * 2**20  # one chunk of logits at most this big (H100 sweep: notes)
DEFAULT_STRATEGY = "addmm"  # the dW accumulation (see the module docstring)
STRATEGIES = ("addmm", "planes")
LOG2E = tl.constexpr(1.4426950408889634)
# dW tile config; "tma" (tensor-descriptor tiles, 151 registers, no spills) where the strides
# allow it, else the pointer kernel (it spills in the epilogue: a fallback for odd shapes)
DW_CONFIG = {"BM": 128, "BN": 128, "BK": 64, "num_warps": 8, "num_stages": 3, "tma": True}
# the CE row kernel: block width (columns per load), warps, persistent programs per SM (a
# row's second sweep finds it still in L2), per-lane running max / sum in sweep 1. H100 sweep
# of 112 settings on a [1024, 65536] bf16 chunk (h100_s13): 118.6 us with these, against
# 159.5 us with the former 4096 / 16 warps / 2 per SM / a reduction per block
CE_CONFIG = {"BLOCK": 4096, "num_warps": 32, "programs_per_sm": 1, "lanes": True}


@triton.jit
def _ce_rows(LOGITS, LABELS, LOSS, INV_N, n_rows, stride, ignore_index, n_cols: tl.constexpr,
             BLOCK: tl.constexpr, WRITE_GRAD: tl.constexpr, LANES: tl.constexpr):
    """Rows pid, pid + grid, ...: loss row (float32) and, if WRITE_GRAD, the gradient of the
    mean loss written over the logits. LANES: sweep 1 keeps a running max and sum per lane
    ([BLOCK] vectors, reduced once per row) instead of reducing every block across the warps."""
    cols = tl.arange(0, BLOCK)
    for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        base = LOGITS + tl.cast(row, tl.int64) * stride
        label = tl.load(LABELS + row)
        # sweep 1: running max and sum of exp (float32, base 2)
        if LANES:
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
        else:
            m = -float("inf")
            s = 0.0
            for start in range(0, n_cols, BLOCK):
                v = tl.load(base + start + cols, mask=start + cols < n_cols, other=-float("inf"))
                v = v.to(tl.float32) * LOG2E
                m_new = tl.maximum(m, tl.max(v, axis=0))
                s = s * tl.exp2(m - m_new) + tl.sum(tl.exp2(v - m_new), axis=0)
                m = m_new
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
def _dw_accumulate(G, H, HI, LO, n_tok, n_vocab, hidden, stride_g, stride_h,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """(hi, lo) planes [V, D] += G^T [V, C] @ H [C, D], exactly in float32."""
    pid = tl.program_id(0)
    n_blocks_n = tl.cdiv(hidden, BN)
    rm = (pid // n_blocks_n) * BM + tl.arange(0, BM)  # vocab rows
    rn = (pid % n_blocks_n) * BN + tl.arange(0, BN)  # hidden columns
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, n_tok, BK):
        tok = k0 + rk
        g = tl.load(G + tok[:, None].to(tl.int64) * stride_g + rm[None, :],
                    mask=(tok[:, None] < n_tok) & (rm[None, :] < n_vocab), other=0.0)  # [BK, BM]
        h = tl.load(H + tok[:, None].to(tl.int64) * stride_h + rn[None, :],
                    mask=(tok[:, None] < n_tok) & (rn[None, :] < hidden), other=0.0)  # [BK, BN]
        acc = tl.dot(tl.trans(g), h, acc)
    offs = rm[:, None].to(tl.int64) * hidden + rn[None, :]
    mask = (rm[:, None] < n_vocab) & (rn[None, :] < hidden)
    hi = tl.load(HI + offs, mask=mask, other=0).to(tl.int32)
    lo = tl.load(LO + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
    total = ((hi << 16) | lo).to(tl.float32, bitcast=True) + acc
    bits = total.to(tl.int32, bitcast=True)
    tl.store(HI + offs, (bits >> 16).to(tl.int16), mask=mask)
    tl.store(LO + offs, bits.to(tl.int16), mask=mask)


@triton.jit
def _dw_accumulate_tma(g_desc, h_desc, hi_desc, lo_desc, n_tok,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """:func:`_dw_accumulate` with tensor-descriptor (TMA) tiles: no pointer or mask tensors
    in registers (the pointer version spills in its epilogue)."""
    pid = tl.program_id(0)
    n_blocks_n = tl.cdiv(hi_desc.shape[1], BN)
    m0 = (pid // n_blocks_n) * BM
    n0 = (pid % n_blocks_n) * BN
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, n_tok, BK):
        g = g_desc.load([k0, m0])  # [BK, BM]
        h = h_desc.load([k0, n0])  # [BK, BN]
        acc = tl.dot(tl.trans(g), h, acc)
    bits = (hi_desc.load([m0, n0]).to(tl.int32) << 16) | (lo_desc.load([m0, n0]).to(tl.int32)
                                                          & 0xFFFF)
    bits = (bits.to(tl.float32, bitcast=True) + acc).to(tl.int32, bitcast=True)
    hi_desc.store([m0, n0], (bits >> 16).to(tl.int16))
    lo_desc.store([m0, n0], bits.to(tl.int16))


@triton.jit
def _dw_finish(HI, LO, OUT, SCALE, n, BLOCK: tl.constexpr):
    """OUT <- round(scale * float32(hi, lo)); OUT may alias HI (each element is read, then
    written, by the same thread)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    hi = tl.load(HI + offs, mask=mask, other=0).to(tl.int32)
    lo = tl.load(LO + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
    value = ((hi << 16) | lo).to(tl.float32, bitcast=True) * tl.load(SCALE)
    tl.store(OUT + offs, value.to(OUT.dtype.element_ty), mask=mask)


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


def _ce_programs(n_rows: int, device: torch.device, programs: int | None) -> int:
    if programs is not None:
        return max(1, min(n_rows, programs))
    if device.type != "cuda":
        return n_rows
    return max(1, min(n_rows, CE_CONFIG["programs_per_sm"] * sm_count(device)))


def accumulate_weight_grad(hi: Tensor, lo: Tensor, grad_logits: Tensor, h_chunk: Tensor,
                           config: dict | None = None) -> None:
    """(hi, lo) float32 planes [V, D] += grad_logits^T [V, C] @ h_chunk [C, D]."""
    cfg = {**DW_CONFIG, **(config or {})}
    (n_tok, vocab), hidden = grad_logits.shape, h_chunk.shape[1]
    grid = (cdiv(vocab, cfg["BM"]) * cdiv(hidden, cfg["BN"]),)
    launch = {"BM": cfg["BM"], "BN": cfg["BN"], "BK": cfg["BK"], "num_warps": cfg["num_warps"],
              "num_stages": cfg["num_stages"]}
    if cfg.get("maxnreg"):
        launch["maxnreg"] = cfg["maxnreg"]
    if cfg.get("tma") and _tma_ok(grad_logits, h_chunk, hi, lo):
        from triton.tools.tensor_descriptor import TensorDescriptor

        descs = [TensorDescriptor.from_tensor(grad_logits, [cfg["BK"], cfg["BM"]]),
                 TensorDescriptor.from_tensor(h_chunk, [cfg["BK"], cfg["BN"]]),
                 TensorDescriptor.from_tensor(hi, [cfg["BM"], cfg["BN"]]),
                 TensorDescriptor.from_tensor(lo, [cfg["BM"], cfg["BN"]])]
        _dw_accumulate_tma[grid](*descs, n_tok, **launch)
        return
    _dw_accumulate[grid](grad_logits, h_chunk, hi, lo, n_tok, vocab, hidden,
                         grad_logits.stride(0), h_chunk.stride(0), **launch)


def _tma_ok(*tensors: Tensor) -> bool:
    """Tensor descriptors need 16-byte aligned bases and row strides (and a CUDA device)."""
    return all(t.is_cuda and t.data_ptr() % 16 == 0 and t.stride(-1) == 1
               and (t.stride(0) * t.element_size()) % 16 == 0 for t in tensors)


def finish_weight_grad(hi: Tensor, lo: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """round(scale * float32(hi, lo)) into hi's own storage, returned as a ``dtype`` tensor."""
    out = hi.view(dtype)
    block = 4096
    _dw_finish[(cdiv(hi.numel(), block),)](hi, lo, out, scale, hi.numel(), BLOCK=block)
    return out


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
             need_dh: bool, need_dw: bool, dw_config: dict | None = None,
             ce_programs: int | None = None, strategy: str = DEFAULT_STRATEGY,
             ) -> tuple[Tensor, Tensor | None, tuple | list | None]:
    """loss (float32 scalar), dh [T, D] (h.dtype) and the dW accumulator of the mean loss
    (``strategy`` "addmm": float32 halves; "planes": the (hi, lo) planes; None if not needed)."""
    if strategy not in STRATEGIES:
        raise MegaCppError(f"fused linear cross-entropy: unknown dW strategy {strategy!r}; "
                           f"known: {STRATEGIES}")
    n_tokens, vocab = h.shape[0], weight.shape[0]
    n_kept = (labels != ignore_index).sum()
    inv_n = 1.0 / n_kept.clamp(min=1).to(torch.float32)  # stays on device: no host sync
    losses = torch.empty(n_tokens, device=h.device, dtype=torch.float32)
    need_grad = need_dh or need_dw
    dh = torch.empty_like(h) if need_dh else None
    acc = None
    if need_dw and strategy == "addmm":
        acc = _fp32_halves(weight)
    elif need_dw:
        acc = tuple(torch.zeros(weight.shape, device=h.device, dtype=torch.int16)
                    for _ in range(2))
    block = min(next_power_of_2(vocab), CE_CONFIG["BLOCK"])
    for start in range(0, n_tokens, chunk_tokens):
        rows = slice(start, min(start + chunk_tokens, n_tokens))
        h_chunk = h[rows]  # [C, D]
        logits = h_chunk @ weight.t()  # [C, V], becomes the gradient in place
        n_rows = logits.shape[0]
        _ce_rows[(_ce_programs(n_rows, h.device, ce_programs),)](
            logits, labels[rows], losses[rows], inv_n, n_rows, logits.stride(0), ignore_index,
            n_cols=vocab, BLOCK=block, WRITE_GRAD=need_grad, LANES=CE_CONFIG["lanes"],
            num_warps=max(1, min(CE_CONFIG["num_warps"], block // 32)))  # >= 1 column a thread
        if need_dh:
            torch.mm(logits, weight, out=dh[rows])
        if need_dw and strategy == "addmm":
            accumulate_weight_grad_fp32(acc, logits, h_chunk)
        elif need_dw:
            accumulate_weight_grad(*acc, logits, h_chunk, dw_config)
        del logits
    return losses.sum() * inv_n, dh, acc


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, labels: Tensor, ignore_index: int,
                chunk_tokens: int, need_dh: bool, need_dw: bool, strategy: str) -> Tensor:
        loss, dh, acc = _forward(h, weight, labels, ignore_index, chunk_tokens, need_dh,
                                 need_dw, strategy=strategy)
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
        dw = None
        if isinstance(acc, list):
            dw = finish_weight_grad_fp32(acc, scale, ctx.weight_dtype)
        elif acc is not None:
            dw = finish_weight_grad(*acc, scale, ctx.weight_dtype)
        return dh, dw, None, None, None, None, None, None


def default_chunk_tokens(vocab: int, element_size: int) -> int:
    """Rows whose logits fit DEFAULT_CHUNK_BYTES (a multiple of 64, at least 64)."""
    return max(64, DEFAULT_CHUNK_BYTES // (vocab * element_size) // 64 * 64)


def linear_cross_entropy_triton(
    h: Tensor, weight: Tensor, labels: Tensor, ignore_index: int = IGNORE_INDEX,
    chunk_tokens: int | None = None, strategy: str = DEFAULT_STRATEGY,
) -> Tensor:
    """Same contract as the reference: h [T, D], weight [V, D], labels [T] -> mean loss
    (float32 scalar). ``chunk_tokens`` defaults to the rows whose logits fit 128 MiB;
    ``strategy`` picks the float32 dW accumulation ("addmm" or "planes", module docstring).
    Under autocast, float32 h / weight run in the autocast dtype (as the reference's
    ``h @ W.T`` does)."""
    h, weight = autocast_operands(h, weight)
    if h.dtype != weight.dtype or h.dtype not in (torch.bfloat16, torch.float16):
        raise MegaCppError(f"fused linear cross-entropy needs bf16/fp16 h and weight of one "
                           f"dtype, got {h.dtype} and {weight.dtype}")
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(weight.shape[0], h.element_size())
    grad = torch.is_grad_enabled()
    return _FusedLinearCrossEntropy.apply(
        h.contiguous(), weight.contiguous(), labels.contiguous(), ignore_index, chunk_tokens,
        grad and h.requires_grad, grad and weight.requires_grad, strategy)
