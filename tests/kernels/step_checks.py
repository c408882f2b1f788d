"""Checks the fused decode-step kernels (``mamba3_step``, ``gated_delta_step``) share: a
kernel against its surface's reference over decode steps, in bf16 against float64 at a
preset's shapes, and replayed from a CUDA graph. Each takes the kernel, the reference and
the names of the state-pool tensors the step updates in place."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def clone(inputs: dict) -> dict:
    return {n: t.clone() if isinstance(t, torch.Tensor) else t for n, t in inputs.items()}


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    if not torch.isfinite(actual).all():
        return float("nan")
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


def step_errors(step: Callable, reference: Callable, state: Sequence[str], inputs: dict,
                steps: int = 1, padding: int = 0) -> dict[str, float]:
    """Relative errors of ``step`` against ``reference`` over ``steps`` decode steps (fresh
    in_proj outputs each step), on the real rows and their slots. ``padding`` extra rows at
    the end share one scratch slot outside the real rows' slots (as the engine pads)."""
    ours, ref = clone(inputs), clone(inputs)
    real = inputs["slots"]
    slots = torch.cat([real, torch.full((padding,), int(real.max()) + 1,
                                        dtype=real.dtype, device=real.device)])
    for pools in (ours, ref):
        for name in state:  # one more pool row for the scratch slot
            pools[name] = torch.cat([pools[name], pools[name][:1]])
        pools["slots"] = slots
    gen = torch.Generator(device=real.device).manual_seed(7)
    out = {}
    for t in range(steps):
        proj = torch.randn(len(slots), inputs["proj"].shape[1], generator=gen,
                           device=real.device).to(inputs["proj"].dtype)
        ours["proj"], ref["proj"] = proj, proj.clone()
        y, y_ref = step(**ours)[: len(real)], reference(**ref)[: len(real)]
        assert y.dtype == y_ref.dtype == proj.dtype and y.shape == y_ref.shape
        out[f"y{t}"] = rel(y, y_ref)
    rows = real.long()
    for name in state:
        out[name] = rel(ours[name][rows], ref[name][rows])
    return out


def check_bf16_against_float64(step: Callable, reference: Callable, state: Sequence[str],
                               inputs: dict) -> None:
    """bf16 in_proj output and parameters, float32 state (``inputs``, on CUDA): the kernel
    against the float64 reference of the same inputs, no further from it than the bf16
    reference is."""
    exact = {n: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
             for n, t in clone(inputs).items()}
    bf16_ref = clone(inputs)
    y = step(**inputs)
    y_exact, y_ref = reference(**exact), reference(**bf16_ref)
    assert rel(y, y_exact) <= 2 * rel(y_ref, y_exact) + 1e-3, (rel(y, y_exact),
                                                               rel(y_ref, y_exact))
    assert rel(y, y_ref) < 2e-2
    rows = inputs["slots"]
    for name in state:
        assert rel(inputs[name][rows], bf16_ref[name][rows]) < 1e-2, name


def check_graph_replay(step: Callable, reference: Callable, state: Sequence[str],
                       inputs: dict) -> None:
    """Captured once, replayed on new in_proj outputs: equals the eager reference (float32
    ``inputs`` on CUDA)."""
    ref = clone(inputs)
    step(**clone(inputs))  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # recorded, not run: the pool is still ref's
        y = step(**inputs)
    for t in range(3):
        proj = torch.randn_like(inputs["proj"])
        inputs["proj"].copy_(proj)
        ref["proj"] = proj
        graph.replay()
        y_ref = reference(**ref)
        assert rel(y, y_ref) < 1e-5, t
    for name in state:
        assert rel(inputs[name], ref[name]) < 1e-5, name
