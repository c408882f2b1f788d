"""Launch settings of the symmetric polynomial kernel, by device (read-only; no tuner
writes them)."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from megacpp.kernels.launch import DEFAULT


@dataclass(frozen=True)
class PolynomialConfig:
    """[BM, BM] output tiles, K blocks of BK, warps and pipeline stages."""

    block_m: int
    block_k: int
    num_warps: int
    num_stages: int


# BM 128, BK 64, 4 warps, 3 stages: the fastest of 14 settings, or within 2% of it, at every
# nam56r-350m Muon shape on an H100 (at the MoE experts' 391 x [544, 544], 305 us per call
# against cuBLAS's 515). The kernel needs sm90+ (tensor-memory loads).
CONFIGS = MappingProxyType({
    DEFAULT: PolynomialConfig(block_m=128, block_k=64, num_warps=4, num_stages=3),
})
