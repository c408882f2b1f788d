"""Timing one backend's forward+backward (``kernels bench`` and ``benchmarks/kernels.py``).

Two ways: ``time_fwd_bwd`` times each call as Python issues it (what a training step sees,
host launch gaps included); ``time_fwd_bwd_graphed`` captures one call as a CUDA graph and
times its replays (the GPU's own time: a backend of many small launches stops waiting for
the host). A backend that cannot be captured gets a reason instead of a time.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from megacpp.errors import MegaCppError, describe_error
from megacpp.kernels.check import outputs_of

T = TypeVar("T")


@dataclass
class Timing:
    median_ms: float
    peak_extra_bytes: int | None  # CUDA only: peak allocated during fwd+bwd above the inputs


@dataclass
class GraphTiming:
    """Median time of CUDA-graph replays of one forward+backward, or why there is none."""

    median_ms: float | None
    failure: str | None = None  # "<what>: <ExceptionType>: <its first line>" when not captured


class GraphCaptureError(MegaCppError, RuntimeError):
    """Work could not be captured as a CUDA graph; the message says why. From
    :func:`capture_graph` (benchmarks) it is raised after the capture was ended and its memory
    released, so CUDA stays usable; the trainer's step capture (``train/graphs.py``) raises it
    too, with what to change in the run's settings."""


@dataclass
class CapturedFwdBwd:
    """One forward+backward as a CUDA graph: each ``graph.replay()`` reruns it on what the
    inputs and ``cotangents`` hold then, writing ``grads`` (the graph's own memory; None for
    a grad arg the outputs do not depend on)."""

    graph: torch.cuda.CUDAGraph
    grads: tuple[torch.Tensor | None, ...]
    cotangents: list[torch.Tensor]


def time_fwd_bwd(
    fn: Callable[..., Any], inputs: dict[str, Any], grad_args: tuple[str, ...],
    device: torch.device, warmup: int = 3, repeats: int = 10,
) -> Timing:
    """Median wall time of ``fn`` forward + backward (CUDA events on a GPU).

    The backward is driven by fixed random cotangents in each output's own dtype
    (``autograd.grad(outputs, inputs, cotangents)``), so the timed work is the backend's
    forward and backward and nothing else -- no loss reduction, no fp32 casts of the outputs
    (which would cost more than a memory-bound kernel such as RMSNorm). With no ``grad_args``
    (a surface without autograd) the forward is timed alone."""
    cot = _cotangents(fn, inputs)
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


def time_fwd_bwd_graphed(
    fn: Callable[..., Any], inputs: dict[str, Any], grad_args: tuple[str, ...],
    device: torch.device, warmup: int = 3, repeats: int = 10,
) -> GraphTiming:
    """Median time (CUDA events, each replay timed alone) of CUDA-graph replays of the same
    forward+backward as :func:`time_fwd_bwd`; see :func:`capture_fwd_bwd` for the capture.
    A backend that cannot be captured gets ``GraphTiming(None, reason)``, not an exception.
    CUDA only: raises ValueError for another device."""
    try:
        captured = capture_fwd_bwd(fn, inputs, grad_args, device, warmup)
    except GraphCaptureError as exc:
        return GraphTiming(None, str(exc))
    with torch.cuda.device(device):
        samples = cuda_times_ms(captured.graph.replay, warmup=warmup, iters=repeats)
    return GraphTiming(statistics.median(samples))


def capture_fwd_bwd(
    fn: Callable[..., Any], inputs: dict[str, Any], grad_args: tuple[str, ...],
    device: torch.device, warmup: int = 3,
) -> CapturedFwdBwd:
    """Capture one forward+backward of ``fn`` (fixed random cotangents) as a CUDA graph, by
    :func:`capture_graph`. The graph reads the inputs' storage (write new values into them
    between replays). Raises :class:`GraphCaptureError` when it cannot be captured."""
    if device.type != "cuda":
        raise ValueError(f"CUDA-graph timing needs a CUDA device; got {device}")
    # the gradients are taken at fresh leaves (aliases of the caller's tensors): a caller may
    # still hold an autograd graph over its own (an output kept from an earlier call), and
    # those leaves' gradient accumulators, made on the stream of that call, would be synced
    # with inside the capture, which CUDA refuses ("operation would make the legacy stream
    # depend on a capturing blocking stream")
    inputs = {name: t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor)
              else t for name, t in inputs.items()}
    with torch.cuda.device(device):
        cot = _cotangents(fn, inputs)
        graph, grads = capture_graph(lambda: _fwd_bwd(fn, inputs, grad_args, cot), warmup)
    return CapturedFwdBwd(graph, grads, cot)


