"""The kernel catalog: surfaces, backends, roles, requirements and fail-closed selection.

A *surface* is one op contract (shapes, dtypes, layout, what backward saves) with a plain
PyTorch reference. A *backend* implements a surface and has a *role*:

* ``chosen``   -- a fast backend the training path uses when it qualifies on the device.
* ``fallback`` -- the plain-PyTorch reference; used only when the caller allows it.
* ``donor``    -- a peer measured against (mamba_ssm, fla, Liger); never on the training path.
* ``deferred`` -- a real candidate not usable in this tree yet, with the reason.

:func:`select` walks the chosen backends in order and returns the first whose
:class:`Requirements` hold for a :class:`DeviceFacts`; otherwise it raises
:class:`KernelSelectionError` naming every candidate and why it was rejected -- unless the
caller explicitly allows the reference fallback, in which case the rejections travel with the
:class:`Selection` so a receipt can record them.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

import torch

from megacpp.errors import MegaCppError

Role = Literal["chosen", "fallback", "donor", "deferred"]
ROLES: tuple[Role, ...] = ("chosen", "fallback", "donor", "deferred")

DTYPE_NAMES = MappingProxyType({
    "float64": torch.float64, "float32": torch.float32,
    "bfloat16": torch.bfloat16, "float16": torch.float16,
})


class KernelSelectionError(MegaCppError):
    """No backend of a surface may run here (the message lists every candidate's reason)."""


class BackendUnsupported(MegaCppError):
    """A backend refuses inputs outside what it serves (a peer's narrower contract), before
    running anything; ``kernels check`` records the call as skipped, with this message."""


@dataclass(frozen=True)
class Surface:
    """One op contract and its plain-PyTorch reference.

    ``cases`` name input shapes (``"check"`` is the small one ``kernels check`` uses; the rest
    are benchmark shapes); ``make_inputs(case, dtype, device, generator)`` builds fresh random
    inputs for a case as keyword arguments, of which ``grad_args`` are differentiated.
    ``flops(inputs)`` / ``bytes_moved(inputs)`` give the fwd+bwd work (``None``: not counted).
    Surfaces without ``make_inputs`` are documented rows only (check/bench skip them)."""

    name: str
    contract: str  # shapes, dtypes, layout, what is saved for backward
    reference: Callable[..., Any]
    make_inputs: Callable[..., dict[str, Any]] | None = None
    cases: dict[str, dict[str, int]] = field(default_factory=dict)
    grad_args: tuple[str, ...] = ()
    flops: Callable[[dict[str, Any]], float] | None = None
    bytes_moved: Callable[[dict[str, Any]], float] | None = None


@dataclass(frozen=True)
class Requirements:
    """What a backend needs. Empty tuples / ``None`` mean "no constraint"."""

    devices: tuple[str, ...] = ()  # "cpu", "cuda"
    min_capability: tuple[int, int] | None = None
    max_capability: tuple[int, int] | None = None
    smem_bytes: int = 0  # dynamic shared memory per block it launches with
    packages: tuple[str, ...] = ()  # importable module names
    torch_ops: tuple[str, ...] = ()  # attributes of ``torch`` it calls, e.g. "_grouped_mm"
    dtypes: tuple[str, ...] = ()  # operand dtypes it accepts ("float32", "bfloat16", ...)

    def describe(self) -> str:
        parts = []
        if self.devices:
            parts.append("/".join(self.devices))
        if self.min_capability or self.max_capability:
            lo = ".".join(map(str, self.min_capability)) if self.min_capability else "any"
            hi = ".".join(map(str, self.max_capability)) if self.max_capability else "any"
            parts.append(f"sm {lo}..{hi}")
        if self.smem_bytes:
            parts.append(f"smem {self.smem_bytes // 1024} KiB")
        parts += [f"pkg {p}" for p in self.packages]
        parts += [f"torch.{op}" for op in self.torch_ops]
        if self.dtypes:
            parts.append(",".join(self.dtypes))
        return "; ".join(parts) or "none"


@dataclass(frozen=True)
class Backend:
    """One implementation of a surface. ``fn`` is ``None`` only for deferred rows and donors
    whose package is absent (the row still documents them). ``check_guard(facts)`` says why
    ``kernels check`` must not run a backend that qualifies on a device (a peer known to give
    wrong results or to fault on that stack; ``None``: it may run); list, bench and selection
    ignore it."""

    name: str
    surface: str
    role: Role
    requirements: Requirements
    fn: Callable[..., Any] | None
    reason: str = ""  # why this row has its role (mandatory for donor / deferred)
    check_guard: Callable[[DeviceFacts], str | None] | None = None

    @property
    def key(self) -> str:
        return f"{self.surface}/{self.name}"


@dataclass(frozen=True)
class DeviceFacts:
    """The device properties requirements are checked against (injectable for tests)."""

    type: str  # "cpu" | "cuda"
    name: str = "cpu"
    capability: tuple[int, int] | None = None
    max_smem_per_block: int | None = None
    packages: frozenset[str] = field(default_factory=frozenset)
    torch_ops: frozenset[str] = field(default_factory=frozenset)

    def to_dict(self) -> dict[str, Any]:
        cap = ".".join(map(str, self.capability)) if self.capability else None
        return {"type": self.type, "name": self.name, "capability": cap,
                "max_smem_per_block": self.max_smem_per_block}


@dataclass(frozen=True)
class Selection:
    """The outcome of :func:`select`: the backend and every candidate rejected on the way."""

    surface: str
    backend: Backend
    dtype: str
    device: DeviceFacts
    rejected: tuple[tuple[str, str], ...] = ()  # (backend name, reason)

    @property
    def fell_back(self) -> bool:
        return self.backend.role == "fallback"

    def to_dict(self) -> dict[str, Any]:
        return {"surface": self.surface, "backend": self.backend.name, "role": self.backend.role,
                "dtype": self.dtype, "device": self.device.to_dict(),
                "rejected": [{"backend": n, "reason": r} for n, r in self.rejected]}


class Catalog:
    """Surfaces and their backends, in registration order (the order chosen rows are tried)."""

    def __init__(self) -> None:
        self.surfaces: dict[str, Surface] = {}
        self.backends: list[Backend] = []

    def add_surface(self, surface: Surface) -> None:
        if surface.name in self.surfaces:
            raise ValueError(f"surface {surface.name!r} registered twice")
        self.surfaces[surface.name] = surface

    def add(self, backend: Backend) -> None:
        if backend.surface not in self.surfaces:
            raise ValueError(f"backend {backend.name!r} names unknown surface {backend.surface!r}")
        if backend.role not in ROLES:
            raise ValueError(f"backend {backend.key}: role {backend.role!r} not one of {ROLES}")
        if backend.role in ("donor", "deferred") and not backend.reason:
            raise ValueError(f"backend {backend.key}: a {backend.role} row needs a reason")
        if any(b.key == backend.key for b in self.backends):
            raise ValueError(f"backend {backend.key} registered twice")
        self.backends.append(backend)

    def surface(self, name: str) -> Surface:
        if name not in self.surfaces:
            raise KernelSelectionError(
                f"unknown kernel surface {name!r}; known: {', '.join(self.surfaces)}"
            )
        return self.surfaces[name]

    def of(self, surface: str, role: Role | None = None) -> list[Backend]:
        self.surface(surface)
        return [b for b in self.backends if b.surface == surface and role in (None, b.role)]

    def backend(self, surface: str, name: str) -> Backend:
        for b in self.of(surface):
            if b.name == name:
                return b
        names = ", ".join(b.name for b in self.of(surface))
        raise KernelSelectionError(f"surface {surface!r} has no backend {name!r}; known: {names}")


def rejection(backend: Backend, device: DeviceFacts, dtype: str) -> str | None:
    """Why ``backend`` cannot run on ``device`` with ``dtype`` operands, or ``None`` if it can."""
    if backend.role == "deferred":
        return f"deferred: {backend.reason}"
    if backend.fn is None:
        return "no implementation in this tree"
    req = backend.requirements
    if req.devices and device.type not in req.devices:
        return f"needs device {'/'.join(req.devices)}, have {device.type}"
    cap = device.capability
    if req.min_capability and (cap is None or cap < req.min_capability):
        return f"needs compute capability >= {_cap(req.min_capability)}, have {_cap(cap)}"
    if req.max_capability and (cap is None or cap > req.max_capability):
        return f"needs compute capability <= {_cap(req.max_capability)}, have {_cap(cap)}"
    if req.smem_bytes and (device.max_smem_per_block or 0) < req.smem_bytes:
        return (f"needs {req.smem_bytes} B shared memory per block, device allows "
                f"{device.max_smem_per_block}")
    missing = [p for p in req.packages if p not in device.packages]
    if missing:
        return f"package(s) not importable: {', '.join(missing)}"
    missing_ops = [op for op in req.torch_ops if op not in device.torch_ops]
    if missing_ops:
        return f"this torch lacks {', '.join('torch.' + op for op in missing_ops)}"
    if req.dtypes and dtype not in req.dtypes:
        return f"dtype {dtype} not in {', '.join(req.dtypes)}"
    return None


def select(
    catalog: Catalog, surface: str, device: DeviceFacts, dtype: str, *, allow_reference: bool = False
) -> Selection:
    """The first qualifying ``chosen`` backend; else the fallback if allowed; else raise."""
    if dtype not in DTYPE_NAMES:
        raise KernelSelectionError(f"dtype {dtype!r} not one of {', '.join(DTYPE_NAMES)}")
    rejected: list[tuple[str, str]] = []
    for backend in catalog.of(surface, "chosen"):
        reason = rejection(backend, device, dtype)
        if reason is None:
            return Selection(surface, backend, dtype, device, tuple(rejected))
        rejected.append((backend.name, reason))
    fallbacks = catalog.of(surface, "fallback")
    if allow_reference and fallbacks:
        return Selection(surface, fallbacks[0], dtype, device, tuple(rejected))
    rejected += [(b.name, f"{b.role}: {b.reason or 'not on the training path'}")
                 for b in catalog.of(surface) if b.role in ("donor", "deferred")]
    lines = "\n".join(f"  - {name}: {why}" for name, why in rejected) or "  (no chosen backend)"
    hint = (" (allow the reference with kernels='auto' or --allow-reference)"
            if fallbacks else "")
    raise KernelSelectionError(
        f"no chosen backend of {surface!r} qualifies on {device.type} ({device.name}) for "
        f"{dtype}{hint}:\n{lines}"
    )


# every package a backend's Requirements may name (tests/kernels/test_catalog.py checks it)
PROBED_PACKAGES = ("triton", "liger_kernel", "mamba_ssm", "tilelang", "fla", "flash_attn",
                   "flash_attn_interface", "torchao")


def device_facts(device: torch.device | str | None = None) -> DeviceFacts:
    """Facts about ``device`` (default: CUDA device 0 when present, else the CPU)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    packages = frozenset(p for p in PROBED_PACKAGES if _importable(p))
    ops = frozenset(op for op in ("_grouped_mm", "_scaled_mm", "compile") if hasattr(torch, op))
    if device.type != "cuda":
        return DeviceFacts(type=device.type, name=device.type, packages=packages, torch_ops=ops)
    props = torch.cuda.get_device_properties(device)
    smem = getattr(props, "shared_memory_per_block_optin", None)
    return DeviceFacts(type="cuda", name=props.name, capability=(props.major, props.minor),
                       max_smem_per_block=smem, packages=packages, torch_ops=ops)


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPE_NAMES.items():
        if value == dtype:
            return name
    raise KernelSelectionError(f"dtype {dtype} not one of {', '.join(DTYPE_NAMES)}")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _cap(cap: tuple[int, int] | None) -> str:
    return "none" if cap is None else f"{cap[0]}.{cap[1]}"


def smem_needs(selections: list[Selection]) -> list[Any]:
    """The selected backends' declared shared memory, as ``KernelSmem`` rows for
    ``megacpp.contract.require_preflight(..., kernels=...)`` (rows that declare none skipped)."""
    from megacpp.contract import KernelSmem

    return [KernelSmem(s.backend.key, s.backend.requirements.smem_bytes)
            for s in selections if s.backend.requirements.smem_bytes > 0]
