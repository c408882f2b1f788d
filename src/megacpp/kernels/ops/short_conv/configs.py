"""Launch settings of the short conv kernels, by device (read-only; no tuner writes them).

H100, nam56r shape (B 8, L 2048, 1024 channels, 4 taps), fwd+bwd CUDA-graph replay: the
shipped setting 0.226-0.231 ms with ``dacc_blocks`` 1, 4 or 8 (within 2%).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from megacpp.kernels.launch import DEFAULT


@dataclass(frozen=True)
class ShortConvConfig:
    """Every kernel's program covers ``block_t`` tokens x ``block_c`` channels of one row at
    ``num_warps``; the weight-gradient pass walks ``dacc_blocks`` token blocks a program (one
    float32 weight partial each)."""

    block_t: int
    block_c: int
    num_warps: int
    dacc_blocks: int


CONFIGS = MappingProxyType({
    DEFAULT: ShortConvConfig(block_t=32, block_c=128, num_warps=4, dacc_blocks=4),
})
