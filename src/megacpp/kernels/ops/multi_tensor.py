"""A multi-tensor launch: one Triton launch over a list of tensors of different sizes,
through a table of their addresses (int64, on the device) -- one program per (block of a
tensor, tensor) -- as a multi-tensor apply does. Muon's momentum and weight-update passes
(``ops/muon_momentum``, ``ops/muon_apply``) launch this way.

One table per launch is copied from pinned host memory and kept with the optimizer state
(``keep``): a CUDA graph captures that copy, and its replays copy the same addresses again
(the graph's tensors never move).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from megacpp.kernels.device import cdiv


@dataclass(frozen=True)
class MultiTensorConfig:
    """Elements per program and warps of a multi-tensor launch."""

    block: int
    num_warps: int


def check_float32(name: str, tensors: list[Tensor]) -> None:
    """Every tensor contiguous float32 on CUDA (``name`` says which list in the error)."""
    for t in tensors:
        if t.dtype != torch.float32 or not t.is_contiguous() or not t.is_cuda:
            raise ValueError(f"{name}: the fused Muon passes take contiguous float32 CUDA "
                             f"tensors, got {t.dtype} {tuple(t.shape)} on {t.device}"
                             f"{'' if t.is_contiguous() else ' (not contiguous)'}")


def address_table(rows: list[list[int]], device: torch.device, keep: list[Tensor]) -> Tensor:
    """``rows`` (addresses, element counts, offsets) as one contiguous int64 [len(rows), n]
    on ``device``, copied from pinned memory; the pinned source goes into ``keep``, alive as
    long as whoever captured the copy."""
    host = torch.tensor(rows, dtype=torch.int64).pin_memory()
    keep.append(host)
    return host.to(device, non_blocking=True)


def offsets(tensors: list[Tensor]) -> list[int]:
    """Where each tensor starts in their concatenation (element offsets)."""
    starts, total = [], 0
    for t in tensors:
        starts.append(total)
        total += t.numel()
    return starts


def check_stacked(name: str, stacked: Tensor, tensors: list[Tensor]) -> None:
    """``stacked`` is contiguous and holds exactly the elements of ``tensors``."""
    total = sum(t.numel() for t in tensors)
    if not stacked.is_contiguous() or stacked.numel() != total:
        raise ValueError(f"{name}: a contiguous tensor of {total} elements, got "
                         f"{tuple(stacked.shape)}")


def grid(tensors: list[Tensor], block: int) -> tuple[int, int]:
    """(blocks of the largest tensor, tensors): the launch grid of ``block``-element blocks."""
    return cdiv(max(t.numel() for t in tensors), block), len(tensors)
