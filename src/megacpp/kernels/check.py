"""``kernels check``: every qualifying backend against the reference, forward and backward
(forward only for a surface without autograd), on fresh random inputs, by relative error
‖out − ref‖ / ‖ref‖ (reference in float64).

A backend that refuses the check case's inputs (:class:`BackendUnsupported`, a peer's narrower
contract) is skipped with its reason. One that raises anything else is a failed result with its
error, and the check goes on -- unless the error left the CUDA context unusable (an illegal
address is sticky: every later call in the process fails). Then :class:`CheckAborted` stops
the run, naming the backend, with the results so far."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from megacpp.errors import MegaCppError, describe_error
from megacpp.kernels.catalog import (
    DTYPE_NAMES,
    Backend,
    BackendUnsupported,
    Catalog,
    DeviceFacts,
    Surface,
    rejection,
)

# relative-error tolerance by operand dtype (float32: ~1e-5; bf16 operands: 1e-3..1e-2)
TOLERANCE = MappingProxyType({"float64": 1e-10, "float32": 1e-5, "bfloat16": 1e-2,
                              "float16": 5e-3})


@dataclass
class CheckResult:
    surface: str
    backend: str
    dtype: str
    errors: dict[str, float] = field(default_factory=dict)  # "out" / "d<arg>" -> rel. error
    tolerance: float = 0.0
    skipped: str | None = None  # why it was not run
    error: str | None = None  # what the backend raised, when it did

    @property
    def passed(self) -> bool:
        return self.skipped is None and self.error is None and all(
            not math.isnan(e) and e <= self.tolerance for e in self.errors.values()
        )

    @property
    def worst(self) -> float:
        return max(self.errors.values(), default=float("nan"))


def outputs_of(result: Any) -> list[Tensor]:
    """The floating-point tensors a backend returned (a tensor, or a tuple of them)."""
    items = result if isinstance(result, (tuple, list)) else (result,)
    return [t for t in items if isinstance(t, Tensor) and t.is_floating_point()]


def forward_backward(
    fn: Callable[..., Any], inputs: dict[str, Any], grad_args: tuple[str, ...],
    cotangents: list[Tensor] | None = None,
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """Run ``fn(**inputs)`` and backprop random (or given) cotangents into ``grad_args``.
    Returns (outputs, grads, cotangents). A surface without grad args (no autograd: an
    optimizer pass) is checked by its outputs alone: no grads."""
    outs = outputs_of(fn(**inputs))
    if not grad_args:
        return outs, [], []
    if cotangents is None:
        cotangents = [torch.randn_like(o, dtype=torch.float32) for o in outs]
    loss = sum((o.to(c.dtype) * c.to(o.device)).sum() for o, c in zip(outs, cotangents))
    grads = torch.autograd.grad(loss, [inputs[name] for name in grad_args])
    return outs, list(grads), cotangents


def _fresh(inputs: dict[str, Any], grad_args: tuple[str, ...], dtype: torch.dtype | None):
    """Detached copies (floating tensors cast to ``dtype`` when given) with grads re-enabled."""
    out = {}
    for name, value in inputs.items():
        if isinstance(value, Tensor):
            value = value.detach()
            if dtype is not None and value.is_floating_point():
                value = value.to(dtype)
            value = value.requires_grad_(name in grad_args)
        out[name] = value
    return out


def relative_error(out: Tensor, ref: Tensor) -> float:
    out64, ref64 = out.detach().double(), ref.detach().double()
    if not torch.isfinite(out64).all():
        return float("nan")
    return float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30))


def check_backend(
    surface: Surface, backend: Backend, device: torch.device, dtype: str, seed: int
) -> CheckResult:
    """One backend, one dtype: fresh inputs, outputs and input-gradients vs float64 ref."""
    result = CheckResult(surface.name, backend.name, dtype, tolerance=TOLERANCE[dtype])
    gen = torch.Generator(device=device).manual_seed(seed)
    inputs = surface.make_inputs(surface.cases["check"], DTYPE_NAMES[dtype], device, gen)
    ref_outs, ref_grads, cot = forward_backward(
        surface.reference, _fresh(inputs, surface.grad_args, torch.float64), surface.grad_args)
    outs, grads, _ = forward_backward(
        backend.fn, _fresh(inputs, surface.grad_args, None), surface.grad_args, cot)
    for i, (o, r) in enumerate(zip(outs, ref_outs)):
        result.errors["out" if i == 0 else f"out{i}"] = relative_error(o, r)
    for name, g, r in zip(surface.grad_args, grads, ref_grads):
        result.errors[f"d{name}"] = relative_error(g, r)
    return result


class CheckAborted(MegaCppError):
    """A backend's error left the device unusable; ``results`` holds every result so far (the
    failing one last)."""

    def __init__(self, message: str, results: list[CheckResult]):
        super().__init__(message)
        self.results = results


def device_usable(device: torch.device) -> bool:
    """Whether the device still runs work: a CUDA error such as an illegal address is sticky,
    and every later launch or synchronize in the process raises it again."""
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        torch.ones(1, device=device).add_(1).item()
    except Exception:  # noqa: BLE001 -- any failure here means the context is gone
        return False
    return True


def check_catalog(
    catalog: Catalog, device: torch.device, facts: DeviceFacts, dtypes: list[str],
    surfaces: list[str] | None = None, seed: int = 0, on_result: Callable | None = None,
) -> list[CheckResult]:
    """Check every backend with an implementation that qualifies here, for each dtype; a
    backend whose ``check_guard`` objects on this device is skipped with its reason."""
    results = []
    for name in surfaces or list(catalog.surfaces):
        surface = catalog.surface(name)
        for backend in catalog.of(name):
            if backend.role == "deferred":
                continue
            for dtype in dtypes:
                why = rejection(backend, facts, dtype)
                if why is None and backend.check_guard is not None:
                    why = backend.check_guard(facts)
                if surface.make_inputs is None:
                    why = "surface has no check inputs (documented row)"
                if why:
                    result = CheckResult(name, backend.name, dtype, skipped=why)
                else:
                    try:
                        result = check_backend(surface, backend, device, dtype, seed)
                    except BackendUnsupported as exc:  # a peer's narrower contract
                        result = CheckResult(name, backend.name, dtype, skipped=str(exc))
                    except Exception as exc:  # noqa: BLE001 -- this backend's failure
                        result = CheckResult(name, backend.name, dtype,
                                             tolerance=TOLERANCE[dtype], error=describe_error(exc))
                results.append(result)
                if on_result is not None:
                    on_result(result)
                if result.error is not None and not device_usable(device):
                    raise CheckAborted(
                        f"{name}/{backend.name} ({dtype}) failed with {result.error}, and the "
                        f"{device.type} device is unusable after it; the remaining checks did "
                        "not run (rerun with --surface to check the others)", results)
    return results
