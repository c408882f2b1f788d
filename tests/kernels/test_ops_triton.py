"""GPU: our fast backends against the float64 reference, forward and backward, fresh inputs.
CPU: the RMSNorm kernels under the Triton interpreter."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from megacpp.kernels.check import check_backend
from megacpp.kernels.registry import default_catalog
from tests.kernels.interpreter import run_interpreter_check

ROOT = Path(__file__).resolve().parents[2]
gpu = pytest.mark.gpu

CASES = [
    ("rmsnorm", "triton_fused", "float32"),
    ("rmsnorm", "triton_fused", "bfloat16"),
    ("linear_cross_entropy", "triton_chunked", "bfloat16"),
    ("moe_experts", "grouped_mm", "bfloat16"),
    ("attention", "sdpa_flash", "bfloat16"),
]


@gpu
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(("surface", "backend", "dtype"), CASES)
def test_backend_matches_reference(surface: str, backend: str, dtype: str, seed: int) -> None:
    catalog = default_catalog()
    result = check_backend(catalog.surface(surface), catalog.backend(surface, backend),
                           torch.device("cuda"), dtype, seed)
    print(surface, backend, dtype, result.errors)
    assert result.passed, result.errors


@gpu
@pytest.mark.parametrize("part", ["q", "k"])
def test_rmsnorm_rope_bf16_views_against_float64(part: str) -> None:
    """The attention's QK-norm at the nam56r-350m shape: bf16 q / k read in place from the
    projections (a head-transposed view, a slice of the kv projection), RoPE in both kernels,
    y in bf16, against the reference in float64."""
    from megacpp.kernels.ops.rmsnorm.reference import rmsnorm_reference
    from megacpp.kernels.ops.rmsnorm.triton import rmsnorm_triton
    from megacpp.model.rope import rope_range

    gen = torch.Generator("cuda").manual_seed(7)
    batch, seq, dim = 4, 2048, 64
    base = torch.randn(batch, seq, 16 * dim, device="cuda", generator=gen).bfloat16()
    view = {"q": lambda t: t[..., :12 * dim].view(batch, seq, 12, dim).transpose(1, 2),
            "k": lambda t: t[..., 12 * dim:].view(batch, seq, 2, 2, dim).unbind(2)[0]
            .transpose(1, 2)}[part]
    w = 1 + 0.1 * torch.randn(dim, device="cuda", generator=gen)
    cos, sin = rope_range(0, seq, dim, 10000.0, torch.float32, torch.device("cuda"))
    # a cotangent bf16 can hold: y's bf16 gradient is then exact, and dw's error is its sums'
    cot = torch.randn(view(base).shape, device="cuda", generator=gen).bfloat16().double()
    got = []
    # (bf16 x, float32 weight and tables, as in the model under autocast) vs float64
    for fn, dtype, wide in ((rmsnorm_triton, torch.bfloat16, torch.float32),
                            (rmsnorm_reference, torch.float64, torch.float64)):
        leaves = [base.to(dtype).requires_grad_(), w.to(wide).requires_grad_()]
        x = view(leaves[0])
        y, _ = fn(x, leaves[1], out_dtype=dtype, rope=(cos.to(wide), sin.to(wide)))
        (dx,) = torch.autograd.grad((y.double() * cot).sum(), x, retain_graph=True)
        got.append([y, dx, *torch.autograd.grad((y.double() * cot).sum(), leaves)])
    for name, a, b in zip(("y", "dx", "dbase", "dw"), *got):
        err = ((a.double() - b).norm() / b.norm()).item()
        print(part, name, err)
        assert err < (1e-2 if a.dtype == torch.bfloat16 else 1e-4), (name, err)


@gpu
def test_rmsnorm_bf16_residual_into_float32_stream() -> None:
    """The pre-norm block's fused add: float32 stream x, bf16 mixer output as the residual, y
    in bf16. The kernel writes the residual's gradient in bf16 itself: it must be exactly x's
    float32 gradient rounded (round to nearest), and both close to the reference's."""
    from megacpp.kernels.ops.rmsnorm.reference import rmsnorm_reference
    from megacpp.kernels.ops.rmsnorm.triton import rmsnorm_triton

    gen = torch.Generator("cuda").manual_seed(5)
    x = torch.randn(4096, 768, device="cuda", generator=gen)
    r = torch.randn(4096, 768, device="cuda", generator=gen).bfloat16()
    w = 1 + 0.1 * torch.randn(768, device="cuda", generator=gen)
    cot = [torch.randn(4096, 768, device="cuda", generator=gen) for _ in range(2)]
    got = []
    for fn in (rmsnorm_triton, rmsnorm_reference):
        leaves = [t.clone().requires_grad_() for t in (x, w, r)]
        y, h = fn(leaves[0], leaves[1], leaves[2], 1e-5, torch.bfloat16, True)
        loss = (y.float() * cot[0]).sum() + (h * cot[1]).sum()
        got.append(torch.autograd.grad(loss, leaves))
    (dx, dw, dr), (rdx, rdw, rdr) = got
    assert dr.dtype == torch.bfloat16 and torch.equal(dr, dx.to(torch.bfloat16))
    for a, b, tol in ((dx, rdx, 1e-5), (dw, rdw, 1e-5), (dr, rdr, 1e-2)):
        assert ((a.double() - b.double()).norm() / b.double().norm()).item() < tol


