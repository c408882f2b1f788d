"""Launch settings of the fused decode step, by device (read-only; no tuner writes them)."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from megacpp.kernels.launch import DEFAULT


@dataclass(frozen=True)
class StepConfig:
    """Warps of one (head, row) program: ``num_warps`` for a state tile of at least
    ``large_tile`` elements (K x V padded to powers of two), ``num_warps_small`` below it;
    ``num_warps_f64`` for float64 math at any size."""

    num_warps: int = 4
    num_warps_small: int = 2
    large_tile: int = 4096
    num_warps_f64: int = 8


# a program holds its [K, V] state tile (64 x 128 at nam56r-350m); not timed against other
# settings on a GPU yet
CONFIGS = MappingProxyType({DEFAULT: StepConfig()})
