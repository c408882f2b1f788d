"""Fused RMSNorm (+ residual add) in Triton, forward and backward.

Forward: one program per block of rows (``configs.py``) reads x (and residual) once, writes y and
h = x + residual, and saves rstd [T] (float32). Backward recomputes h_hat from the saved h and rstd:

    dh = rstd * (dy*w - h_hat * mean(dy*w*h_hat)) + dh_out        (dh_out: grad of h output)
    dw = sum_rows dy * h_hat     (per-program float32 partials, summed by ops.sum_rows)

Saved for backward: h [T, D] (x.dtype), weight, rstd [T] float32. The residual's gradient
(dh) is stored by the backward kernel in the residual's dtype when that differs from x's.

y can be written in another dtype than x (``out_dtype``: bf16 for the matmuls behind a pre-norm
under autocast, while the float32 residual stream keeps its dtype). ``skip=True`` without a
residual returns h = x through the op as well: in a pre-norm block ``h + mixer(y)`` the skip
branch's gradient then reaches the backward kernel as dh_out and is summed into dx there,
instead of autograd adding two float32 [T, D] gradients in a kernel of its own.

``rope`` (a QK-norm of x [..., L, D]): the forward rotates y by the position's cos / sin before
storing it, the backward rotates dy back before the norm's gradient; each element's partner
(column i +- D/2) is a second load of the same row. Saved for backward with the tables.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from megacpp.kernels.device import cdiv, next_power_of_2, sm_count
from megacpp.kernels.launch import for_device
from megacpp.kernels.ops.rmsnorm.configs import CONFIGS, WIDE_COLUMNS, RMSNormConfig
from megacpp.kernels.ops.rmsnorm.reference import check_fanout, check_rope, copies
from megacpp.kernels.ops.sum_rows import sum_rows


@triton.jit
def _row_starts(rows, n_cols, n1, n2, s0, s1, s2, STRIDED: tl.constexpr):
    """Offsets of the first element of each row: ``rows * n_cols`` in a contiguous [T, D], or
    (STRIDED) rows r = (i0 * n1 + i1) * n2 + i2 of a [n0, n1, n2, D] view with strides
    (s0, s1, s2, 1) -- a head-transposed q, a k sliced out of a fused kv projection."""
    r = rows.to(tl.int64)
    if STRIDED:
        return (r // (n1 * n2)) * s0 + ((r // n2) % n1) * s1 + (r % n2) * s2
    return r * n_cols


@triton.jit
def _rope_cols(rows, cols, n_cols, seq_len, COS, SIN):
    """For RoPE's half-split pairs (i, i + D/2): each column's partner, its cos and its signed
    sin (-sin on the first half: out = y cos + sign * y_partner sin), from [L, D/2] tables at
    the row's position (rows are x's logical rows, so the position is ``row % L``)."""
    half = n_cols // 2
    first = cols < half
    partner = tl.where(first, cols + half, cols - half)  # [BLOCK]
    pair = tl.where(first, cols, cols - half)
    at = (rows % seq_len).to(tl.int64)[:, None] * half + pair[None, :]
    mask = (cols < n_cols)[None, :]
    cos = tl.load(COS + at, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(SIN + at, mask=mask, other=0.0).to(tl.float32)
    return partner, cos, tl.where(first[None, :], -sin, sin)


@triton.jit
def _rmsnorm_fwd(X, R, W, Y, H, RSTD, COS, SIN, n_rows, n_cols, eps, n1, n2, s0, s1, s2, seq_len,
                 HAS_RESIDUAL: tl.constexpr, STRIDED: tl.constexpr, ROPE: tl.constexpr,
                 ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """ROWS rows per program as one [ROWS, BLOCK] tile. X's rows where _row_starts says (a
    STRIDED X has no residual); R, H, Y are contiguous [T, D]. ROPE: y rotated by the
    [seq_len, D/2] tables COS / SIN (no residual), each element's partner read again (L1)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    cols = tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    starts = _row_starts(rows, n_cols, n1, n2, s0, s1, s2, STRIDED)[:, None]
    h = tl.load(X + starts + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(H + offs, h.to(H.dtype.element_ty), mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=1) / n_cols + eps)  # [ROWS]
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    y = h * rstd[:, None] * w[None, :]
    if ROPE:
        partner, cos, ssin = _rope_cols(rows, cols, n_cols, seq_len, COS, SIN)
        hp = tl.load(X + starts + partner[None, :], mask=mask, other=0.0).to(tl.float32)
        wp = tl.load(W + partner, mask=cols < n_cols, other=0.0).to(tl.float32)
        y = y * cos + hp * rstd[:, None] * wp[None, :] * ssin
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=rows < n_rows)


