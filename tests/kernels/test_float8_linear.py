"""The float8_linear surface: its catalog rows' requirements, and torchao's Float8Linear
against the plain-PyTorch reference (emulated on the CPU: torchao's own casts and scales with
high-precision matmuls; the real ``torch._scaled_mm`` GEMMs on an sm_89+ GPU)."""

from __future__ import annotations

import pytest
import torch

from megacpp.kernels.catalog import DeviceFacts, rejection
from megacpp.kernels.ops.float8_linear.reference import float8_linear_reference
from megacpp.kernels.ops.float8_linear.spec import backend_of
from megacpp.kernels.registry import default_catalog

pytest.importorskip("torchao")
from megacpp.kernels.ops.float8_linear.torchao_float8 import float8_linear_torchao

FP8_STACK = {"packages": frozenset({"torchao", "triton"}), "torch_ops": frozenset({"_scaled_mm"})}


def _cuda(major: int, minor: int, **facts) -> DeviceFacts:
    return DeviceFacts("cuda", "gpu", (major, minor), **{**FP8_STACK, **facts})


def test_the_rows_need_fp8_hardware_torchao_and_scaled_mm():
    catalog = default_catalog()
    assert [b.name for b in catalog.of("float8_linear")] == [
        "torchao_tensorwise", "torchao_rowwise", "reference"]
    tensorwise, rowwise = backend_of("tensorwise"), backend_of("rowwise")
    cpu = DeviceFacts("cpu", **FP8_STACK)
    assert rejection(tensorwise, cpu, "bfloat16") == "needs device cuda, have cpu"
    assert "needs compute capability >= 8.9, have 8.0" in rejection(tensorwise, _cuda(8, 0),
                                                                       "bfloat16")
    assert rejection(tensorwise, _cuda(8, 9), "bfloat16") is None
    assert "needs compute capability >= 9.0, have 8.9" in rejection(rowwise, _cuda(8, 9),
                                                                    "bfloat16")
    for backend in (tensorwise, rowwise):
        assert rejection(backend, _cuda(9, 0), "bfloat16") is None
        assert "torchao" in rejection(backend, _cuda(9, 0, packages=frozenset()), "bfloat16")
        assert "torch._scaled_mm" in rejection(
            backend, _cuda(9, 0, torch_ops=frozenset()), "bfloat16")
    with pytest.raises(ValueError, match="tensorwise, rowwise"):
        backend_of("mxfp8")


def _operands(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(64, 96, generator=gen) * 3).to(dtype).requires_grad_()
    w = (torch.randn(48, 96, generator=gen) * 0.05).to(dtype).requires_grad_()
    return x, w


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_emulated_torchao_forward_matches_the_reference_and_backward_is_close(recipe):
    x, w = _operands()
    out = float8_linear_torchao(x, w, recipe, emulate=True)
    x_ref, w_ref = _operands()
    ref = float8_linear_reference(x_ref, w_ref, recipe)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)  # the same float8 rounding
    high = x_ref.detach() @ w_ref.detach().t()
    assert (out - high).norm() / high.norm() > 1e-3  # it did round through float8
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    out.backward(grad)
    ref.backward(grad)
    # the recipe also rounds the output gradient through float8 (e5m2 tensorwise: ~5%;
    # e4m3 rowwise: ~3%), and nothing else differs
    bound = {"tensorwise": 0.07, "rowwise": 0.04}[recipe]
    for got, want in ((x.grad, x_ref.grad), (w.grad, w_ref.grad)):
        assert 0.01 < (got - want).norm() / want.norm() < bound


def test_the_reference_rounds_through_e4m3_with_its_recipes_scales():
    from megacpp.kernels.ops.float8_linear.reference import quantize_dequantize

    t = torch.tensor([[1.0, 0.3, -448.0 * 3], [2.0, -0.001, 0.5]])
    tensorwise = quantize_dequantize(t, "tensorwise")  # one scale: 448 / 1344
    assert tensorwise[0, 2].item() == pytest.approx(-1344.0)  # amax lands on e4m3's max
    rowwise = quantize_dequantize(t, "rowwise")  # row 1: 448 / 2 rounded down to 128
    assert rowwise[1, 0] == 2.0 and rowwise[1, 2] == 0.5
    assert tensorwise[1, 1] == 0.0 != rowwise[1, 1]  # row-wise keeps the small row's detail
    with pytest.raises(ValueError, match="tensorwise, rowwise"):
        quantize_dequantize(t, "blockwise")


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_torchao_scaled_mm_matches_the_reference_on_the_gpu(recipe):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    need = backend_of(recipe).requirements.min_capability
    if torch.cuda.get_device_capability() < need:
        pytest.skip(f"{recipe} needs sm_{need[0]}{need[1]}+")
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(256, 512, device="cuda", generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(384, 512, device="cuda", generator=gen) * 0.05).requires_grad_()
    out = float8_linear_torchao(x, w, recipe)
    x_ref = x.detach().clone().requires_grad_()
    w_ref = w.detach().clone().requires_grad_()
    ref = float8_linear_reference(x_ref, w_ref, recipe)
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref.float()).norm() / ref.float().norm() < 1e-2
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    for got, want in ((x.grad, x_ref.grad), (w.grad, w_ref.grad)):
        assert (got.float() - want.float()).norm() / want.float().norm() < 0.08
