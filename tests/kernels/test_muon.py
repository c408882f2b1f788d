"""Muon's kernels (``ops/muon_momentum``, ``ops/muon_apply``, ``ops/muon_polynomial``): the
foreach references against the formulas, the fused Triton passes against the references on
fresh random inputs (GPU), captured in a CUDA graph and replayed, and the catalog rows.
Newton-Schulz's polynomial: the reference against the float64 formula; the symmetric Triton
kernel against it (GPU), and Newton-Schulz with it, eager and replayed. Newton-Schulz's last
product in the input's orientation equals the transposed form."""

from __future__ import annotations

import pytest
import torch

from megacpp.kernels.catalog import KernelSelectionError
from megacpp.kernels.ops.muon_apply.reference import muon_apply_reference
from megacpp.kernels.ops.muon_momentum.reference import muon_momentum_reference
from megacpp.kernels.ops.muon_polynomial.reference import muon_polynomial_reference
from megacpp.kernels.registry import default_catalog
from megacpp.kernels.runtime import kernel_mode_override, resolve
from megacpp.train.optim import NS_COEFFS, newton_schulz

gpu = pytest.mark.gpu
# 2-D and 3-D matrices of one [rows, cols], sizes around the fused kernels' 4096-element block
SHAPES = [(24, 40), (3, 24, 40), (24, 40), (5, 24, 40), (1, 24, 40)]


def _tensors(shapes, device, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=gen) * scale).to(device) for s in shapes]


def test_momentum_reference_is_the_formula_and_stacks_in_order():
    bufs, grads = _tensors(SHAPES, "cpu", 0), _tensors(SHAPES, "cpu", 1)
    old = [b.clone() for b in bufs]
    matrices = sum(b.numel() for b in bufs) // (24 * 40)
    for nesterov in (True, False):
        bufs = [b.clone() for b in old]
        out = torch.empty(matrices, 24, 40, dtype=torch.float64)
        updates = muon_momentum_reference(bufs, grads, 0.9, nesterov, out)
        start = 0
        for b0, b, g, u in zip(old, bufs, grads, updates, strict=True):
            torch.testing.assert_close(b, 0.9 * b0 + g, rtol=1e-6, atol=1e-6)
            want = g + 0.9 * b if nesterov else b
            torch.testing.assert_close(u, want.double(), rtol=1e-6, atol=1e-6)
            n = b.numel() // (24 * 40)
            assert u.data_ptr() == out[start].data_ptr() and u.shape == b.shape  # views of out
            start += n


def test_momentum_reference_grad_scale_is_the_scaled_gradient_and_leaves_it():
    """grad_scale (the clipping coefficient) acts as gradients multiplied by it first, bit for
    bit, and the gradients are not rewritten; a scale of another shape, dtype or device, or a
    Python float, is refused before any buffer moves."""
    bufs, grads = _tensors(SHAPES, "cpu", 4), _tensors(SHAPES, "cpu", 5)
    ref_bufs, kept = [b.clone() for b in bufs], [g.clone() for g in grads]
    scale = torch.tensor(0.37)
    got = muon_momentum_reference(bufs, grads, 0.9, True, grad_scale=scale)
    want = muon_momentum_reference(ref_bufs, [g * scale for g in grads], 0.9, True)
    for a, b in zip(got + bufs, want + ref_bufs, strict=True):
        assert torch.equal(a, b)
    for g, k in zip(grads, kept, strict=True):
        assert torch.equal(g, k)
    before = [b.clone() for b in bufs]
    for bad in (torch.tensor([0.5, 0.5]), torch.tensor(0.5, dtype=torch.float64), 0.5):
        with pytest.raises(ValueError, match="grad_scale"):
            muon_momentum_reference(bufs, grads, 0.9, True, grad_scale=bad)
    for b, k in zip(bufs, before, strict=True):
        assert torch.equal(b, k)


@pytest.mark.parametrize("lr_on_device", [False, True])
def test_apply_reference_is_decay_then_the_scaled_step(lr_on_device):
    params, ortho_parts = _tensors(SHAPES, "cpu", 2), _tensors(SHAPES, "cpu", 3)
    ortho = torch.cat([o.reshape(-1, 24, 40) for o in ortho_parts])
    want = [p * (1 - 0.01 * 0.1) - 1.5 * 0.01 * o for p, o in zip(params, ortho_parts, strict=True)]
    lr = torch.tensor(0.01) if lr_on_device else 0.01
    muon_apply_reference(params, ortho, lr, 0.1, 1.5)
    for p, w in zip(params, want, strict=True):
        torch.testing.assert_close(p, w, rtol=1e-6, atol=1e-7)


