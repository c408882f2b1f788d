"""Muon's Newton-Schulz step and the AdamW/Muon parameter grouping."""

from __future__ import annotations

import pytest
import torch

from megacpp.kernels.runtime import kernel_mode_override
from megacpp.model.config import load_config
from megacpp.model.model import HybridLM
from megacpp.train.config import OptimSection
from megacpp.train.optim import (
    NS_COEFFS,
    Muon,
    Optimizers,
    _same_shape_batches,
    group_parameters,
    muon_scale,
    newton_schulz,
)


def _singular_values(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(x.double())


def test_newton_schulz_orthogonalizes_tall_and_wide_matrices():
    torch.manual_seed(0)
    for shape in ((64, 16), (16, 64), (48, 48)):
        g = torch.randn(shape) * 3.0
        s = _singular_values(newton_schulz(g, steps=5))
        # the quintic lands every singular value in roughly [0.7, 1.2] (not exactly 1)
        assert s.min() > 0.6 and s.max() < 1.25, (shape, s.min(), s.max())
        assert newton_schulz(g).shape == g.shape
    # the same singular vectors as the exact polar factor U V^T
    g = torch.randn(32, 24)
    u, _, vh = torch.linalg.svd(g.double(), full_matrices=False)
    cosine = torch.nn.functional.cosine_similarity(
        newton_schulz(g, 5).double().flatten(), (u @ vh).flatten(), dim=0)
    assert cosine > 0.97


def _quintic_reference(g: torch.Tensor, dtype: torch.dtype, steps: int = 5) -> torch.Tensor:
    """The iteration as written in the Muon paper, one tensor op per term, in ``dtype``."""
    a, b, c = NS_COEFFS
    x = g.to(dtype)
    wide = x.shape[-2] <= x.shape[-1]
    x = x if wide else x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x if wide else x.mT


@pytest.mark.parametrize("shape", [(5, 40, 24), (5, 24, 40), (32, 32)])
def test_newton_schulz_is_the_quintic_iteration(shape):
    """The fused form (b A + c A A in the GEMM's epilogue, a I on its diagonal, one product
    with X) is the same function: to float64 rounding in float64; in bfloat16 within a few
    percent of the float64 result, as close as the op-by-op iteration run in bfloat16."""
    g = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)), dtype=torch.float64)
    exact = _quintic_reference(g, torch.float64)
    torch.testing.assert_close(newton_schulz(g, 5, torch.float64), exact, rtol=1e-12, atol=1e-12)

    def rel(x: torch.Tensor) -> float:
        return ((x.double() - exact).norm() / exact.norm()).item()

    fused = newton_schulz(g.float(), 5, torch.bfloat16)
    assert fused.dtype == torch.float32 and fused.shape == g.shape
    assert rel(fused) < 4e-2
    assert rel(fused) < 1.25 * rel(_quintic_reference(g, torch.bfloat16))


def test_batched_newton_schulz_equals_per_matrix():
    torch.manual_seed(1)
    experts = torch.randn(4, 24, 16)
    batched = newton_schulz(experts)
    for e in range(4):
        assert torch.allclose(batched[e], newton_schulz(experts[e]), atol=1e-6)


def test_muon_update_rms_matches_the_adamw_scale():
    torch.manual_seed(2)
    w = torch.nn.Parameter(torch.zeros(64, 256))
    w.grad = torch.randn_like(w)
    opt = Muon([w], lr=0.1, momentum=0.0, nesterov=False)
    opt.step()
    rms = w.detach().pow(2).mean().sqrt().item()
    assert 0.1 * 0.2 * 0.7 < rms < 0.1 * 0.2 * 1.25  # lr * 0.2 (the AdamW-like RMS)
    assert muon_scale(w.shape) == 0.2 * 16


