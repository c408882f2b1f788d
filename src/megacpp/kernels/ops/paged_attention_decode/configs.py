"""Launch settings of the paged decode attention, by device (read-only; no tuner writes them)."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from megacpp.kernels.launch import DEFAULT


@dataclass(frozen=True)
class DecodeConfig:
    """``block_n`` keys per loop step of a program (at least 16: a ``tl.dot`` operand);
    the keys are split over programs (flash-decoding) until about ``target_programs`` run
    (row x K/V head x split), never finer than ``block_n`` keys a split; ``num_warps`` per
    program."""

    block_n: int = 64
    target_programs: int = 264
    num_warps: int = 4


# 264: two programs per SM of an H100 (132 SMs), so B=64 rows x 2 K/V heads (nam56r-350m)
# split the keys in two and B=1 in up to 128 (one 64-key tile each). Not timed against other
# settings on a GPU yet
CONFIGS = MappingProxyType({DEFAULT: DecodeConfig()})