def test_newton_schulz_of_a_tall_matrix_comes_out_contiguous_and_equal():
    """A tall stack iterates on its wide transpose; the last product is formed in the input's
    orientation (X^T P) and equals the transposed (P X)^T, contiguous."""
    from megacpp.train.optim import NS_COEFFS

    x = torch.randn(4, 40, 24, dtype=torch.float64)
    got = newton_schulz(x, 5, torch.float64)
    assert got.shape == x.shape and got.is_contiguous()
    a, b, c = NS_COEFFS
    y = x.mT / (x.mT.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(5):
        gram = y @ y.mT
        y = (a * torch.eye(24, dtype=torch.float64) + b * gram + c * gram @ gram) @ y
    torch.testing.assert_close(got, y.mT, rtol=1e-10, atol=1e-12)


def _symmetric(batch, m, dtype, device, seed, norm=1.0):
    """Gram matrices of random wide X of Frobenius norm ``norm`` (1: normalized, as
    Newton-Schulz's later steps have them), made exactly symmetric, in ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, m, m + 24, generator=gen, dtype=torch.float64)
    x = x / x.norm(dim=(-2, -1), keepdim=True) * norm
    gram = x @ x.mT
    return ((gram + gram.mT) / 2).to(device=device, dtype=dtype)


def _formula(gram, normalize_eps=None):
    """a I + b A + c A A in float64; with ``normalize_eps``, s p(s^2 A) for s = 1 / (sqrt(tr
    A) + eps)."""
    a, b, c = NS_COEFFS
    g = gram.double()
    s = torch.ones(g.shape[:-2] + (1, 1), dtype=torch.float64, device=g.device)
    if normalize_eps is not None:
        s = 1 / (g.diagonal(dim1=-2, dim2=-1).sum(-1).sqrt() + normalize_eps)[..., None, None]
    g = g * s * s
    eye = torch.eye(g.shape[-1], dtype=torch.float64, device=g.device)
    return s * (a * eye + b * g + c * g @ g)


def test_polynomial_reference_is_the_formula():
    for shape in ((3, 20, 20), (2, 3, 20, 20), (1, 1, 1)):
        gram = _symmetric(1, shape[-1], torch.float64, "cpu", 1).expand(shape).contiguous()
        got = muon_polynomial_reference(gram, *NS_COEFFS)
        assert got.shape == gram.shape
        torch.testing.assert_close(got, _formula(gram), rtol=1e-12, atol=1e-14)


def test_normalizing_polynomial_times_x_is_the_normalized_first_step():
    """With ``normalize_eps`` and A = X X^T of an unnormalized X, P X is the first
    Newton-Schulz step of X / (||X||_F + eps), the two matrices of a batch each by its own
    norm; a zero matrix stays zero."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 12, 30, generator=gen, dtype=torch.float64) * torch.tensor(
        [3e-3, 1.0, 0.0], dtype=torch.float64)[:, None, None]
    got = muon_polynomial_reference(x @ x.mT, *NS_COEFFS, normalize_eps=1e-7) @ x
    a, b, c = NS_COEFFS
    y = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    gram = y @ y.mT
    want = a * y + (b * gram + c * gram @ gram) @ y
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13)
    assert not got[2].any()


def test_catalog_rows_and_fail_closed_selection_on_cpu():
    catalog = default_catalog()
    rows = {"muon_momentum": "triton_multi_tensor", "muon_apply": "triton_multi_tensor",
            "muon_polynomial": "triton_symmetric"}
    for surface, chosen in rows.items():
        roles = {b.name: b.role for b in catalog.of(surface)}
        assert roles == {chosen: "chosen", "reference": "fallback"}
        like = torch.zeros(2, 2)
        with kernel_mode_override("auto"):
            assert resolve(surface, like).name == "reference"
        with kernel_mode_override("fast"), pytest.raises(KernelSelectionError, match=chosen):
            resolve(surface, like)


