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


def test_linear_rows_takes_float8_for_aligned_slices_and_bf16_for_the_rest():
    import dataclasses

    import torch.nn.functional as F
    from torch import nn

    from megacpp.kernels.ops.float8_linear.torchao_float8 import (
        import_torchao,
        is_float8_linear,
        linear_rows,
    )

    gen = torch.Generator().manual_seed(3)
    plain = nn.Linear(64, 72, bias=False)  # rows 0:32 and 32:64 aligned, 64:72 not
    x = torch.randn(10, 64, generator=gen) * 2
    torch.testing.assert_close(linear_rows(plain, x, 8, 40), F.linear(x, plain.weight[8:40]))
    float8 = import_torchao()
    config = dataclasses.replace(float8.Float8LinearConfig.from_recipe_name("rowwise"),
                                 emulate=True)
    layer = float8.float8_linear.Float8Linear.from_float(plain, config=config)
    assert is_float8_linear(layer) and not is_float8_linear(plain)
    for start, stop in ((0, 32), (32, 64)):
        torch.testing.assert_close(linear_rows(layer, x, start, stop), float8_linear_reference(
            x, layer.weight[start:stop], "rowwise"), rtol=1e-5, atol=1e-5)
    rest = linear_rows(layer, x, 64)
    assert torch.equal(rest, F.linear(x, layer.weight[64:]))  # 8 rows: no float8 GEMM
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the input cast as Float8Linear's
        assert linear_rows(layer, x, 0, 32).dtype == torch.bfloat16
        torch.testing.assert_close(linear_rows(layer, x, 0, 32), float8_linear_reference(
            x.bfloat16(), layer.weight[:32], "rowwise"), rtol=1e-2, atol=1e-2)
    weight = layer.weight
    x.requires_grad_()
    linear_rows(layer, x, 0, 32).sum().backward()
    assert weight.grad[:32].abs().sum() > 0 and not weight.grad[32:].any()


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
