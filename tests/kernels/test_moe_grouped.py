"""The grouped-GEMM MoE expert path: dispatch plan, elementwise steps, forward and backward
against the per-expert-loop reference (CPU), its Triton kernels under the Triton interpreter
(CPU, float32, a fresh process; skipped without triton, as in CI) and on the GPU, and
sync-freedom (GPU)."""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType

import pytest
import torch
import torch.nn.functional as F

from megacpp.kernels.ops.moe_experts.grouped import (
    dispatch_plan,
    dispatch_plan_torch,
    gather_sum_torch,
    grouped_wgrad_torch,
    moe_experts_grouped,
    scatter_rows_torch,
    swiglu_weighted_backward_torch,
    swiglu_weighted_torch,
)
from megacpp.kernels.ops.moe_experts.reference import moe_experts_reference
from tests.kernels.interpreter import run_interpreter_check

ROOT = Path(__file__).resolve().parents[2]


def _inputs(tokens, dim, experts, k, ffn, dtype, device, seed, skip_experts=()):
    g = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=g, device=device)
    scores[:, list(skip_experts)] = -1.0  # these experts receive no token
    idx = scores.topk(k, dim=-1).indices
    w = torch.rand(tokens, k, generator=g, device=device) + 0.1
    x = torch.randn(tokens, dim, generator=g, device=device).to(dtype)
    w_in = (torch.randn(experts, 2 * ffn, dim, generator=g, device=device) * dim**-0.5).to(dtype)
    w_out = (torch.randn(experts, dim, ffn, generator=g, device=device) * ffn**-0.5).to(dtype)
    return x, idx, w, w_in, w_out


NAMES = ("out", "dx", "dw", "dw_in", "dw_out", "daddend")


def _grads(fn, x, idx, w, w_in, w_out, cot, addend=None):
    """out and the gradients of x, w, w_in, w_out (and the addend, when one is given: the
    shared experts' output, added in the combine)."""
    extra = () if addend is None else (addend,)
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, w_in, w_out, *extra)]
    out = fn(leaves[0], idx, *leaves[1:])
    return [out, *torch.autograd.grad((out.float() * cot).sum(), leaves)]


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def test_dispatch_plan_groups_by_expert_and_inverts():
    idx = torch.tensor([[2, 0], [1, 2], [2, 1], [0, 3]])
    w = torch.rand(4, 2, dtype=torch.float64)
    plan = dispatch_plan_torch(idx, 5, w)
    flat = idx.reshape(-1)
    assert plan.offs.tolist() == [2, 4, 7, 8, 8]  # expert 4 is empty
    assert plan.offs.dtype == torch.int32
    assert torch.equal(plan.order, flat.sort(stable=True).indices)
    assert torch.equal(plan.order[plan.inv.reshape(-1)], torch.arange(8))
    assert torch.equal(plan.w_sorted, w.reshape(-1)[plan.order])
    assert dispatch_plan_torch(idx, 5).w_sorted is None


