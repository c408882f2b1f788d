"""What each ``ops/<surface>/spec.py`` declares its catalog rows with: the dtype sets and
device requirements the rows share, fast backends imported on first use, and random inputs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

import torch

from megacpp._compile import disable
from megacpp.kernels.catalog import Requirements

FLOATS = ("float32", "bfloat16", "float16")
HALF = ("bfloat16", "float16")
CUDA_SM80 = MappingProxyType({"devices": ("cuda",), "min_capability": (8, 0)})


def triton_sm80(dtypes: tuple[str, ...] = FLOATS) -> Requirements:
    """A Triton backend of ours: CUDA sm80+ with triton importable, operands in ``dtypes``."""
    return Requirements(packages=("triton",), dtypes=dtypes, **CUDA_SM80)


def lazy(module: str, attr: str) -> Callable[..., Any]:
    """A callable that imports ``module`` on first use (Triton / peers stay optional).

    Opaque to ``torch.compile``: a compiled model (``MEGACPP_KERNELS=fast``) runs our kernels
    as they are, between compiled regions (a graph break per call), instead of tracing into
    their host code."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), attr)(*args, **kwargs)

    call.__name__ = call.__qualname__ = f"{module}.{attr}"
    return disable(call)


def randn(shape: tuple[int, ...], dtype: torch.dtype, device: Any, gen: torch.Generator,
          scale: float = 1.0, grad: bool = True) -> torch.Tensor:
    """Standard normal ``shape`` drawn in float32, times ``scale``, cast to ``dtype``."""
    t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * scale
    return t.to(dtype).requires_grad_(grad)