def test_grouping_of_the_hybrid_model():
    model = HybridLM(load_config("tiny"))
    groups = group_parameters(model)
    muon = {n for n, _ in groups.muon}
    decay = {n for n, _ in groups.adamw_decay}
    no_decay = {n for n, _ in groups.adamw_no_decay}
    all_names = {n for n, _ in model.named_parameters()}
    assert muon | decay | no_decay == all_names
    assert len(muon) + len(decay) + len(no_decay) == len(all_names)  # disjoint
    assert {"blocks.0.mixer.q_proj.weight", "blocks.0.mixer.out_proj.weight",
            "blocks.1.mixer.w_in", "blocks.1.mixer.out_proj",  # 3-D experts
            "blocks.1.mixer.shared.in_proj.weight", "blocks.2.mixer.in_proj.weight",
            "blocks.7.mixer.o_proj.weight"} <= muon
    assert {"embed.weight", "blocks.1.mixer.router.weight",
            "blocks.7.mixer.conv_weight"} <= decay
    assert {"blocks.0.norm.weight", "blocks.2.mixer.dt_bias", "blocks.2.mixer.D",
            "blocks.2.mixer.B_bias", "blocks.7.mixer.A_log", "norm.weight"} <= no_decay
    assert all(p.ndim in (2, 3) for _, p in groups.muon)
    assert not group_parameters(model, use_muon=False).muon


def test_optimizers_step_every_parameter_and_set_lr():
    torch.manual_seed(3)
    model = HybridLM(load_config("tiny"))
    opts = Optimizers(model, OptimSection(lr=1e-2), torch.device("cpu"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, 4096, (2, 16))
    model(ids, labels=ids).loss.backward()
    opts.set_lr(5e-3)
    opts.step()
    assert all(g["lr"] == 5e-3 for opt in opts for g in opt.param_groups)
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) == len(before)
    summary = opts.summary()
    assert sum(summary.values()) == sum(p.numel() for p in model.parameters())


def _stepped_copies(device: torch.device, lrs: list[float], graphed: bool):
    """A tiny HybridLM after one optimizer step per lr (fixed random grads), stepped eagerly
    with float lrs or (``graphed``) by replaying one step captured under ``device_lr``."""
    torch.manual_seed(4)
    model = HybridLM(load_config("tiny")).to(device)
    opts = Optimizers(model, OptimSection(lr=1.0), device, capturable=device.type == "cuda")
    gen = torch.Generator(device="cpu").manual_seed(5)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen).to(device)
    if not graphed:
        for lr in lrs:
            opts.set_lr(lr)
            opts.step()
        return model, opts
    opts.set_lr(lrs[0])
    side = torch.cuda.Stream()  # warm-up and capture on one stream, as the trainer does
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        opts.step()  # warm-up: optimizer state exists before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with opts.device_lr(device), torch.cuda.graph(graph, stream=side):
        opts.step()
    for lr in lrs[1:]:
        opts.set_lr(lr)
        graph.replay()
    # pinned memory and a scalar read after the capture (the host allocator processes its
    # events): failed with "invalid argument" when the fused Muon passes freed their pinned
    # address tables inside the capture
    torch.ones(8).pin_memory()
    assert lrs[-1] == pytest.approx(opts.lr_tensor.item(), rel=1e-6)
    return model, opts


def test_device_lr_steps_as_float_lr_and_restores_the_floats():
    """Inside device_lr the groups read one device tensor that set_lr keeps current; the
    step (AdamW and Muon) equals the float-lr step, and the groups get their floats back."""
    cpu = torch.device("cpu")
    eager, _ = _stepped_copies(cpu, [1e-2, 3e-3], graphed=False)
    torch.manual_seed(4)
    model = HybridLM(load_config("tiny"))
    opts = Optimizers(model, OptimSection(lr=1.0), cpu)
    gen = torch.Generator(device="cpu").manual_seed(5)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    for lr in (1e-2, 3e-3):
        opts.set_lr(lr)
        with opts.device_lr(cpu):
            assert all(g["lr"] is opts.lr_tensor for opt in opts for g in opt.param_groups)
            assert opts.lr_tensor.item() == pytest.approx(lr, rel=1e-7)  # float32
            opts.step()
        assert all(g["lr"] == lr for opt in opts for g in opt.param_groups)
    for (name, a), b in zip(eager.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["reference", "fast"])
