"""Launch settings of the fused decode step, by device (read-only; no tuner writes them)."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from megacpp.kernels.launch import DEFAULT


@dataclass(frozen=True)
class StepConfig:
    """Warps of one (head, row) program: ``num_warps`` for a state tile of at least
    ``large_tile`` elements (P x N padded to powers of two), ``num_warps_small`` below it."""

    num_warps: int = 4
    num_warps_small: int = 2
    large_tile: int = 4096


# a program holds its [P, N] float32 state tile (64 x 64 at nam56r-350m: 32 registers a thread
# at 4 warps); not swept on a GPU yet
CONFIGS = MappingProxyType({DEFAULT: StepConfig()})
