"""Autocast and the catalog: a float32 tensor under autocast selects (and runs) in the
autocast dtype -- the trainer's bf16-autocast path must not fail closed on float32 activations."""

from __future__ import annotations

import torch

from megacpp.kernels.amp import autocast_operands, effective_dtype
from megacpp.kernels.ops.moe_experts.grouped import moe_experts_grouped
from megacpp.kernels.ops.moe_experts.reference import moe_experts_reference
from megacpp.kernels.runtime import clear_resolutions, kernel_mode_override, resolutions, resolve


def test_effective_dtype_follows_autocast_for_float32_only():
    x32, x64 = torch.ones(2), torch.ones(2, dtype=torch.float64)
    assert effective_dtype(x32) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert effective_dtype(x32) == torch.bfloat16
        assert effective_dtype(x64) == torch.float64  # autocast never touches float64
        assert effective_dtype(x32.bfloat16()) == torch.bfloat16
    assert effective_dtype(x32) == torch.float32


def test_resolve_selects_for_the_autocast_dtype():
    clear_resolutions()
    x = torch.ones(4, 8)
    with kernel_mode_override("auto"), torch.autocast("cpu", dtype=torch.bfloat16):
        resolve("moe_experts", x)
    with kernel_mode_override("auto"):
        resolve("moe_experts", x)
    assert sorted(s.dtype for s in resolutions()) == ["bfloat16", "float32"]
    clear_resolutions()


def test_autocast_operands_cast_and_backprop_to_float32_leaves():
    a = torch.randn(3, 4, requires_grad=True)
    b = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    assert autocast_operands(a, b) == (a, b)  # autocast off: untouched
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a16, b64 = autocast_operands(a, b)
    assert (a16.dtype, b64.dtype) == (torch.bfloat16, torch.float64)
    (a16.float().sum() + b64.sum()).backward()
    assert a.grad.dtype == torch.float32 and torch.equal(a.grad, torch.ones_like(a))


def test_grouped_moe_under_autocast_matches_the_reference_under_autocast():
    g = torch.Generator().manual_seed(0)
    tokens, dim, experts, k, ffn = 96, 32, 8, 2, 48
    idx = torch.rand(tokens, experts, generator=g).topk(k, dim=-1).indices
    w = torch.rand(tokens, k, generator=g) + 0.1
    x = torch.randn(tokens, dim, generator=g)
    w_in = torch.randn(experts, 2 * ffn, dim, generator=g) * dim**-0.5
    w_out = torch.randn(experts, dim, ffn, generator=g) * ffn**-0.5
    results = []
    for fn in (moe_experts_grouped, moe_experts_reference):
        leaves = [t.clone().requires_grad_() for t in (x, w_in, w_out)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(leaves[0], idx, w, leaves[1], leaves[2])
        grads = torch.autograd.grad(out.float().sum(), leaves)
        assert all(t.dtype == torch.float32 for t in grads)  # grads land on the fp32 leaves
        results.append([out.detach().float(), *grads])
    for ours, ref in zip(*results, strict=True):
        err = float((ours.double() - ref.double()).norm() / ref.double().norm())
        assert err < 2e-2, err
