"""Timing a forward+backward: per call, and as CUDA-graph replays (GPU), including a backend
that cannot be captured (a reason, and CUDA still usable after it)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megacpp.kernels.timing import (
    GraphCaptureError,
    capture_fwd_bwd,
    time_fwd_bwd,
    time_fwd_bwd_graphed,
)

gpu = pytest.mark.gpu
GRAD_ARGS = ("x", "w")


def mlp(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.gelu(x @ w)


def syncs_on_host(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * w * x.sum().item()  # .item(): a host sync, never capturable


def syncs_only_when_capturing(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Passes the sync check, then syncs inside the capture: CUDA invalidates the capture
    (cudaErrorStreamCaptureUnsupported) and refuses to end it cleanly."""
    y = torch.tanh(x) * w
    if torch.cuda.is_current_stream_capturing():
        torch.cuda.current_stream().synchronize()
    return y * 2


def _inputs(device: str, shapes=((64, 128), (128, 256))) -> dict[str, torch.Tensor]:
    return {name: torch.randn(shape, device=device, requires_grad=True)
            for name, shape in zip(GRAD_ARGS, shapes)}


def test_per_call_timing_on_cpu() -> None:
    t = time_fwd_bwd(mlp, _inputs("cpu"), GRAD_ARGS, torch.device("cpu"), warmup=1, repeats=3)
    assert t.median_ms > 0 and t.peak_extra_bytes is None


def test_graphed_timing_refuses_cpu() -> None:
    """CUDA graphs are a CUDA thing: asking on the CPU is the caller's error, said plainly."""
    with pytest.raises(ValueError, match="CUDA-graph timing needs a CUDA device; got cpu"):
        time_fwd_bwd_graphed(mlp, _inputs("cpu"), GRAD_ARGS, torch.device("cpu"))
    with pytest.raises(ValueError, match="needs a CUDA device"):
        capture_fwd_bwd(mlp, _inputs("cpu"), GRAD_ARGS, torch.device("cpu"))


@gpu
def test_replay_gradients_match_eager_on_fresh_inputs() -> None:
    torch.manual_seed(0)
    device = torch.device("cuda")
    inputs = _inputs("cuda")
    captured = capture_fwd_bwd(mlp, inputs, GRAD_ARGS, device)
    for _ in range(2):  # new values in the captured inputs and cotangents, then a replay
        with torch.no_grad():
            for t in (*inputs.values(), *captured.cotangents):
                t.copy_(torch.randn_like(t))
        captured.graph.replay()
        torch.cuda.synchronize()
        fresh = {k: v.detach().clone().requires_grad_() for k, v in inputs.items()}
        eager = torch.autograd.grad(mlp(**fresh), list(fresh.values()), captured.cotangents)
        for name, got, want in zip(GRAD_ARGS, captured.grads, eager):
            torch.testing.assert_close(got, want, msg=lambda m, n=name: f"d{n}: {m}")
    timing = time_fwd_bwd_graphed(mlp, inputs, GRAD_ARGS, device, repeats=5)
    assert timing.failure is None and timing.median_ms is not None and timing.median_ms > 0


@gpu
def test_capture_while_the_caller_keeps_a_graph_over_the_inputs() -> None:
    """An output of an earlier eager call kept alive keeps the inputs' gradient accumulators,
    made on the default stream; the capture takes its gradients at fresh leaves, so autograd
    does not sync with that stream inside the capture (which CUDA refuses)."""
    device = torch.device("cuda")
    inputs = _inputs("cuda")
    kept = mlp(**inputs)  # its graph, and the leaves' accumulators, stay alive below
    captured = capture_fwd_bwd(mlp, inputs, GRAD_ARGS, device)
    captured.graph.replay()
    torch.cuda.synchronize()
    eager = torch.autograd.grad(kept, list(inputs.values()), captured.cotangents)
    for name, got, want in zip(GRAD_ARGS, captured.grads, eager):
        torch.testing.assert_close(got, want, msg=lambda m, n=name: f"d{n}: {m}")
    timing = time_fwd_bwd_graphed(mlp, inputs, GRAD_ARGS, device, repeats=3)
    assert timing.failure is None, timing.failure


def _cuda_still_works() -> None:
    torch.cuda.synchronize()
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    assert torch.cuda.get_sync_debug_mode() == 0
    x = torch.arange(4.0, device="cuda")
    assert (x * 2).sum().item() == 12.0
    torch.randn(4, device="cuda")  # the default generator is not left marked as capturing
    # a later capture works and replays right (the allocator left no capture half-open)
    inputs = _inputs("cuda", ((8, 16), (16, 32)))
    captured = capture_fwd_bwd(mlp, inputs, GRAD_ARGS, torch.device("cuda"))
    captured.graph.replay()
    eager = torch.autograd.grad(mlp(**inputs), list(inputs.values()), captured.cotangents)
    torch.testing.assert_close(captured.grads[1], eager[1])


@gpu
def test_host_sync_gets_a_reason_and_cuda_still_works() -> None:
    timing = time_fwd_bwd_graphed(syncs_on_host, _inputs("cuda", ((64, 64), (64, 64))),
                                  GRAD_ARGS, torch.device("cuda"))
    print(timing.failure)
    assert timing.median_ms is None
    assert timing.failure.startswith("host sync: RuntimeError: ")
    assert "synchronizing" in timing.failure
    _cuda_still_works()


@gpu
def test_failed_capture_gets_a_reason_releases_its_pool_and_cuda_still_works() -> None:
    device = torch.device("cuda")
    inputs = _inputs("cuda", ((256, 256), (256, 256)))
    time_fwd_bwd(syncs_only_when_capturing, inputs, GRAD_ARGS, device, warmup=1, repeats=1)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved()
    with pytest.raises(GraphCaptureError, match="^capture failed: ") as info:
        capture_fwd_bwd(syncs_only_when_capturing, inputs, GRAD_ARGS, device)
    print(info.value)
    del info
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() == reserved, "the failed capture's pool was kept"
    timing = time_fwd_bwd_graphed(syncs_only_when_capturing, inputs, GRAD_ARGS, device)
    assert timing.median_ms is None and timing.failure.startswith("capture failed: ")
    _cuda_still_works()


def test_one_graph_capture_error_for_benchmarks_and_the_trainer() -> None:
    """The trainer's step capture raises the timing module's class: a user-facing error (the
    CLI's exit code) that callers catching RuntimeError still see."""
    from megacpp.errors import MegaCppError
    from megacpp.train import graphs

    assert graphs.GraphCaptureError is GraphCaptureError
    error = GraphCaptureError("capture failed: RuntimeError: x")
    assert isinstance(error, MegaCppError) and isinstance(error, RuntimeError)
    assert error.exit_code == MegaCppError.exit_code and str(error).startswith("capture failed")