def test_polynomial_catalog_inputs_and_forward_only_check_and_timing():
    """muon_polynomial has no autograd: its bench inputs are symmetric Gram matrices (of an
    X normalized to ||X||_F = 1 unless the case asks the surface to normalize), ``kernels
    check`` compares outputs only and fails a wrong backend, the timing runs the forward."""
    from megacpp.kernels.catalog import Backend, Catalog, Requirements
    from megacpp.kernels.check import check_backend
    from megacpp.kernels.timing import time_fwd_bwd

    surface = default_catalog().surface("muon_polynomial")
    assert surface.grad_args == ()
    gen = torch.Generator().manual_seed(0)
    case = dict(surface.cases["check"], normalize=0)
    inputs = surface.make_inputs(case, torch.float32, "cpu", gen)
    gram = inputs["gram"]
    assert gram.shape == (3, 136, 136) and torch.equal(gram, gram.mT)
    assert inputs["normalize_eps"] is None
    torch.testing.assert_close(gram.diagonal(dim1=-2, dim2=-1).sum(-1), torch.ones(3))
    raw = surface.make_inputs(surface.cases["check"], torch.float32, "cpu", gen)
    assert raw["normalize_eps"] == 1e-7 and raw["gram"].diagonal(dim1=-2, dim2=-1).sum() > 1e3

    def off_by_a_bit(**kw):
        return muon_polynomial_reference(**kw) * 1.001

    for fn, ok in ((muon_polynomial_reference, True), (off_by_a_bit, False)):
        catalog = Catalog()
        catalog.add_surface(surface)
        backend = Backend("candidate", "muon_polynomial", "chosen",
                          Requirements(devices=("cpu",)), fn)
        catalog.add(backend)
        result = check_backend(surface, backend, torch.device("cpu"), "float32", 1)
        assert set(result.errors) == {"out"} and result.passed is ok, result.errors
    timing = time_fwd_bwd(surface.reference, inputs, surface.grad_args, torch.device("cpu"),
                          warmup=1, repeats=2)
    assert timing.median_ms > 0


# -- GPU: the fused passes -------------------------------------------------------------------------
def _cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch.device("cuda")


# sizes that leave ragged last blocks, one tensor of several blocks, and a lone small one
GPU_SHAPES = [(96, 130), (3, 96, 130), (96, 130), (7, 96, 130), (1, 96, 130)]


@gpu
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scaled", [False, True])
def test_fused_momentum_matches_the_reference(nesterov, out_dtype, scaled):
    from megacpp.kernels.ops.muon_momentum.triton import muon_momentum_triton

    cuda = _cuda()
    for seed in range(3):  # fresh inputs each round
        bufs, grads = _tensors(GPU_SHAPES, cuda, 10 + seed), _tensors(GPU_SHAPES, cuda, 20 + seed)
        ref_bufs, kept = [b.clone() for b in bufs], [g.clone() for g in grads]
        scale = torch.rand((), device=cuda) if scaled else None  # a clipping coefficient
        matrices = sum(b.numel() for b in bufs) // (96 * 130)
        out = torch.full((matrices, 96, 130), float("nan"), device=cuda, dtype=out_dtype)
        ref_out = torch.empty_like(out)
        muon_momentum_triton(bufs, grads, 0.95, nesterov, out, grad_scale=scale)
        muon_momentum_reference(ref_bufs, grads, 0.95, nesterov, ref_out, grad_scale=scale)
        for g, k in zip(grads, kept, strict=True):
            assert torch.equal(g, k)  # read, not rewritten
        for b, r in zip(bufs, ref_bufs, strict=True):
            torch.testing.assert_close(b, r, rtol=1e-6, atol=1e-6)  # float32: FMA rounding
        assert not out.isnan().any()  # every element written
        tol = {"rtol": 1e-6, "atol": 1e-6} if out_dtype == torch.float32 else \
            {"rtol": 8e-3, "atol": 1e-5}  # one bf16 rounding either side of a tie
        torch.testing.assert_close(out, ref_out, **tol)


@gpu
@pytest.mark.parametrize("lr_on_device", [False, True])
@pytest.mark.parametrize("ortho_dtype", [torch.bfloat16, torch.float32])
def test_fused_apply_matches_the_reference(lr_on_device, ortho_dtype):
    from megacpp.kernels.ops.muon_apply.triton import muon_apply_triton

    cuda = _cuda()
    for seed in range(3):
        params = _tensors(GPU_SHAPES, cuda, 30 + seed)
        ref = [p.clone() for p in params]
        matrices = sum(p.numel() for p in params) // (96 * 130)
        gen = torch.Generator().manual_seed(40 + seed)
        ortho = torch.randn(matrices, 96, 130, generator=gen).to(cuda, ortho_dtype)
        lr = torch.tensor(0.02, device=cuda) if lr_on_device else 0.02
        muon_apply_triton(params, ortho, lr, 0.1, 2.5)
        muon_apply_reference(ref, ortho, lr, 0.1, 2.5)
        for p, r in zip(params, ref, strict=True):
            torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-6)


