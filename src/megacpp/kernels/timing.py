"""Timing one backend's forward+backward (``kernels bench`` and ``benchmarks/kernels.py``)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megacpp.kernels.check import outputs_of


@dataclass
class Timing:
    median_ms: float
    peak_extra_bytes: int | None  # CUDA only: peak allocated during fwd+bwd above the inputs


def time_fwd_bwd(
    fn: Callable[..., Any], inputs: dict[str, Any], grad_args: tuple[str, ...],
    device: torch.device, warmup: int = 3, repeats: int = 10,
) -> Timing:
    """Median wall time of ``fn`` forward + backward (CUDA events on a GPU).

    The backward is driven by fixed random cotangents in each output's own dtype
    (``autograd.grad(outputs, inputs, cotangents)``), so the timed work is the backend's
    forward and backward and nothing else -- no loss reduction, no fp32 casts of the outputs
    (which would cost more than a memory-bound kernel such as RMSNorm)."""
    outs = _differentiable(fn(**inputs))
    cot = [torch.randn_like(o) for o in outs]
    del outs
    for _ in range(warmup):
        _fwd_bwd(fn, inputs, grad_args, cot)
    samples = [_one(fn, inputs, grad_args, cot, device) for _ in range(repeats)]
    peak = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        _fwd_bwd(fn, inputs, grad_args, cot)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    return Timing(statistics.median(samples), peak)


def _differentiable(result: Any) -> list[torch.Tensor]:
    return [t for t in outputs_of(result) if t.requires_grad]


def _fwd_bwd(fn, inputs, grad_args, cot) -> None:
    outs = _differentiable(fn(**inputs))
    torch.autograd.grad(
        outs, [inputs[name] for name in grad_args], grad_outputs=cot, allow_unused=True
    )


def _one(fn, inputs, grad_args, cot, device: torch.device) -> float:
    if device.type != "cuda":
        start = time.perf_counter()
        _fwd_bwd(fn, inputs, grad_args, cot)
        return (time.perf_counter() - start) * 1e3
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    _fwd_bwd(fn, inputs, grad_args, cot)
    end.record()
    torch.cuda.synchronize(device)
    return begin.elapsed_time(end)


def cuda_times_ms(fn: Callable[[], Any], warmup: int = 3, iters: int = 20) -> list[float]:
    """Per-call times (ms, CUDA events) of ``fn`` on the current device, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end))
    return times


def matmul_peak_tflops(n: int = 8192, iters: int = 30) -> float:
    """The bf16 matmul rate (TFLOP/s) of an ``n``^3 GEMM on random data: the MFU denominator.
    Measure it in the same run as what it divides (the card's clock drops under power limits)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = statistics.median(cuda_times_ms(lambda: a @ b, warmup=10, iters=iters))
    return 2 * n**3 / (ms * 1e-3) / 1e12
