"""Launch settings of the fused decode step, by device (read-only; no tuner writes them)."""

from __future__ import annotations

from types import MappingProxyType

from megacpp.kernels.launch import DEFAULT
from megacpp.kernels.step_kernels import StepConfig

# a program holds its [K, V] state tile (64 x 128 at nam56r-350m). Compiled for sm_90 at that
# shape (tests/kernels/test_gated_delta_step.py): 102-107 registers and no spills at 8 warps in
# float32 math (168 at 4 warps); float64 math spills 272 bytes at 16 warps (128 registers, the
# most a thread gets there) and 624 at 8: float64 is the precision path, not a speed one. Not
# timed against other settings on a GPU yet
CONFIGS = MappingProxyType({DEFAULT: StepConfig(num_warps=8, num_warps_small=4, large_tile=8192,
                                                num_warps_f64=16)})
