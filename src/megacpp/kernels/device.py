"""Device facts the Triton launchers size their grids by (cached per device), and the integer
arithmetic they size them with.

Host time matters where a call issues many small launches (the MoE's forward issues three small
ones before its first GEMM, each on an idle GPU): ``torch.cuda.get_device_capability`` costs ~5 us
per call on the H100 machine, and Triton 3.6's ``triton.cdiv`` / ``triton.next_power_of_2``
are ``ConstexprFunction`` objects whose host call costs 1.7-3.8 us, where these plain-int
versions cost ~0.1 us."""

from __future__ import annotations

import functools

import torch


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device. Callers choose their own value for the CPU
    interpreter, where there is no such count."""
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def capability(device: torch.device) -> tuple[int, int]:
    """``torch.cuda.get_device_capability`` of a CUDA device, cached."""
    return torch.cuda.get_device_capability(device)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints (b > 0): ``triton.cdiv`` on the host."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for n <= 0, as ``triton.next_power_of_2`` gives for 0)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
