"""Launch settings of the fused decode step, by device (read-only; no tuner writes them)."""

from __future__ import annotations

from types import MappingProxyType

from megacpp.kernels.launch import DEFAULT
from megacpp.kernels.step_kernels import StepConfig

# a program holds its [P, N] state tile (64 x 64 at nam56r-350m). Compiled for sm_90 at that
# shape (tests/kernels/test_mamba3_step.py): 127-128 registers and no spills at 4 warps in
# float32 math; float64 math spills 156 bytes at 4 warps, none at 8 (204 registers). Not timed
# against other settings on a GPU yet
CONFIGS = MappingProxyType({DEFAULT: StepConfig()})