def test_elementwise_steps_match_autograd():
    g = torch.Generator().manual_seed(1)
    gate_up = torch.randn(7, 10, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.rand(7, generator=g, dtype=torch.float64, requires_grad=True)
    dh = torch.randn(7, 5, generator=g, dtype=torch.float64)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up * w[:, None]
    torch.testing.assert_close(swiglu_weighted_torch(gate_up, w), expected)
    want_dgu, want_dw = torch.autograd.grad(expected, [gate_up, w], dh)
    order = torch.randperm(7, generator=g)  # sorted row -> (token, choice) slot
    dgu, dw = swiglu_weighted_backward_torch(gate_up.detach(), w.detach(), dh, order,
                                             torch.float64)
    torch.testing.assert_close(dgu, want_dgu)
    torch.testing.assert_close(dw[order], want_dw)
    src = torch.randn(6, 3, generator=g, dtype=torch.float64)
    inv = torch.tensor([[4, 0], [1, 5], [3, 2]])
    torch.testing.assert_close(gather_sum_torch(src, inv), src[inv].sum(1))


def _scatter_case(tokens, dim, experts, k, device, seed, skip=(), dtype=torch.float32):
    """Rows of a random [tokens, dim] source and a real plan of random expert ids (ragged
    groups; ``skip`` experts get none) -> src, inv and the expected permute src[order // k]
    (each sorted row holds its token's row)."""
    _, idx, _, _, _ = _inputs(tokens, 8, experts, k, 8, torch.float32, device, seed, skip)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    plan = dispatch_plan_torch(idx, experts)
    src = torch.randn(tokens, dim, generator=g, device=device).to(dtype)
    return src, plan.inv, src[plan.order // k]


def test_scatter_rows_puts_each_token_at_its_sorted_rows():
    src, inv, want = _scatter_case(53, 37, 8, 3, "cpu", 0, (1, 5))
    assert torch.equal(scatter_rows_torch(src, inv), want)  # every row compared


@pytest.mark.parametrize("skip", [(), (1, 5)])
def test_grouped_matches_reference_forward_and_backward_cpu(skip):
    x, idx, w, w_in, w_out = _inputs(53, 32, 8, 3, 24, torch.float32, "cpu", 2, skip)
    cot = torch.randn(53, 32, generator=torch.Generator().manual_seed(3))
    addend = torch.randn(53, 32, generator=torch.Generator().manual_seed(4)) if skip else None
    got = _grads(moe_experts_grouped, x, idx, w, w_in, w_out, cot, addend)
    ref = _grads(moe_experts_reference, x, idx, w, w_in, w_out, cot, addend)
    assert len(got) == (6 if skip else 5)
    for name, a, b in zip(NAMES, got, ref):
        assert _rel(a, b) < 1e-5, name
    for e in skip:  # experts without tokens get exactly zero weight gradients
        assert got[3][e].abs().max() == 0 and got[4][e].abs().max() == 0


def _wgrad_case(rows, m, n, counts, dtype, device, seed):
    """a [R, m], b [R, n], group ends for ``counts`` rows per expert (R = their sum), and
    the per-expert products a[rows_e]^T b[rows_e] in float64 [E, m, n]."""
    g = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn(rows, m, generator=g, device=device).to(dtype)
    b = torch.randn(rows, n, generator=g, device=device).to(dtype)
    ends = torch.tensor(counts, device=device).cumsum(0)
    assert int(ends[-1]) == rows
    starts = [0, *ends.tolist()[:-1]]
    want = torch.stack([a[s:e].double().T @ b[s:e].double()
                        for s, e in zip(starts, ends.tolist(), strict=True)])
    return a, b, ends.to(torch.int32), want


def test_grouped_wgrad_torch_matches_the_loop():
    a, b, offs, want = _wgrad_case(90, 16, 24, [10, 0, 55, 25], torch.float32, "cpu", 0)
    got = grouped_wgrad_torch(a, b, offs, torch.float64)
    assert got.dtype == torch.float64 and _rel(got, want) < 1e-6
    got_t = grouped_wgrad_torch(b, a, offs, torch.float32, transpose_out=True)  # [E, 16, 24]
    assert _rel(got_t, want) < 1e-6
    assert torch.equal(got[1], torch.zeros(16, 24, dtype=torch.float64))  # no rows: zeros


def test_grouped_refuses_weights_of_two_compute_dtypes():
    x, idx, w, w_in, w_out = _inputs(8, 16, 4, 2, 8, torch.float32, "cpu", 0)
    with pytest.raises(TypeError, match="w_in and w_out compute in"):
        moe_experts_grouped(x, idx, w, w_in, w_out.to(torch.bfloat16))


# -- CPU: the Triton kernels under the interpreter ----------------------------------------------
def _plan_cases():  # (tokens, experts, k, experts that get no token)
    return ((53, 8, 3, ()), (41, 5, 2, (1, 3)), (300, 256, 2, (0, 7, 255)), (20, 64, 8, ()))


def _interpreter_check() -> dict:
    """Run in a fresh process with TRITON_INTERPRET=1 (set before triton is first imported).
    Small blocks so that the plan spans several blocks and the scatter has ragged tails."""
    from megacpp.kernels.launch import DEFAULT
    from megacpp.kernels.ops.moe_experts import dispatch
    from megacpp.kernels.ops.moe_experts.configs import CONFIGS

    small = replace(CONFIGS[DEFAULT], plan_block=32, scatter_tokens=4, scatter_cols=16)
    result = {}
    for tokens, experts, k, skip in _plan_cases():  # the counting sort == the stable torch sort
        _, idx, w, _, _ = _inputs(tokens, 8, experts, k, 8, torch.float32, "cpu", tokens, skip)
        got = dispatch_plan(idx, experts, w, config=small)  # the Triton plan (interpreter)
        want = dispatch_plan_torch(idx, experts, w)
        for name, a, b in zip(got._fields, got, want):
            assert a.dtype == b.dtype and torch.equal(a, b), (tokens, experts, name)
        result[f"plan_t{tokens}_e{experts}"] = "exact"
    src, inv, want = _scatter_case(53, 37, 8, 3, "cpu", 0, (1, 5))  # 53 % 4, 37 % 16 tails
    assert torch.equal(dispatch.scatter_rows_triton(src, inv, config=small), want)
    for skip in ((), (1, 5)):  # forward and backward of the whole path vs the loop reference
        x, idx, w, w_in, w_out = _inputs(53, 32, 8, 3, 24, torch.float32, "cpu", 2, skip)
        cot = torch.randn(53, 32, generator=torch.Generator().manual_seed(3))
        # with skipped experts, an addend too (added by the gather-sum kernel)
        addend = torch.randn(53, 32, generator=torch.Generator().manual_seed(4)) if skip else None
        got = _grads(functools.partial(moe_experts_grouped, config=small), x, idx, w, w_in,
                     w_out, cot, addend)
        ref = _grads(moe_experts_reference, x, idx, w, w_in, w_out, cot, addend)
        assert len(got) == len(ref) == (6 if skip else 5)
        for name, a, b in zip(NAMES, got, ref):
            result[f"skip{len(skip)}/{name}"] = _rel(a, b)
            assert _rel(a, b) < 1e-5, (skip, name, _rel(a, b))
        for e in skip:
            assert got[3][e].abs().max() == 0 and got[4][e].abs().max() == 0
    small = _interpreter_wgrad(small, result)
    _interpreter_grouped_mm(small, result)
    return result


def _interpreter_wgrad(config, result: dict):
    """The wgrad kernel with small tiles (16 x 32 and 8 x 32, K blocks of 16): experts without
    rows, one shorter than a K block, ragged K tails, M and N tails, both output dtypes and
    layouts; then the whole float16 path (which takes it) against the float32 loop reference.
    float16: the interpreter's bf16 descriptor loads are wrong (wgrad_triton_ok keeps bf16 off
    the kernel here; the GPU test runs it in bf16). And the launch-setting choice. Returns
    ``config`` with the last small wgrad tile (the later paths run it)."""
    from megacpp.kernels.ops.moe_experts import gemm

    settings = config.wgrad
    big, small = settings
    assert gemm.wgrad_setting(272, 768, 16, 132, settings) is small  # 144 tiles of 128: 2 waves
    assert gemm.wgrad_setting(544, 768, 16, 132, settings) is big  # 240 vs 432 tiles: 2 vs 4
    assert gemm.wgrad_setting(1024, 1024, 64, 132, settings) is big  # a tie keeps the larger
    assert gemm.wgrad_setting(272, 768, 16, 1000, settings) is small  # one wave each: smaller
    counts = [0, 7, 48, 0, 37, 16]  # R = 108
    a, b, offs, want = _wgrad_case(108, 40, 24, counts, torch.float16, "cpu", 5)
    assert gemm.wgrad_triton_ok(a, b, config=config)
    assert not gemm.wgrad_triton_ok(a.bfloat16(), b.bfloat16(), config=config)
    assert not gemm.wgrad_triton_ok(a, b, config=replace(config, wgrad=()))  # torch's then
    for bm in (16, 8):
        config = replace(config, wgrad=(replace(big, block_m=bm, block_n=32, block_k=16),))
        for out_dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
            got = gemm.grouped_wgrad_triton(a, b, offs, out_dtype, config=config)
            got_t = gemm.grouped_wgrad_triton(b, a, offs, out_dtype, transpose_out=True,
                                              config=config)
            assert got.dtype == got_t.dtype == out_dtype
            assert got.shape == got_t.shape == want.shape
            for name, x in (("", got), ("_t", got_t)):
                err = _rel(x, want)
                result[f"wgrad_m{bm}_{str(out_dtype)[6:]}{name}"] = err
                assert err < tol, (bm, out_dtype, name, err)
                assert x[0].abs().max() == 0 and x[3].abs().max() == 0  # experts without rows
    got, calls = _fp16_path(gemm, "grouped_wgrad_triton", 4, config, 6, "fp16_path", result)
    assert sorted(calls) == [False, True]  # dw_in, and dw_out stored transposed
    assert got[3][2].abs().max() == 0 and got[4][2].abs().max() == 0
    return config


def _fp16_path(module, name, arg, config, seed, label, result):
    """The whole float16 MoE path (53 tokens, 8 experts top-3, expert 2 without rows) under
    ``config`` with ``module.<name>`` wrapped to record its calls (their positional argument
    ``arg``), against the float32 loop reference; the errors go to ``result[label/...]``.
    (got, calls)."""
    x, idx, w, w_in, w_out = _inputs(53, 32, 8, 3, 24, torch.float16, "cpu", seed, (2,))
    cot = torch.randn(53, 32, generator=torch.Generator().manual_seed(seed + 1))
    kernel, calls = getattr(module, name), []
    setattr(module, name, lambda *args, **kw: calls.append(args[arg]) or kernel(*args, **kw))
    try:
        got = _grads(functools.partial(moe_experts_grouped, config=config), x, idx, w, w_in,
                     w_out, cot)
    finally:
        setattr(module, name, kernel)
    ref = _grads(moe_experts_reference, x.float(), idx, w, w_in.float(), w_out.float(), cot)
    for part, a_, b_ in zip(NAMES, got, ref):
        result[f"{label}/{part}"] = _rel(a_, b_)
        assert _rel(a_, b_) < 3e-2, (label, part, _rel(a_, b_))
    return got, calls


def _grouped_mm_case(counts, k, n, trans_b, dtype, device, seed):
    """a [R, k], w [E, n, k] (trans_b) or [E, k, n], group ends, and the per-expert products
    a[rows_e] @ w[e] (w[e]^T) in float64 [R, n]."""
    g = torch.Generator(device=device).manual_seed(seed)
    rows, experts = sum(counts), len(counts)
    a = torch.randn(rows, k, generator=g, device=device).to(dtype)
    w = torch.randn(experts, *((n, k) if trans_b else (k, n)), generator=g, device=device)
    w = w.to(dtype)
    ends = torch.tensor(counts, device=device).cumsum(0)
    starts = [0, *ends.tolist()[:-1]]
    want = torch.cat([a[s:e].double() @ (w[i].double().T if trans_b else w[i].double())
                      for i, (s, e) in enumerate(zip(starts, ends.tolist(), strict=True))])
    return a, w, ends.to(torch.int32), want


def _with_shapes(config, field: str, tiles: dict):
    """``config`` with ``tiles`` ((N, K) -> Tile) added to its ``grouped`` or ``swiglu``."""
    return replace(config, **{field: MappingProxyType({**getattr(config, field), **tiles})})


def _interpreter_grouped_mm(config, result: dict) -> None:
    """The expert-GEMM kernel with small tiles (16 x 32, K blocks of 16) in float16 (see
    _interpreter_wgrad): experts without rows, one of a single row, row blocks that run into
    the next expert, ragged K (a block past the weights' K reads zeros, not the next expert's
    rows) and N tails, both layouts of W; which shapes it serves; then the whole float16 path
    with all four expert GEMMs on it."""
    from megacpp.kernels.ops.moe_experts import gemm
    from megacpp.kernels.ops.moe_experts.configs import Tile

    tile = Tile(block_m=16, block_n=32, block_k=16, num_warps=4, num_stages=2)
    counts = [0, 21, 1, 0, 40, 17]  # R = 79
    for k, n in ((40, 24), (24, 72)):
        for trans_b in (True, False):
            a, w, offs, want = _grouped_mm_case(counts, k, n, trans_b, torch.float16, "cpu", k)
            assert not gemm.grouped_mm_ok(a, w, trans_b, config=config)  # no setting for it
            served = _with_shapes(config, "grouped", {(n, k): tile})
            assert gemm.grouped_mm_ok(a, w, trans_b, config=served)
            assert not gemm.grouped_mm_ok(a.bfloat16(), w.bfloat16(), trans_b, config=served)
            got = gemm.grouped_mm_triton(a, w, offs, trans_b, config=served)
            err = _rel(got, want)
            result[f"grouped_mm_k{k}_n{n}_t{int(trans_b)}"] = err
            assert got.shape == want.shape and err < 2e-3, (k, n, trans_b, err)
    # the MoE's shapes at d 32, ffn 24: gate|up (48, 32), down (32, 24), d hidden (24, 32),
    # dx (32, 48), each (N, K)
    served = _with_shapes(config, "grouped", dict.fromkeys(
        [(48, 32), (32, 24), (24, 32), (32, 48)], tile))
    _, calls = _fp16_path(gemm, "grouped_mm_triton", 3, served, 8, "fp16_mm_path", result)
    assert sorted(calls) == [False, False, True, True]  # gate|up, down; d hidden, dx
    _interpreter_swiglu(config, tile, result)


def _interpreter_swiglu(config, tile, result: dict) -> None:
    """gate|up with the SwiGLU in the epilogue (16 hidden columns per program: F = 24 takes
    a ragged second tile): gate|up against float64, hidden against the SwiGLU of the stored
    gate|up; then the whole float16 path taking it."""
    from megacpp.kernels.ops.moe_experts import gemm

    counts = [0, 21, 1, 0, 40, 17]
    a, w, offs, want = _grouped_mm_case(counts, 40, 48, True, torch.float16, "cpu", 3)
    w_sorted = torch.rand(a.shape[0], generator=torch.Generator().manual_seed(5)) + 0.1
    assert not gemm.grouped_swiglu_ok(a, w, config=config)  # no setting for (48, 40)
    served = _with_shapes(config, "swiglu", {(48, 40): replace(tile, block_n=16)})
    assert gemm.grouped_swiglu_ok(a, w, config=served)
    gate_up, hidden = gemm.grouped_swiglu_triton(a, w, offs, w_sorted, config=served)
    result["swiglu_gate_up"] = _rel(gate_up, want)
    result["swiglu_hidden"] = _rel(hidden, swiglu_weighted_torch(gate_up, w_sorted))
    assert gate_up.shape == want.shape and result["swiglu_gate_up"] < 2e-3, result
    assert hidden.shape == (79, 24) and result["swiglu_hidden"] < 1e-3, result
    served = _with_shapes(config, "grouped", dict.fromkeys([(32, 24), (24, 32), (32, 48)], tile))
    served = _with_shapes(served, "swiglu", {(48, 32): replace(tile, block_n=16)})
    _, calls = _fp16_path(gemm, "grouped_swiglu_triton", 3, served, 8, "fp16_swiglu_path",
                          result)
    assert len(calls) == 1  # gate|up with the SwiGLU, once


def test_interpreter_kernels_match_reference() -> None:
    run_interpreter_check(__file__, "_interpreter_check")


# -- GPU ------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_moe_plan_triton_matches_torch_sort():
    for tokens, experts, k, skip in (*_plan_cases(), (16384, 64, 8, (5,)), (5000, 256, 4, ())):
        _, idx, w, _, _ = _inputs(tokens, 8, experts, k, 8, torch.float32, "cuda", 1, skip)
        got = dispatch_plan(idx, experts, w)
        want = dispatch_plan_torch(idx, experts, w)
        for name, a, b in zip(got._fields, got, want):
            assert torch.equal(a, b.to(a.dtype)), (tokens, experts, name)


@pytest.mark.gpu
def test_moe_triton_kernels_match_torch_steps():
    from megacpp.kernels.ops.moe_experts import dispatch, swiglu

    g = torch.Generator("cuda").manual_seed(0)
    for ffn in (96, 1000):  # one F block / several, with a ragged tail
        gate_up = torch.randn(301, 2 * ffn, generator=g, device="cuda").bfloat16()
        w = torch.rand(301, generator=g, device="cuda")
        dh = torch.randn(301, ffn, generator=g, device="cuda").bfloat16()
        order = torch.randperm(301, generator=g, device="cuda")
        assert _rel(swiglu.swiglu_weighted_triton(gate_up, w),
                    swiglu_weighted_torch(gate_up, w)) < 1e-2
        dgu, dw = swiglu.swiglu_weighted_backward_triton(gate_up, w, dh, order, torch.float32)
        want_dgu, want_dw = swiglu_weighted_backward_torch(gate_up, w, dh, order, torch.float32)
        assert _rel(dgu, want_dgu) < 1e-2 and _rel(dw, want_dw) < 1e-5
    src = torch.randn(600, 3000, generator=g, device="cuda").bfloat16()
    inv = torch.randperm(600, generator=g, device="cuda").view(200, 3)
    assert _rel(dispatch.gather_sum_triton(src, inv), gather_sum_torch(src, inv)) < 1e-2
    add = torch.randn(200, 3000, generator=g, device="cuda").bfloat16()
    assert _rel(dispatch.gather_sum_triton(src, inv, add),
                gather_sum_torch(src, inv, add)) < 1e-2
    for tokens, cols, k in ((1003, 1000, 8), (700, 3000, 2), (16, 1024, 3)):
        # the row scatter is a copy: exact, ragged token and column tails included
        src, inv, want = _scatter_case(tokens, cols, 64, k, "cuda", cols, (5,), torch.bfloat16)
        assert torch.equal(scatter_rows_torch(src, inv), want)
        poison = torch.full_like(want, float("nan"))
        del poison  # the caching allocator hands this block to the scatter's output
        assert torch.equal(dispatch.scatter_rows_triton(src, inv), want)  # every row written


@pytest.mark.gpu
def test_grouped_wgrad_triton_against_float64():
    """The step's shapes (d 768, ffn 272, 16 experts) with an expert without rows and one
    shorter than a K block; every element checked (the output's memory held NaN before)."""
    from megacpp.kernels.ops.moe_experts import gemm

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the wgrad kernel's tensor-memory loads need sm90+")
    counts = [700, 0, 3, 1500, *([300] * 12), 797]
    rows = sum(counts)
    # dw_in [E, 2F, D] as the MoE asks it; dw_out [E, D, F] = (hidden^T dy)^T, F on the M side
    for m, n, transpose_out in ((544, 768, False), (272, 768, True)):
        a, b, offs, want = _wgrad_case(rows, m, n, counts, torch.bfloat16, "cuda", m)
        if transpose_out:
            want = want.transpose(1, 2)
        for out_dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 8e-3)):
            poison = torch.full(want.shape, float("nan"), device="cuda", dtype=out_dtype)
            del poison  # the caching allocator hands this block to the kernel's output
            got = gemm.grouped_wgrad_triton(a, b, offs, out_dtype, transpose_out)
            assert got.shape == want.shape and got.dtype == out_dtype
            assert not got.isnan().any()
            assert _rel(got, want) < tol, (m, transpose_out, out_dtype, _rel(got, want))
            assert got[1].abs().max() == 0


