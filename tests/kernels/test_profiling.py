"""The profiler's kernel families: library kernels by name, ours by their Triton module."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megacpp.kernels.profiling import family_breakdown, format_breakdown, kernel_family

OURS = {"_bwd_dqk": "mamba3_scan", "_ce_rows": "linear_cross_entropy"}


@pytest.mark.parametrize("name, family", [
    ("_bwd_dqk", "ours: mamba3_scan"),
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "GEMM (cuBLAS / CUTLASS)"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", "attention (flash / cuDNN SDPA)"),
    ("void cutlass::device_kernel<at::cuda::detail::GroupedGemmKernel<...>>", "grouped GEMM"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamW>", "optimizer"),
    ("triton_poi_fused__to_copy_add_mul_0", "Inductor (torch.compile)"),
    ("Memcpy DtoD (Device -> Device)", "copies and fills"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>",
     "torch elementwise / reductions"),
    ("some_unknown_kernel", "other"),
])
def test_kernel_family(name, family):
    assert kernel_family(name, OURS) == family


def test_breakdown_sums_per_step_and_sorts():
    rows = family_breakdown([("_bwd_dqk", 3000.0), ("nvjet_a", 1000.0), ("nvjet_b", 500.0),
                             ("_ce_rows", 2500.0), ("_bwd_dqk", 3000.0)], steps=2, ours=OURS)
    assert [r["family"] for r in rows] == ["ours: mamba3_scan", "ours: linear_cross_entropy",
                                           "GEMM (cuBLAS / CUTLASS)"]
    assert rows[0]["ms_per_step"] == pytest.approx(3.0) and rows[0]["share"] == pytest.approx(0.6)
    assert rows[2]["top"] == [("nvjet_a", 0.5), ("nvjet_b", 0.25)]
    text = format_breakdown(rows)
    assert "ours: mamba3_scan" in text and text.splitlines()[-1].split()[-1] == "5.00"


def test_our_kernels_come_from_the_ops_modules():
    pytest.importorskip("triton")
    from megacpp.kernels.profiling import our_kernels

    ours = our_kernels()
    assert ours["_bwd_dqk"] == "mamba3_scan" and ours["_ce_rows"] == "linear_cross_entropy"
    assert ours["_sum_rows"] == "sum_rows"  # a shared kernel module beside the surfaces
    assert "_last" not in ours  # defined in two modules: either could own it


def test_device_rows_drop_the_cpu_ops_that_repeat_their_kernels_time():
    from types import SimpleNamespace

    from megacpp.kernels.profiling import device_rows

    def row(key, device):
        return SimpleNamespace(key=key, device_type=SimpleNamespace(name=device))

    rows = [row("aten::mm", "CPU"), row("nvjet_a", "CUDA"), row("Memset (Device)", "CUDA")]
    assert [r.key for r in device_rows(rows)] == ["nvjet_a", "Memset (Device)"]


def test_step_ops_sums_each_ops_own_device_time_per_op_and_input_shapes():
    """benchmarks/step_ops.py's aggregation: self device time and calls per (op, shapes), per
    step, with the kernels' names; device-side rows and ops with no GPU time are skipped."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import step_ops

    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def event(name, shapes, us, kernels=(), device=cpu):
        return SimpleNamespace(name=name, input_shapes=shapes, self_device_time_total=us,
                               device_type=device,
                               kernels=[SimpleNamespace(name=k) for k in kernels])

    events = [event("aten::copy_", [[2, 3]], 10.0, ["k1"]),
              event("aten::copy_", [[2, 3]], 30.0, ["k2"]), event("aten::copy_", [[4]], 5.0, ["k1"]),
              event("aten::add", [[2, 3]], 0.0), event("k1", [], 99.0, device=cuda)]
    rows = step_ops.attribute(SimpleNamespace(events=lambda: events), steps=2)
    assert rows == [
        {"op": "aten::copy_", "shapes": "[[2, 3]]", "ms_per_step": 0.02, "calls_per_step": 1.0,
         "kernels": ["k1", "k2"]},
        {"op": "aten::copy_", "shapes": "[[4]]", "ms_per_step": 0.0025, "calls_per_step": 0.5,
         "kernels": ["k1"]},
    ]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernel_times_count_each_kernel_per_call():
    """A GEMM and an elementwise kernel: both found, per call (not summed over the calls), the
    GEMM first, and a graph replay's kernels counted like eager ones (cuBLAS may add a memset
    of its own)."""
    from megacpp.kernels.profiling import kernel_times_us

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    small = torch.randn(1024, device="cuda")

    def fn():
        a @ a
        small.mul_(1.0)

    def families(times):
        return [kernel_family(name) for name in times]

    eager = kernel_times_us(fn, calls=10)
    assert families(eager)[0] == "GEMM (cuBLAS / CUTLASS)"
    assert "torch elementwise / reductions" in families(eager)
    gemm = next(iter(eager.values()))
    assert 50 < gemm < 1000  # a 4096^3 bf16 GEMM takes ~0.2 ms: per call, not the sum of ten
    assert all(0 < us <= gemm for us in eager.values())
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        fn()
    replayed = kernel_times_us(graph.replay, calls=10)
    assert families(replayed)[0] == "GEMM (cuBLAS / CUTLASS)"
    assert "torch elementwise / reductions" in families(replayed)
