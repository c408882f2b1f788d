"""How the model asks the catalog for a backend, and the record of what it got.

The mode is a process-wide runtime flag (environment ``MEGACPP_KERNELS`` or
:func:`set_kernel_mode`), so the model's constructors and the trainer's API stay unchanged:

* ``reference`` (default) -- the plain-PyTorch reference everywhere; numerics as before.
* ``auto``   -- the chosen backend where it qualifies, else the reference (allowed
  explicitly by choosing this mode; the fallback and its reasons are recorded).
* ``fast``   -- the chosen backend or a :class:`KernelSelectionError` (fail closed).

Under ``torch.compile`` both ``auto`` and ``fast`` call the chosen backend, opaque to the
compiler (a graph break per call), so a compiled model runs the same kernels as an eager one.
``megacpp train`` picks ``auto`` on CUDA by default (:mod:`megacpp.train.modes`).
:func:`chosen_kernels` returns ``{surface: backend}`` of every resolution so far, the
``kernels=`` field of a receipt.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from megacpp._compile import disable
from megacpp.errors import ConfigError
from megacpp.kernels.amp import effective_dtype
from megacpp.kernels.catalog import Backend, Selection, device_facts, dtype_name, select
from megacpp.kernels.registry import default_catalog

KERNEL_MODES = ("reference", "auto", "fast")
ENV_VAR = "MEGACPP_KERNELS"

_mode: str | None = None
_resolved: dict[tuple[str, str, str, str], Selection] = {}


def kernel_mode() -> str:
    """The current mode (``MEGACPP_KERNELS`` unless :func:`set_kernel_mode` was called)."""
    mode = _mode if _mode is not None else os.environ.get(ENV_VAR, "reference")
    if mode not in KERNEL_MODES:
        raise ConfigError(f"{ENV_VAR}={mode!r} is not one of {', '.join(KERNEL_MODES)}")
    return mode


def kernel_mode_setting() -> tuple[str, str] | None:
    """The mode and who set it (``set_kernel_mode`` by the caller, or ``MEGACPP_KERNELS``),
    or None when neither did and a caller's own default applies."""
    if _mode is not None:
        return _mode, "set by the caller (set_kernel_mode)"
    if ENV_VAR in os.environ:
        return kernel_mode(), f"{ENV_VAR}={os.environ[ENV_VAR]}"
    return None


def set_kernel_mode(mode: str | None) -> None:
    """Set the mode for this process (``None``: back to the environment variable)."""
    global _mode
    if mode is not None and mode not in KERNEL_MODES:
        raise ConfigError(f"kernel mode {mode!r} is not one of {', '.join(KERNEL_MODES)}")
    _mode = mode


@contextmanager
def kernel_mode_override(mode: str) -> Iterator[None]:
    """Temporarily run under ``mode``."""
    previous = _mode
    set_kernel_mode(mode)
    try:
        yield
    finally:
        set_kernel_mode(previous)


def resolve(surface: str, like: torch.Tensor) -> Backend:
    """The backend for ``surface`` on ``like``'s device and dtype under the current mode.

    Under ``torch.autocast`` a float32 ``like`` selects for the autocast dtype (the dtype its
    matmuls run in); see :mod:`megacpp.kernels.amp`."""
    mode = kernel_mode()
    key = (surface, str(like.device), dtype_name(effective_dtype(like)), mode)
    if key not in _resolved:
        _resolved[key] = _select(surface, like.device, key[2], mode)
    return _resolved[key].backend


@disable
def _select(surface: str, device: torch.device, dtype: str, mode: str) -> Selection:
    """A selection not made before. Opaque to torch.compile: a first call under tracing is one
    graph break here, instead of dynamo tracing the catalog's construction (it ignores
    ``functools.cache``), which broke the graph at every backend's ``torch.compiler.disable``
    and compiled each lazily imported callable as a frame of its own (the recompile limit for
    ``declare.lazy`` is hit once the catalog has more than 8 such rows)."""
    catalog = default_catalog()
    if mode == "reference":
        fallback = catalog.of(surface, "fallback")[0]
        return Selection(surface, fallback, dtype, device_facts(device))
    return select(catalog, surface, device_facts(device), dtype, allow_reference=mode == "auto")


def chosen_kernels() -> dict[str, str]:
    """``{surface: backend name}`` of every resolution so far (the last one per surface)."""
    return {surface: sel.backend.name for (surface, *_), sel in _resolved.items()}


def resolutions() -> list[Selection]:
    """Every selection made so far, with the candidates each rejected."""
    return list(_resolved.values())


def clear_resolutions() -> None:
    _resolved.clear()