def capture_graph(fn: Callable[[], T], warmup: int = 3) -> tuple[torch.cuda.CUDAGraph, T]:
    """``fn`` (no host syncs, static shapes) captured as a CUDA graph on the current device:
    (the graph, what the captured call returned -- the graph's memory, rewritten by each
    ``replay()``).

    ``warmup`` calls run first on a side stream (compilation, Triton autotuning, the
    allocator's pools), then one more with host syncs made errors
    (``torch.cuda.set_sync_debug_mode("error")``), so a function that syncs (``.item()``,
    ``.tolist()``, ``nonzero``, a pageable copy) is refused before any capture begins; then
    the capture, into a memory pool of its own. Raises :class:`GraphCaptureError` (what
    failed, the exception's type and first line) for a sync or a failed capture; a failed
    capture is first ended, its pool released and the default CUDA generator taken out of
    capture mode, so CUDA stays usable (checked with a device synchronize)."""
    if warmup < 1:
        raise ValueError(f"warmup must be >= 1 (autotuning must not run under the sync "
                         f"check or the capture); got {warmup}")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
        failure = _host_sync(fn)
    if failure is not None:
        raise GraphCaptureError(f"host sync: {failure}")
    torch.cuda.synchronize()
    graph, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
    try:
        with torch.cuda.stream(side):  # restores the current stream whatever happens
            graph.capture_begin(pool=pool)
            try:
                result = fn()
            except BaseException:
                with contextlib.suppress(RuntimeError):
                    _end_capture(graph, pool)
                raise
            _end_capture(graph, pool)
    except Exception as exc:  # noqa: BLE001 -- any capture failure is a reason, not a crash
        # (keep the message only: a live traceback would keep the pool's tensors)
        failure = describe_error(exc)
    if failure is not None:
        del graph  # its reset() drops the capture's bookkeeping (and the pool, if ended)
        torch.cuda.synchronize()  # CUDA must still work; if not, this raises (fatal)
        _unmark_rng_capture(side)
        raise GraphCaptureError(f"capture failed: {failure}")
    torch.cuda.current_stream().wait_stream(side)
    return graph, result


def _host_sync(fn: Callable[[], Any]) -> str | None:
    """One call of ``fn`` with synchronizing CUDA calls made errors: None, or the error."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Synchronization debug mode is a prototype")
        torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as exc:
        return describe_error(exc)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    return None


def _end_capture(graph: torch.cuda.CUDAGraph, pool: Any) -> None:
    """End the capture under way on the current stream. When CUDA refuses (an invalidated
    capture), the stream has still left capture mode, but torch's ``capture_end`` raised
    before telling its caching allocator: the allocator would keep the capture's pool
    registered (deferring every later event-guarded free while it is) and never free it.
    End and release that pool here, then re-raise."""
    try:
        graph.capture_end()
    except RuntimeError:
        _release_pool(pool)
        raise


def _unmark_rng_capture(stream: torch.cuda.Stream) -> None:
    """torch (2.11) marks the default CUDA generator as capturing in ``capture_begin`` and
    unmarks it only in a ``capture_end`` that succeeds: after a failed one, every later
    random op on the device raises "Offset increment outside graph capture encountered
    unexpectedly". A trivial capture that ends cleanly unmarks it."""
    scratch = torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin()
        scratch.add_(1)
        graph.capture_end()


def _release_pool(pool: Any) -> None:
    index = torch.cuda.current_device()
    try:
        torch._C._cuda_endAllocateToPool(index, pool)
    except RuntimeError:
        return  # capture_end got past this step: the graph's reset() releases the pool
    torch._C._cuda_releasePool(index, pool)


def _cotangents(fn, inputs) -> list[torch.Tensor]:
    return [torch.randn_like(o) for o in _differentiable(fn(**inputs))]


def _differentiable(result: Any) -> list[torch.Tensor]:
    return [t for t in outputs_of(result) if t.requires_grad]


def _fwd_bwd(fn, inputs, grad_args, cot) -> tuple[torch.Tensor | None, ...]:
    """The grads of ``grad_args``; with none (a surface without autograd, such as an
    optimizer pass) the forward alone, returning its outputs (a capture keeps them)."""
    if not grad_args:
        return tuple(outputs_of(fn(**inputs)))
    outs = _differentiable(fn(**inputs))
    return torch.autograd.grad(
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


def matmul_peak_tflops(n: int = 8192, iters: int = 100, settle_s: float = 2.0) -> float:
    """The bf16 matmul rate (TFLOP/s) of an ``n``^3 GEMM on random data: the MFU denominator.
    Measure it in the same run as what it divides (the card's clock drops under power limits).
    The GEMM first runs back to back for ``settle_s`` seconds, so that the card reaches the
    power-limited clock it keeps under sustained work (a training step's) before it is timed:
    with 10 warm-up calls the same H100 gave 726-786 TFLOP/s in four processes, MFU moving by
    8% with the step's time still."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return _settled_rate(lambda: a @ b, n, iters, settle_s)


def fp8_matmul_peak_tflops(n: int = 8192, iters: int = 100, settle_s: float = 2.0) -> float:
    """The float8 matmul rate (TFLOP/s) measured as :func:`matmul_peak_tflops` measures bf16:
    an ``n``^3 ``torch._scaled_mm`` of e4m3 operands (the second column-major, as the GEMM
    requires) with tensor-wise scales, a bf16 output and fast accumulation (the float8
    training forward's GEMM). Needs CUDA sm_89+."""
    e4m3 = torch.float8_e4m3fn
    a = torch.randn(n, n, device="cuda").to(e4m3)
    b = torch.randn(n, n, device="cuda").to(e4m3).t()  # column-major [K, N]
    one = torch.ones((), device="cuda")

    def gemm() -> torch.Tensor:
        return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                use_fast_accum=True)

    return _settled_rate(gemm, n, iters, settle_s)


def _settled_rate(gemm: Callable[[], Any], n: int, iters: int, settle_s: float) -> float:
    """TFLOP/s of an ``n``^3 GEMM after running it back to back for ``settle_s`` seconds."""
    torch.cuda.synchronize()
    begin = time.perf_counter()
    while time.perf_counter() - begin < settle_s:
        for _ in range(10):
            gemm()
        torch.cuda.synchronize()
    ms = statistics.median(cuda_times_ms(gemm, warmup=0, iters=iters))
    return 2 * n**3 / (ms * 1e-3) / 1e12