@gpu
def test_fused_passes_captured_in_a_cuda_graph_replay_as_eager_steps():
    """Momentum then apply, captured once (address tables copied inside the capture) and
    replayed with new gradients and lrs written into the captured tensors, equals the
    reference stepped eagerly with the same values."""
    from megacpp.kernels.ops.muon_apply.triton import muon_apply_triton
    from megacpp.kernels.ops.muon_momentum.triton import muon_momentum_triton

    cuda = _cuda()
    params, grads = _tensors(GPU_SHAPES, cuda, 50), _tensors(GPU_SHAPES, cuda, 51)
    bufs = [torch.zeros_like(p) for p in params]
    ref_params, ref_bufs = [p.clone() for p in params], [b.clone() for b in bufs]
    matrices = sum(p.numel() for p in params) // (96 * 130)
    stacked = torch.empty(matrices, 96, 130, device=cuda)
    lr = torch.tensor(0.01, device=cuda)
    keep: list[torch.Tensor] = []

    def step():
        muon_momentum_triton(bufs, grads, 0.9, True, stacked, keep)
        muon_apply_triton(params, stacked, lr, 0.1, 1.5, keep)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up: compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    ref_stacked = torch.empty_like(stacked)
    muon_momentum_reference(ref_bufs, grads, 0.9, True, ref_stacked)
    muon_apply_reference(ref_params, ref_stacked, 0.01, 0.1, 1.5)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for i, value in enumerate((0.03, 0.005)):
        new = _tensors(GPU_SHAPES, cuda, 60 + i)
        for g, n in zip(grads, new, strict=True):
            g.copy_(n)
        lr.fill_(value)
        graph.replay()
        muon_momentum_reference(ref_bufs, grads, 0.9, True, ref_stacked)
        muon_apply_reference(ref_params, ref_stacked, value, 0.1, 1.5)
    torch.cuda.synchronize()
    for p, r in zip(params, ref_params, strict=True):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
    for b, r in zip(bufs, ref_bufs, strict=True):
        torch.testing.assert_close(b, r, rtol=1e-5, atol=1e-6)


@gpu
def test_fused_passes_refuse_what_they_cannot_take():
    from megacpp.kernels.ops.muon_apply.triton import muon_apply_triton
    from megacpp.kernels.ops.muon_momentum.triton import muon_momentum_triton

    cuda = _cuda()
    half = [torch.zeros(4, 4, device=cuda, dtype=torch.bfloat16)]
    with pytest.raises(ValueError, match="contiguous float32 CUDA"):
        muon_momentum_triton(half, half, 0.9, True)
    with pytest.raises(ValueError, match="not contiguous"):
        muon_apply_triton([torch.zeros(4, 4, device=cuda).t()], torch.zeros(16, device=cuda),
                          0.1, 0.0, 1.0)
    with pytest.raises(ValueError, match="16 elements"):
        muon_apply_triton([torch.zeros(4, 4, device=cuda)], torch.zeros(15, device=cuda),
                          0.1, 0.0, 1.0)


# -- GPU: Newton-Schulz's symmetric polynomial ------------------------------------------------------
def _hopper() -> torch.device:
    cuda = _cuda()
    if torch.cuda.get_device_capability(cuda) < (9, 0):
        pytest.skip("the symmetric polynomial kernel needs sm90 (tensor-memory loads)")
    return cuda


