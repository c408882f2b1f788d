"""Launch settings of the fused weight update, by device (read-only; no tuner writes them)."""

from __future__ import annotations

from types import MappingProxyType

from megacpp.kernels.launch import DEFAULT
from megacpp.kernels.ops.multi_tensor import MultiTensorConfig

# 4096 elements a program at 8 warps on every device (a memory-bound pass: one read and one
# write per element)
CONFIGS = MappingProxyType({DEFAULT: MultiTensorConfig(block=4096, num_warps=8)})
