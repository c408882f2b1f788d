"""Device facts the Triton launchers size their grids by (cached per device)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device. Callers choose their own value for the CPU
    interpreter, where there is no such count."""
    return torch.cuda.get_device_properties(device).multi_processor_count