@gpu
def test_linear_ce_dw_against_fp32_at_lm_head_scale() -> None:
    """A vocab that needs several chunks and several column blocks per row; dW vs fp32."""
    from megacpp.kernels.ops.linear_cross_entropy.reference import linear_cross_entropy_reference
    from megacpp.kernels.ops.linear_cross_entropy.triton import linear_cross_entropy_triton

    gen = torch.Generator("cuda").manual_seed(3)
    h = torch.randn(4096, 512, device="cuda", generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(20000, 512, device="cuda", generator=gen) / 512**0.5).bfloat16()
    w.requires_grad_()
    labels = torch.randint(0, 20000, (4096,), device="cuda", generator=gen)
    labels[::7] = -100
    loss = linear_cross_entropy_triton(h, w, labels, chunk_tokens=1000)
    dh, dw = torch.autograd.grad(loss, [h, w])
    h32, w32 = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = linear_cross_entropy_reference(h32, w32, labels)
    rdh, rdw = torch.autograd.grad(ref, [h32, w32])
    assert abs(loss.item() - ref.item()) / ref.item() < 1e-4
    for got, want in ((dh, rdh), (dw, rdw)):
        assert ((got.float() - want).norm() / want.norm()).item() < 1e-2


@gpu
def test_model_auto_mode_matches_reference_mode() -> None:
    """The wired model: MEGACPP_KERNELS=auto on a GPU gives the reference's loss and grads."""
    from megacpp.kernels.runtime import chosen_kernels, kernel_mode_override
    from megacpp.model.config import ModelConfig
    from megacpp.model.model import HybridLM, next_token_labels

    cfg = ModelConfig.from_dict({"model": {"pattern": "AE", "vocab_size": 4096, "d_model": 256},
                                 "attention": {"n_heads": 4, "n_kv_heads": 4, "head_dim": 64}})
    torch.manual_seed(0)
    model = HybridLM(cfg).cuda().bfloat16()
    ids = torch.randint(0, 4096, (2, 128), device="cuda")
    labels = next_token_labels(ids)
    results = {}
    for mode in ("reference", "auto"):
        with kernel_mode_override(mode):
            loss = model(ids, labels=labels).loss
            grads = torch.autograd.grad(loss, [model.embed.weight, model.norm.weight])
        results[mode] = (loss.float(), [g.float() for g in grads])
    assert chosen_kernels()["linear_cross_entropy"] == "triton_chunked"
    (ref_loss, ref_grads), (loss, grads) = results["reference"], results["auto"]
    assert abs(loss - ref_loss) / ref_loss < 1e-2
    for g, r in zip(grads, ref_grads):
        assert ((g - r).norm() / r.norm()).item() < 5e-2