@triton.jit
def _rmsnorm_bwd(DY, DY2, DY3, DH_OUT, H, W, RSTD, DH, DR, DW_PARTIAL, COS, SIN, n_rows, n_cols,
                 n1, n2, s0, s1, s2, dn1, dn2, ds0, ds1, ds2, seq_len, ROWS: tl.constexpr,
                 FANOUT: tl.constexpr, HAS_DH_OUT: tl.constexpr, WRITE_DR: tl.constexpr,
                 STRIDED: tl.constexpr, DY_STRIDED: tl.constexpr, ROPE: tl.constexpr,
                 TILE: tl.constexpr, BLOCK: tl.constexpr):
    """Rows [pid * ROWS, (pid + 1) * ROWS) in [TILE, BLOCK] tiles; one float32 dw partial.
    FANOUT: y's second (and third) copy has its own gradient DY2 (DY3), added to DY here.
    WRITE_DR: also store dh in DR's dtype (the residual's gradient when it is narrower than
    h's, so autograd needs no cast kernel). STRIDED: H is the strided input x (_row_starts);
    the other tensors are contiguous [T, D] except (DY_STRIDED) DY, read where its own
    _row_starts say. ROPE: DY is the rotated y's gradient, rotated back first
    (the transpose of the forward's rotation)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    col_ok = cols < n_cols
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros((TILE, BLOCK), dtype=tl.float32)
    first = pid * ROWS
    for i in range(0, ROWS, TILE):
        rows = first + i + tl.arange(0, TILE)
        row_ok = (rows < n_rows) & (rows < first + ROWS)
        mask = row_ok[:, None] & col_ok[None, :]
        offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
        h_offs = _row_starts(rows, n_cols, n1, n2, s0, s1, s2, STRIDED)[:, None] + cols[None, :]
        h = tl.load(H + h_offs, mask=mask, other=0.0).to(tl.float32)
        dy_starts = _row_starts(rows, n_cols, dn1, dn2, ds0, ds1, ds2, DY_STRIDED)[:, None]
        dy = tl.load(DY + dy_starts + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if ROPE:  # d y = d out cos - sign * d out_partner sin
            partner, cos, ssin = _rope_cols(rows, cols, n_cols, seq_len, COS, SIN)
            dyp = tl.load(DY + dy_starts + partner[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = dy * cos - dyp * ssin
        if FANOUT >= 2:
            dy += tl.load(DY2 + offs, mask=mask, other=0.0).to(tl.float32)
        if FANOUT >= 3:
            dy += tl.load(DY3 + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)[:, None]
        h_hat = h * rstd
        dyw = dy * w[None, :]
        dh = rstd * (dyw - h_hat * (tl.sum(dyw * h_hat, axis=1) / n_cols)[:, None])
        if HAS_DH_OUT:
            dh += tl.load(DH_OUT + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(DH + offs, dh.to(DH.dtype.element_ty), mask=mask)
        if WRITE_DR:
            tl.store(DR + offs, dh.to(DR.dtype.element_ty), mask=mask)
        dw += dy * h_hat
    tl.store(DW_PARTIAL + pid * n_cols + cols, tl.sum(dw, axis=0), mask=col_ok)


def _block(n_cols: int) -> tuple[int, int]:
    block = next_power_of_2(n_cols)
    return block, min(max(block // 256, 1), 16)  # BLOCK, num_warps


def _tile_rows(rows: int, block: int) -> int:
    """Rows per tile, capped so one fp32 tile stays <= 8192 elements (registers)."""
    return max(1, min(rows, 8192 // block))


def _fwd_rows(block: int, config: RMSNormConfig) -> int:
    return _tile_rows(max(config.fwd_rows, config.narrow_fwd_elems // block), block)


def _bwd_launch(block: int, warps: int, config: RMSNormConfig) -> tuple[int, int, int]:
    """(rows per tile, programs per SM, num_warps) of the backward for BLOCK columns."""
    if block >= WIDE_COLUMNS:
        return _tile_rows(config.bwd_tile, block), config.bwd_programs_per_sm, warps
    tile = _tile_rows(max(config.bwd_tile, config.narrow_bwd_elems // block), block)
    return tile, config.narrow_bwd_programs_per_sm, max(1, min(16, tile * block // 512))


def _max_programs(device: torch.device, per_sm: int) -> int:
    """Backward grid: ``per_sm`` programs per SM (each sums its rows' dw partial)."""
    if device.type != "cuda":
        return 8  # the Triton interpreter (CPU) -- correctness runs only
    return per_sm * sm_count(device)


_CONTIGUOUS_ROWS = (1, 1, 0, 0, 0)  # _row_starts' (n1, n2, s0, s1, s2), unused when contiguous


def _strided_rows(x: Tensor) -> tuple[int, int, int, int, int] | None:
    """(n1, n2, s0, s1, s2) of x's rows seen as a [n0, n1, n2, D] view with strides
    (s0, s1, s2, 1), for :func:`_row_starts`; None unless x's last dim is unit-stride and its
    leading dims merge into at most three (then x is copied). A head-transposed q
    [B, H, L, hd] of a [B, L, H * hd] projection, or B / C sliced out of Mamba-3's in_proj
    output, are read in place: their copies took 0.8 ms of the nam56r-350m step on an
    H100."""
    if x.stride(-1) != 1:
        return None
    dims: list[tuple[int, int]] = []
    for n, st in zip(x.shape[:-1], x.stride()[:-1], strict=True):
        if n == 1:
            continue
        if dims and dims[-1][1] == n * st:  # the previous dim steps over this one whole
            dims[-1] = (dims[-1][0] * n, st)
        else:
            dims.append((n, st))
    if len(dims) > 3:
        return None
    (_, s0), (n1, s1), (n2, s2) = [(1, 0)] * (3 - len(dims)) + dims
    return n1, n2, s0, s1, s2


class _FusedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, residual: Tensor | None, eps: float,
                out_dtype: torch.dtype | None, skip: bool, fanout: int, cos: Tensor | None,
                sin: Tensor | None, config: RMSNormConfig):
        shape = x.shape
        n_cols = shape[-1]
        n_rows = x.numel() // n_cols if n_cols else 0
        has_residual = residual is not None
        # no residual, no skip: x's rows are read where they lie (no copy) when _strided_rows
        # can address them
        rows_at = None if has_residual or skip or x.is_contiguous() else _strided_rows(x)
        x2 = x if rows_at is not None else x.reshape(-1, n_cols).contiguous()  # [T, D]
        r2 = residual.reshape(-1, n_cols).contiguous() if has_residual else x2
        y = torch.empty(n_rows, n_cols, device=x.device, dtype=out_dtype or x.dtype)
        h = torch.empty_like(x2) if has_residual else x2  # no residual: h is x itself
        rstd = torch.empty(n_rows, device=x.device, dtype=torch.float32)
        rope = cos is not None
        cos, sin = (cos.contiguous(), sin.contiguous()) if rope else (rstd, rstd)
        seq_len = shape[-2] if rope else 1
        block, warps = _block(n_cols)
        rows = _fwd_rows(block, config)
        _rmsnorm_fwd[(cdiv(n_rows, rows),)](
            x2, r2, weight, y, h, rstd, cos, sin, n_rows, n_cols, eps,
            *(rows_at or _CONTIGUOUS_ROWS), seq_len, HAS_RESIDUAL=has_residual,
            STRIDED=rows_at is not None, ROPE=rope, ROWS=rows, BLOCK=block, num_warps=warps)
        ctx.save_for_backward(h, weight, rstd, cos, sin)
        ctx.rope, ctx.seq_len = rope, seq_len
        ctx.has_residual, ctx.shape, ctx.rows_at = has_residual, shape, rows_at
        ctx.residual_dtype = residual.dtype if has_residual else None
        ctx.fanout, ctx.config = fanout, config
        ys = copies(y.view(shape), fanout)  # fanout n: n tensors, n gradients
        # with skip and no residual, h is a view of x: its gradient comes back as dh_out
        return (*ys, h.view(shape)) if has_residual or skip else ys

    @staticmethod
    def backward(ctx, dy: Tensor, *grads: Tensor | None):
        h, weight, rstd, cos, sin = ctx.saved_tensors
        n_cols = h.shape[-1]
        n_rows = rstd.shape[0]
        # the other copies' gradients (fanout 2, 3), then h's (when it is an output)
        again = [g.reshape(n_rows, n_cols).contiguous() for g in grads[:ctx.fanout - 1]]
        dh_out = grads[ctx.fanout - 1] if len(grads) >= ctx.fanout else None
        # dy read where it lies when its rows can be addressed (SDPA's dq / dk come back in
        # their own layouts once no rotation kernel stands between it and this norm)
        dy_at = None if dy.is_contiguous() else _strided_rows(dy)
        dy2 = dy if dy_at is not None else dy.reshape(n_rows, n_cols).contiguous()
        dy_2, dy_3 = (again + [dy2, dy2])[:2]  # (unread past the fanout)
        has_dh_out = dh_out is not None
        dh_out2 = dh_out.reshape(n_rows, n_cols).contiguous() if has_dh_out else dy2
        # dx is contiguous even for a strided x: dx laid out as x (as a compiled caller's
        # backward may expect its tangent) made the nam56r-350m step 0.8-1.0 ms slower on an
        # H100
        dh = torch.empty(n_rows, n_cols, device=h.device, dtype=h.dtype)
        block, warps = _block(n_cols)
        tile, per_sm, warps = _bwd_launch(block, warps, ctx.config)
        n_programs = min(n_rows, _max_programs(h.device, per_sm))
        rows_per_program = cdiv(n_rows, n_programs)
        n_programs = cdiv(n_rows, rows_per_program)
        dw_partial = torch.empty(n_programs, n_cols, device=h.device, dtype=torch.float32)
        # a residual of another dtype (a bf16 mixer output added to the float32 stream) gets
        # its gradient written by the kernel in that dtype
        write_dr = ctx.has_residual and ctx.residual_dtype != h.dtype
        dr = torch.empty_like(h, dtype=ctx.residual_dtype) if write_dr else dh
        _rmsnorm_bwd[(n_programs,)](dy2, dy_2, dy_3, dh_out2, h, weight, rstd, dh, dr,
                                    dw_partial, cos, sin, n_rows, n_cols,
                                    *(ctx.rows_at or _CONTIGUOUS_ROWS),
                                    *(dy_at or _CONTIGUOUS_ROWS), ctx.seq_len,
                                    ROWS=rows_per_program, FANOUT=ctx.fanout,
                                    HAS_DH_OUT=has_dh_out, WRITE_DR=write_dr,
                                    STRIDED=ctx.rows_at is not None, DY_STRIDED=dy_at is not None,
                                    ROPE=ctx.rope, TILE=tile, BLOCK=block, num_warps=warps)
        dw = sum_rows(dw_partial).to(weight.dtype)
        dh = dh.view(ctx.shape)
        return (dh, dw, dr.view(ctx.shape) if ctx.has_residual else None, None, None, None,
                None, None, None, None)


