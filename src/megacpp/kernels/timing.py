"""Timing one backend's forward+backward (``kernels bench`` and ``benchmarks/kernels.py``)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megacpp.kernels.check import forward_backward


@dataclass
class Timing:
    median_ms: float
    peak_extra_bytes: int | None  # CUDA only: peak allocated during fwd+bwd above the inputs


def time_fwd_bwd(
    fn: Callable[..., Any], inputs: dict[str, Any], grad_args: tuple[str, ...],
    device: torch.device, warmup: int = 3, repeats: int = 10,
) -> Timing:
    """Median wall time of ``fn`` forward + backward (CUDA events on a GPU)."""
    _, _, cot = forward_backward(fn, inputs, grad_args)
    for _ in range(warmup):
        forward_backward(fn, inputs, grad_args, cot)
    samples = [_one(fn, inputs, grad_args, cot, device) for _ in range(repeats)]
    peak = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        forward_backward(fn, inputs, grad_args, cot)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    return Timing(statistics.median(samples), peak)


def _one(fn, inputs, grad_args, cot, device: torch.device) -> float:
    if device.type != "cuda":
        start = time.perf_counter()
        forward_backward(fn, inputs, grad_args, cot)
        return (time.perf_counter() - start) * 1e3
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    forward_backward(fn, inputs, grad_args, cot)
    end.record()
    torch.cuda.synchronize(device)
    return begin.elapsed_time(end)