def _relative(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch, m", [(1, 8), (3, 40), (2, 128), (5, 136), (2, 264), (3, 544)])
@pytest.mark.parametrize("normalize", [False, True])
def test_symmetric_polynomial_matches_the_formula(dtype, batch, m, normalize):
    """One tile, ragged edge tiles, whole tiles, several tile rows, across the batch (with the
    first step's normalization: Gram matrices of X of norm 7, each scaled by its own trace):
    within the dtype's rounding of the float64 formula, no worse than the cuBLAS reference
    (which rounds twice), exactly symmetric, every element written."""
    from megacpp.kernels.ops.muon_polynomial.triton import (
        muon_polynomial_triton,
        polynomial_triton_ok,
    )

    cuda = _hopper()
    eps = 1e-7 if normalize else None
    for seed in range(2):  # fresh inputs each round
        gram = _symmetric(batch, m, dtype, cuda, 100 * m + seed, norm=7.0 if normalize else 1.0)
        assert polynomial_triton_ok(gram)
        want = _formula(gram, eps)
        got = muon_polynomial_triton(gram, *NS_COEFFS, normalize_eps=eps)
        ref = muon_polynomial_reference(gram, *NS_COEFFS, normalize_eps=eps)
        assert got.dtype == dtype and got.shape == gram.shape
        assert torch.isfinite(got).all()
        assert torch.equal(got, got.mT)
        tol = 4e-3 if dtype == torch.bfloat16 else 5e-4  # a few roundings of the result
        assert _relative(got, want) < tol
        assert _relative(got, want) <= 1.25 * _relative(ref, want) + 1e-5


@gpu
def test_symmetric_polynomial_passes_kernels_check_and_times_as_a_graph():
    """The catalog's own check of the Triton row (bf16 and fp16 against the float64
    reference) passes, and its forward is captured and replayed by the bench's timing."""
    from megacpp.kernels.catalog import device_facts
    from megacpp.kernels.check import check_catalog
    from megacpp.kernels.timing import time_fwd_bwd_graphed

    cuda = _hopper()
    catalog = default_catalog()
    results = check_catalog(catalog, cuda, device_facts(cuda), ["bfloat16", "float16"],
                            surfaces=["muon_polynomial"], seed=4)
    ran = [r for r in results if r.skipped is None]
    assert {(r.backend, r.dtype) for r in ran} >= {("triton_symmetric", "bfloat16"),
                                                    ("triton_symmetric", "float16")}
    assert all(r.passed for r in ran), [(r.backend, r.dtype, r.errors) for r in ran]
    surface = catalog.surface("muon_polynomial")
    gen = torch.Generator(device=cuda).manual_seed(0)
    inputs = surface.make_inputs(surface.cases["check"], torch.bfloat16, cuda, gen)
    replay = time_fwd_bwd_graphed(catalog.backend("muon_polynomial", "triton_symmetric").fn,
                                  inputs, surface.grad_args, cuda, repeats=3)
    assert replay.failure is None and replay.median_ms > 0


@gpu
def test_symmetric_polynomial_runs_the_reference_where_it_cannot_launch():
    """m not a multiple of 8 (TMA rows of whole 16 bytes) and a non-contiguous input: the
    reference's result, bit for bit."""
    from megacpp.kernels.ops.muon_polynomial.triton import (
        muon_polynomial_triton,
        polynomial_triton_ok,
    )

    cuda = _hopper()
    odd = _symmetric(2, 36, torch.bfloat16, cuda, 7)
    strided = _symmetric(4, 40, torch.bfloat16, cuda, 8)[::2]
    for gram in (odd, strided):
        assert not polynomial_triton_ok(gram)
        for eps in (None, 1e-7):
            assert torch.equal(muon_polynomial_triton(gram, *NS_COEFFS, normalize_eps=eps),
                               muon_polynomial_reference(gram, *NS_COEFFS, normalize_eps=eps))


@gpu
@pytest.mark.parametrize("shape", [(6, 96, 160), (4, 272, 136), (1, 256, 256)])
def test_newton_schulz_with_the_symmetric_polynomial(shape):
    """Newton-Schulz in bf16 with the chosen polynomial (``fast``) against the float64
    iteration: no worse than with the reference's; and captured in a CUDA graph, its replays
    on new inputs equal eager calls bit for bit."""
    cuda = _hopper()
    a, b, c = NS_COEFFS
    update = torch.randn(shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    x = update.mT if shape[-2] > shape[-1] else update
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(5):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    want = (x.mT if shape[-2] > shape[-1] else x).to(cuda)
    errors = {}
    for mode in ("reference", "fast"):
        with kernel_mode_override(mode):
            assert resolve("muon_polynomial", update.to(cuda, torch.bfloat16)).name == (
                "triton_symmetric" if mode == "fast" else "reference")
            errors[mode] = _relative(newton_schulz(update.to(cuda), 5, torch.bfloat16), want)
    assert errors["fast"] < 2e-2
    assert errors["fast"] <= 1.25 * errors["reference"]
    with kernel_mode_override("fast"):
        from megacpp.kernels.timing import capture_graph

        static = update.float().to(cuda)
        graph, out = capture_graph(lambda: newton_schulz(static, 5, torch.bfloat16))
        for seed in (4, 5):
            static.copy_(torch.randn(shape, generator=torch.Generator().manual_seed(seed)))
            graph.replay()
            assert torch.equal(out, newton_schulz(static, 5, torch.bfloat16))