# -- CPU: the RMSNorm kernels under the Triton interpreter -----------------------------------
def _rmsnorm_interpreter_check() -> dict:
    """Forward and backward (x, weight, residual) vs the reference in float32: row counts
    that leave partial forward / backward tiles, a width that is not a power of two, with a
    residual, without, and without one but with h routed through the op (``skip``: h's
    gradient summed into dx by the backward kernel), y in x's dtype and in bfloat16, narrow
    rows (the multi-row tiles of QK-norm widths). Run in a fresh process with
    TRITON_INTERPRET=1."""
    from megacpp.kernels.ops.rmsnorm.reference import rmsnorm_reference
    from megacpp.kernels.ops.rmsnorm.triton import _strided_rows, rmsnorm_triton

    g = torch.Generator().manual_seed(0)
    errors, tolerance = {}, {}
    cases = ((67, 384, "residual", None), (5, 100, "none", None), (9, 1000, "residual", None),
             (13, 384, "skip", None), (7, 100, "skip", torch.bfloat16),
             (11, 384, "residual", torch.bfloat16), (21, 384, "residual_bf16", torch.bfloat16),
             (600, 64, "none", None))  # narrow rows: 32-row backward tiles, a ragged last one
    for tokens, dim, mode, out_dtype in cases:
        x = torch.randn(tokens, dim, generator=g)
        r = torch.randn(tokens, dim, generator=g) if mode.startswith("residual") else None
        if mode == "residual_bf16":  # a bf16 mixer output into the float32 stream
            r = r.bfloat16()
        w = 1 + 0.1 * torch.randn(dim, generator=g)
        cot = [torch.randn(tokens, dim, generator=g) for _ in range(2)]
        got = []
        for fn in (rmsnorm_triton, rmsnorm_reference):
            leaves = [t.clone().requires_grad_() for t in (x, w) + ((r,) if r is not None else ())]
            y, h = fn(leaves[0], leaves[1], leaves[2] if r is not None else None,
                      out_dtype=out_dtype, skip=mode == "skip")
            assert y.dtype == (out_dtype or x.dtype) and h.dtype == x.dtype, (y.dtype, h.dtype)
            loss = (y.float() * cot[0]).sum() + ((h * cot[1]).sum() if mode != "none" else 0)
            got.append([y.float(), h, *torch.autograd.grad(loss, leaves)])
        for name, a, b in zip(("y", "h", "dx", "dw", "dres"), *got):
            key = f"{tokens}x{dim}/{mode}/{name}"
            assert a.dtype == b.dtype, (key, a.dtype, b.dtype)
            errors[key] = float((a.double() - b.double()).norm() / b.double().norm())
            # a bf16 y or residual gradient is rounded once (2^-8 relative); the rest is fp32
            rounded = (out_dtype is not None and name == "y") or a.dtype == torch.bfloat16
            tolerance[key] = 1e-2 if rounded else 1e-5
    # fanout 2 and 3 (the pre-norms of attention / the MoE and of Mamba-3): y two or three
    # times, each copy with its own gradient, summed by the backward kernel; with a bf16
    # residual and h as the skip branch, and with neither
    for fanout, mode in itertools.product((2, 3), ("residual", "none")):
        x = torch.randn(45, 384, generator=g)
        r = torch.randn(45, 384, generator=g).bfloat16() if mode == "residual" else None
        w = 1 + 0.1 * torch.randn(384, generator=g)
        cot = [torch.randn(45, 384, generator=g) for _ in range(fanout + 1)]
        got = []
        for fn in (rmsnorm_triton, rmsnorm_reference):
            leaves = [t.clone().requires_grad_() for t in (x, w) + ((r,) if r is not None else ())]
            *ys, h = fn(leaves[0], leaves[1], leaves[2] if r is not None else None,
                        skip=True, fanout=fanout)
            assert len(ys) == fanout and len({id(t) for t in ys}) == fanout
            assert all(torch.equal(ys[0], t) for t in ys)
            loss = sum((t.float() * c).sum() for t, c in zip((*ys, h), cot, strict=True))
            got.append(torch.autograd.grad(loss, leaves))
        for name, a, b in zip(("dx", "dw", "dres"), *got):
            key = f"fanout{fanout}_{mode}/{name}"
            errors[key] = float((a.double() - b.double()).norm() / b.double().norm())
            tolerance[key] = 1e-2 if a.dtype == torch.bfloat16 else 1e-5
    # rows read in place from strided views (no residual): a head-transposed q, a k sliced out
    # of a fused kv projection, B sliced out of a wider projection (one row stride), and a
    # view whose dims do not merge into three (copied first); y / dx come back contiguous
    base = torch.randn(2, 5, 3 * 4 * 64, generator=g)
    views = {"q": lambda t: t[..., :192].view(2, 5, 3, 64).transpose(1, 2),
             "k": lambda t: t[..., 192:448].view(2, 5, 2, 2, 64).unbind(2)[0].transpose(1, 2),
             "b": lambda t: t[..., 64:128].unflatten(-1, (1, 64)),
             "copied": lambda t: t.view(2, 5, 3, 4, 64).permute(3, 1, 0, 2, 4)}
    for name, view in views.items():
        assert (_strided_rows(view(base)) is None) == (name == "copied"), name
        w = 1 + 0.1 * torch.randn(64, generator=g)
        got = []
        for fn in (rmsnorm_triton, rmsnorm_reference):
            leaves = [base.clone().requires_grad_(), w.clone().requires_grad_()]
            x = view(leaves[0])
            y, _ = fn(x, leaves[1])
            assert y.shape == x.shape and y.is_contiguous()
            cot = torch.linspace(-1, 1, y.numel()).view(y.shape)
            got.append([y.detach(), *torch.autograd.grad((y * cot).sum(), leaves)])
        for part, a, b in zip(("y", "dx", "dw"), *got):
            key = f"strided_{name}/{part}"
            errors[key] = float((a.double() - b.double()).norm() / b.double().norm())
            tolerance[key] = 1e-5
    # rope (QK-norm): rotated in both kernels; x in place (q, k views), contiguous, a width
    # that is not a power of two (partner columns under the tile's mask), bf16 y; q's dy
    # arrives head-transposed (as SDPA's dq may), read in place
    for name, dim, out_dtype in (("q", 64, None), ("k", 64, torch.bfloat16),
                                 ("contiguous", 40, None)):
        base = torch.randn(2, 5, 3 * 4 * dim, generator=g)
        view = {"q": lambda t, d=dim: t[..., :3 * d].view(2, 5, 3, d).transpose(1, 2),
                "k": lambda t, d=dim: t[..., 3 * d:7 * d].view(2, 5, 2, 2, d).unbind(2)[0]
                .transpose(1, 2),
                "contiguous": lambda t, d=dim: t.view(2, 5, 12, d)}[name]
        angles = torch.rand(view(base).shape[-2], dim // 2, generator=g) * 6.3
        rope = (angles.cos(), angles.sin())
        w = 1 + 0.1 * torch.randn(dim, generator=g)
        got = []
        for fn in (rmsnorm_triton, rmsnorm_reference):
            leaves = [base.clone().requires_grad_(), w.clone().requires_grad_()]
            y, _ = fn(view(leaves[0]), leaves[1], out_dtype=out_dtype, rope=rope)
            cot = torch.linspace(-1, 1, y.numel()).view(y.shape)
            out = y.float()
            if name == "q":  # y's gradient: a transposed view of a contiguous [2, 5, 3, dim]
                out, cot = out.transpose(1, 2).contiguous(), cot.transpose(1, 2).contiguous()
            got.append([y.float(), *torch.autograd.grad((out * cot).sum(), leaves)])
        for part, a, b in zip(("y", "dx", "dw"), *got):
            key = f"rope_{name}/{part}"
            errors[key] = float((a.double() - b.double()).norm() / b.double().norm())
            tolerance[key] = 1e-2 if out_dtype is not None and part == "y" else 1e-5
    assert all(errors[k] < tolerance[k] for k in errors), errors  # NaN fails
    return errors


def test_rmsnorm_interpreter_matches_reference() -> None:
    run_interpreter_check(__file__, "_rmsnorm_interpreter_check")