def test_captured_optimizer_step_reads_the_current_lr(mode):
    """A CUDA graph of the AdamW + Muon step, replayed after set_lr, applies that lr (the
    value at capture is not baked in): same parameters as eager steps with those lrs. Under
    ``fast`` Muon's passes are the fused kernels, their address tables copied in the capture."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    cuda = torch.device("cuda")
    lrs = [1e-2, 3e-3, 7e-3]
    with kernel_mode_override(mode):
        eager, _ = _stepped_copies(cuda, lrs, graphed=False)
        graphed, opts = _stepped_copies(cuda, lrs, graphed=True)
    assert all(g["lr"] == lrs[-1] for opt in opts for g in opt.param_groups)
    for (name, a), b in zip(eager.named_parameters(), graphed.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def _two_steps_with_muon_grad_scale(device: torch.device, folded: bool) -> tuple:
    """A tiny HybridLM after two steps with fixed random gradients, Muon's taken times 0.37:
    handed to Muon (``folded``) or multiplied into the gradients first; (model, the Muon
    gradients after the steps, copies of the last step's Muon gradients as drawn)."""
    torch.manual_seed(8)
    model = HybridLM(load_config("tiny")).to(device)
    opts = Optimizers(model, OptimSection(lr=1e-2), device)
    assert opts.muon_takes_grad_scale
    gen = torch.Generator(device="cpu").manual_seed(9)
    scale = torch.tensor(0.37, device=device)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen).to(device)
        muon_grads = [p.grad for _, p in opts.groups.muon]
        drawn = [g.clone() for g in muon_grads]
        if folded:
            opts.step(muon_grad_scale=scale)
        else:
            torch._foreach_mul_(muon_grads, scale)
            opts.step()
    return model, muon_grads, drawn


@pytest.mark.parametrize("mode", ["reference", pytest.param("fast", marks=pytest.mark.gpu)])
def test_muon_grad_scale_steps_as_gradients_scaled_first(mode):
    """The trainer's clipping coefficient handed to Muon's momentum pass gives the parameters
    of scaling Muon's gradients first (bit for bit on CPU; the fused pass to float32
    rounding), and the gradients are left as they were."""
    device = torch.device("cuda" if mode == "fast" else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    with kernel_mode_override(mode):
        folded, grads, drawn = _two_steps_with_muon_grad_scale(device, folded=True)
        scaled, _, _ = _two_steps_with_muon_grad_scale(device, folded=False)
    for g, want in zip(grads, drawn, strict=True):
        assert torch.equal(g, want)  # not rewritten
    tol = {"rtol": 0, "atol": 0} if mode == "reference" else {"rtol": 1e-5, "atol": 1e-6}
    for (name, a), b in zip(folded.named_parameters(), scaled.parameters(), strict=True):
        torch.testing.assert_close(a, b, **tol, msg=name)


def test_muon_refuses_a_grad_scale_it_cannot_take():
    params = [torch.nn.Parameter(torch.randn(8, 8))]
    params[0].grad = torch.randn(8, 8)
    opt = Muon(params)
    for bad in (torch.tensor([0.5, 0.5]), torch.tensor(0.5, dtype=torch.float64), 0.5):
        with pytest.raises(ValueError, match="grad_scale"):
            opt.step(grad_scale=bad)
    torch.testing.assert_close(opt.state[params[0]]["momentum_buffer"], torch.zeros(8, 8))


def test_muon_batches_same_shape_matrices_as_one_per_matrix_step():
    """Muon orthogonalizes all matrices of one shape in one batched Newton-Schulz (2-D
    weights and 3-D expert stacks together); the result equals the per-matrix definition:
    momentum, Nesterov, NS of each matrix alone, decoupled decay, RMS-matched step."""
    torch.manual_seed(6)
    shapes = [(24, 40), (3, 24, 40), (40, 24), (24, 40), (16, 16)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    expected = [p.detach().clone() for p in params]
    bufs = [torch.zeros_like(p) for p in params]
    opt = Muon(params, lr=0.05, weight_decay=0.1, momentum=0.9, nesterov=True, ns_steps=5)
    for _ in range(2):
        grads = [torch.randn(s) for s in shapes]
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()
        for i, (g, w) in enumerate(zip(grads, expected, strict=True)):
            bufs[i] = bufs[i] * 0.9 + g
            update = g + 0.9 * bufs[i]
            ortho = torch.stack([newton_schulz(m, 5) for m in update.reshape(-1, *w.shape[-2:])])
            w.mul_(1 - 0.05 * 0.1).add_(ortho.view(w.shape), alpha=-0.05 * muon_scale(w.shape))
    for p, w in zip(params, expected, strict=True):
        torch.testing.assert_close(p.detach(), w, rtol=1e-5, atol=1e-6)
    assert [len(b) for b in _same_shape_batches(params)] == [3, 1, 1]