def rmsnorm_triton(
    x: Tensor, weight: Tensor, residual: Tensor | None = None, eps: float = 1e-5,
    out_dtype: torch.dtype | None = None, skip: bool = False, fanout: int = 1,
    rope: tuple[Tensor, Tensor] | None = None, config: RMSNormConfig | None = None,
) -> tuple[Tensor, ...]:
    """Same contract as :func:`megacpp.kernels.ops.rmsnorm.reference.rmsnorm_reference`.
    Without a residual, h is x itself unless ``skip`` routes it through the op (its gradient
    is then added by the backward kernel: use it when h is the block's skip branch). With
    ``fanout=2`` or 3 the backward kernel reads every copy's gradient. ``rope``: both kernels
    rotate (the forward y, the backward its gradient) in registers. ``config``: the launch
    setting (default: ``configs.CONFIGS`` for x's device)."""
    check_fanout(fanout)
    check_rope(x, residual, fanout, rope)
    cos, sin = rope if rope is not None else (None, None)
    config = config or for_device(CONFIGS, x.device)
    if residual is None and not skip:
        return (*_FusedRMSNorm.apply(x, weight, None, eps, out_dtype, False, fanout, cos, sin,
                                     config), x)
    return _FusedRMSNorm.apply(x, weight, residual, eps, out_dtype, skip, fanout, cos, sin,
                               config)
