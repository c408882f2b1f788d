"""Launch settings of the MoE expert path's Triton kernels, by device (read-only; no tuner
writes them). Every number below was measured on an H100 (132 SMs, Triton 3.6).

* The row scatter (the permute): 16 tokens a program, 1024 columns a step, 8 warps -- 115 us
  at e64 against a gather by token's 162, 41 against 51 at e16.
* The weight gradients (:func:`~megacpp.kernels.ops.moe_experts.gemm.grouped_wgrad_triton`):
  128 x 256 x 64 tiles at 8 warps, 4 stages, or 64 x 256 at 4 warps where those fill the
  waves better (``wgrad_setting``: the step's dw_out, M 272, N 768, 16 experts, 45.1 vs 57.7
  us; where the waves tie, dw_in and the bench cases, 128 x 256 was 6-9% faster). Against
  torch._grouped_mm + a cast: the step's dw_in 64.9 vs 102.8 us, e64 / e16 dw_in 534 / 525 vs
  666 / 648.
* The expert GEMMs (:func:`~megacpp.kernels.ops.moe_experts.gemm.grouped_mm_triton`) serve
  only the (N, K) shapes in ``grouped``, where they measured faster than torch._grouped_mm
  (CUTLASS) in one process: at the nam56r step's 32768 rows (16 experts) gate|up (N 544,
  K 768) 72.5 vs 82.2 us, d hidden (N 272, K 768) 51.3 vs 62.8; at e64_k8's d hidden (N 512,
  K 1024, 131072 rows) 241.5 vs 268.0. Where they lost or tied (down with K 272: 63.4 vs 56.2;
  dx, N 768 K 544: 67.7-72.1 vs 70.0-71.6; the e16_k2 shapes) CUTLASS serves. Two programs of
  4 warps per SM (3 stages of 128 x 128 x 64, 96 KiB of shared memory) beat one of 8 warps or
  4 stages at the step's shapes.
* gate|up with the SwiGLU in the epilogue (``swiglu``, (2F, K)): 64 hidden columns a program
  (64 gate and 64 up columns in two accumulators) at 8 warps, timed as CUDA graphs of 10
  calls against torch._grouped_mm then the SwiGLU kernel: the step's shape 80.6 vs 106.4 us,
  e16_k2 (2F 4096, d 1024) 553.6 vs 598.1, e64_k8 (2F 1024, d 1024) 606.8 vs 600.4 (level).
  Slower there: 256-row blocks, K blocks of 32 / 128, 4 warps, 2 or 4 stages, 32 / 128
  columns a program.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from megacpp.kernels.launch import DEFAULT


@dataclass(frozen=True)
class Tile:
    """A GEMM kernel's launch: [block_m, block_n] output tiles, K blocks of block_k."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class MoEConfig:
    """Every launch setting of the expert path on one kind of device.

    ``plan_block`` / ``plan_warps``: (token, choice) pairs per program of the two plan
    kernels, and their warps.
    ``scatter_*``: tokens per program, columns per step and warps of the row scatter.
    ``gather_block`` / ``gather_warps``: columns per program of the gather-sum.
    ``swiglu_cols`` / ``swiglu_elems`` / ``swiglu_warps``: the SwiGLU kernels' F block (at
    most) and the rows x F elements of one program.
    ``wgrad``: the weight-gradient kernel's settings (the first is the default; empty: the
    weight gradients stay on torch._grouped_mm).
    ``grouped``: (N, K) -> setting of the expert-GEMM kernel; ``swiglu``: (2F, K) -> setting
    of gate|up with the SwiGLU in the epilogue; shapes not listed stay on torch._grouped_mm.
    """

    plan_block: int
    plan_warps: int
    scatter_tokens: int
    scatter_cols: int
    scatter_warps: int
    gather_block: int
    gather_warps: int
    swiglu_cols: int
    swiglu_elems: int
    swiglu_warps: int
    wgrad: tuple[Tile, ...]
    grouped: Mapping[tuple[int, int], Tile]
    swiglu: Mapping[tuple[int, int], Tile]


_TILE_4W = Tile(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=3)
_SWIGLU_64 = Tile(block_m=128, block_n=64, block_k=64, num_warps=8, num_stages=3)

CONFIGS = MappingProxyType({
    DEFAULT: MoEConfig(
        plan_block=1024, plan_warps=4, scatter_tokens=16, scatter_cols=1024, scatter_warps=8,
        gather_block=2048, gather_warps=4, swiglu_cols=512, swiglu_elems=4096, swiglu_warps=8,
        wgrad=(Tile(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4),
               Tile(block_m=64, block_n=256, block_k=64, num_warps=4, num_stages=4)),
        grouped=MappingProxyType({
            (544, 768): _TILE_4W,
            (272, 768): _TILE_4W,
            (512, 1024): Tile(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4),
        }),
        swiglu=MappingProxyType({
            (544, 768): _SWIGLU_64,
            (1024, 1024): _SWIGLU_64,
            (4096, 1024): _SWIGLU_64,
        }),
    ),
})