@pytest.mark.gpu
def test_grouped_mm_triton_against_float64():
    """The expert GEMMs at the step's shapes it serves (gate|up: N 544, K 768, W^T; d hidden:
    N 272, K 768) and at every other shape of the step with the same launch setting, and
    gate|up with the SwiGLU in its epilogue at every shape the config serves; an expert
    without rows and one of a single row; every element of the output checked (its memory held
    NaN before)."""
    from megacpp.kernels.launch import for_device
    from megacpp.kernels.ops.moe_experts import gemm, swiglu
    from megacpp.kernels.ops.moe_experts.configs import CONFIGS

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the kernel's tensor-memory loads need sm90+")
    shipped = for_device(CONFIGS, torch.device("cuda"))
    counts = [700, 0, 1, 1500, *([2000] * 12), 797]
    for k, n, trans_b in ((768, 544, True), (768, 272, False), (272, 768, True),
                          (544, 768, False)):
        a, w, offs, want = _grouped_mm_case(counts, k, n, trans_b, torch.bfloat16, "cuda", n)
        # the shipped setting, at an unshipped shape too
        config = _with_shapes(shipped, "grouped", {(n, k): shipped.grouped[(544, 768)]}
                              if (n, k) not in shipped.grouped else {})
        assert gemm.grouped_mm_ok(a, w, trans_b, config=config)
        poison = torch.full(want.shape, float("nan"), device="cuda", dtype=torch.bfloat16)
        del poison  # the caching allocator hands this block to the kernel's output
        got = gemm.grouped_mm_triton(a, w, offs, trans_b, config=config)
        assert got.shape == want.shape and not got.isnan().any()
        assert _rel(got, want) < 8e-3, (k, n, trans_b, _rel(got, want))
    # gate|up with the SwiGLU in the epilogue at every shape it serves (the step's, the
    # bench's e64_k8 and e16_k2): gate|up against float64, hidden against the separate SwiGLU
    # kernel on the stored gate|up
    for two_f, d in shipped.swiglu:
        a, w, offs, want = _grouped_mm_case(counts[:8], d, two_f, True, torch.bfloat16, "cuda",
                                            two_f)
        assert gemm.grouped_swiglu_ok(a, w)
        w_sorted = torch.rand(a.shape[0], device="cuda") + 0.1
        poison = [torch.full((a.shape[0], n), float("nan"), device="cuda", dtype=torch.bfloat16)
                  for n in (two_f, two_f // 2)]
        del poison  # the caching allocator hands these blocks to gate|up and hidden
        gate_up, hidden = gemm.grouped_swiglu_triton(a, w, offs, w_sorted)
        assert not gate_up.isnan().any() and not hidden.isnan().any()
        assert _rel(gate_up, want) < 8e-3, (two_f, d, _rel(gate_up, want))
        assert torch.equal(hidden, swiglu.swiglu_weighted_triton(gate_up, w_sorted)), (two_f, d)


@pytest.mark.gpu
@pytest.mark.parametrize("grouped_triton", [False, True])
@pytest.mark.parametrize("wgrad_triton", [False, True])
@pytest.mark.parametrize("skip", [(), (0, 3, 7)])
def test_grouped_cuda_matches_reference_without_host_sync(skip, wgrad_triton, grouped_triton,
                                                          monkeypatch):
    """The whole path, with the weight gradients from torch._grouped_mm or (wgrad_triton) the
    Triton kernel, and (grouped_triton) all four expert GEMMs on the Triton kernel (gate|up with
    the SwiGLU in its epilogue); and under autocast with float32 weights, whose gradients come
    back float32."""
    from megacpp.kernels.launch import for_device
    from megacpp.kernels.ops.moe_experts import gemm
    from megacpp.kernels.ops.moe_experts.configs import CONFIGS

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch._grouped_mm needs sm90+")
    shipped = for_device(CONFIGS, torch.device("cuda"))
    # d 256, ffn 192: gate|up (384, 256), down (256, 192), d hidden (192, 256), dx (256, 384)
    shapes = [(384, 256), (256, 192), (192, 256), (256, 384)]
    config = replace(
        shipped, wgrad=shipped.wgrad if wgrad_triton else (),
        grouped=MappingProxyType(dict.fromkeys(shapes if grouped_triton else [],
                                               shipped.grouped[(544, 768)])),
        swiglu=MappingProxyType(dict.fromkeys(  # gate|up's epilogue SwiGLU
            shapes[:1] if grouped_triton else [], shipped.swiglu[(544, 768)])))
    moe = functools.partial(moe_experts_grouped, config=config)
    calls = []
    kernel = gemm.grouped_wgrad_triton
    monkeypatch.setattr(gemm, "grouped_wgrad_triton",
                        lambda *args, **kw: calls.append(args[4]) or kernel(*args, **kw))
    x, idx, w, w_in, w_out = _inputs(1000, 256, 16, 4, 192, torch.bfloat16, "cuda", 4, skip)
    cot = torch.randn(1000, 256, device="cuda")
    ref = _grads(moe_experts_reference, x, idx, w, w_in, w_out, cot)
    _grads(moe, x, idx, w, w_in, w_out, cot)  # warm up (Triton compiles)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = _grads(moe, x, idx, w, w_in, w_out, cot)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for name, a, b in zip(("out", "dx", "dw", "dw_in", "dw_out"), got, ref):
        assert _rel(a, b) < 1e-2, name
    for e in skip:
        assert got[3][e].abs().max() == 0 and got[4][e].abs().max() == 0
    assert len(calls) == (4 if wgrad_triton else 0)  # dw_in and dw_out, warm-up and run
    masters = [t.float() for t in (x, w_in, w_out)]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = _grads(moe, masters[0], idx, w, *masters[1:], cot)
    assert got[3].dtype == got[4].dtype == torch.float32
    for name, a, b in zip(("out", "dx", "dw", "dw_in", "dw_out"), got, ref):
        assert _rel(a, b) < 1e-2, ("autocast", name)
