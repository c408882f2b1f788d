"""The column sums of a float32 [R, C] matrix of per-program partials, in Triton: the last
step of a weight or bias gradient that a backward kernel leaves as one row per program
(RMSNorm's dw, Mamba-3's q / k bias grads, short conv's weight grad).

``partials.sum(0)`` launches torch's generic reduction: 11 us per call for RMSNorm's
[1024, 768] partials in the nam56r-350m step on an H100 (57 such sums and ~110 narrower ones
cost 1.4 ms of the step). Here one program owns BLOCK_C columns and walks all rows in
[BLOCK_R, BLOCK_C] tiles, accumulating in float32 in a fixed order: the same bits on every
run for the same input layout (no atomics).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import torch
import triton
import triton.language as tl
from torch import Tensor

from megacpp.kernels.device import cdiv
from megacpp.kernels.launch import DEFAULT, for_device


@dataclass(frozen=True)
class SumRowsConfig:
    """[block_r, block_c] tiles at num_warps."""

    block_r: int
    block_c: int
    num_warps: int


# Launch settings by device (read-only; no tuner writes them). [32, 32] tiles at 4 warps: the
# fastest of six tile shapes on an H100 at the nam56r step's partials (per call: [1024, 768]
# 5.7 us against torch's 7.4, [528, 64] 3.6 vs 5.3, [256, 1536] 2.5 vs 5.4; [32, 64] tiles
# took 13.2 / 7.3 / 4.4).
CONFIGS = MappingProxyType({DEFAULT: SumRowsConfig(block_r=32, block_c=32, num_warps=4)})


@triton.jit
def _sum_rows(P, OUT, n_rows, n_cols, s_r, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < n_cols
    acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    for r0 in range(0, n_rows, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        mask = (rows < n_rows)[:, None] & col_ok[None, :]
        acc += tl.load(P + rows.to(tl.int64)[:, None] * s_r + cols[None, :], mask=mask, other=0.0)
    tl.store(OUT + cols, tl.sum(acc, axis=0), mask=col_ok)


def sum_rows(partials: Tensor, config: SumRowsConfig | None = None) -> Tensor:
    """partials [R, C] float32 (unit column stride) -> [C] float32, the sum over rows."""
    if partials.ndim != 2 or partials.dtype != torch.float32 or partials.stride(1) != 1:
        raise ValueError(f"sum_rows takes a float32 [R, C] matrix with unit column stride, got "
                         f"{partials.dtype} {tuple(partials.shape)} strides {partials.stride()}")
    n_rows, n_cols = partials.shape
    out = torch.empty(n_cols, device=partials.device, dtype=torch.float32)
    if n_rows == 0:
        return out.zero_()
    config = config or for_device(CONFIGS, partials.device)
    _sum_rows[(cdiv(n_cols, config.block_c),)](
        partials, out, n_rows, n_cols, partials.stride(0), BLOCK_R=config.block_r,
        BLOCK_C=config.block_c, num_warps=config.num_warps)
    return out
