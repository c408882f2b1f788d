"""Launch settings and tile sizes of the Mamba-3 scan kernels, by device (read-only; no tuner
writes them), chosen by H100 sweeps at the bench's shape (B 8, L 4096, 32 heads, d_state 128)
and the nam56r-350m training step's (B 8, L 2048, 24 heads, d_state 64).

The kernels are latency-bound (ncu: long-scoreboard stalls after loads, one or two programs
per SM), so register caps (``maxnreg``) buy more programs per SM: ``_out_fwd`` 2 -> 3. With
the rotation table at L 4096: state tiles of 32 pairs, 437 -> 314 us (``_state_fwd``) and,
with ``_state_bwd`` capped at 128 registers (96 spilled 30), 630 -> 365 us (``_state_bwd``).
At both shapes: ``_prep`` at 2 warps (119 -> 87 us, 27 -> 22), ``_state_fwd`` at
``num_stages`` 2 (315 -> 286, 98 -> 85).

* ``narrow_launch`` replaces ``launch`` entries when the pairs pad to at most 32 (N2B <= 32:
  d_state <= 64): the smaller [T, N2B] tiles of ``_out_fwd`` fit 128 registers (145 -> 130
  us at the step's shape; at d_state 128 the cap spills: 474 -> 783).
* ``pairs``: the state tile of the sequential kernels, halved (down to 16) while their grid,
  B * H * N2B / pairs programs, would give an SM fewer than ``min_state_programs_per_sm``: at
  the step's shape 192 programs of 32 pairs on 132 SMs ran ``_state_fwd`` / ``_state_bwd`` in
  98 / 180 us, 384 of 16 pairs in 86 / 123; at the bench's (512 programs of 32) 16 pairs
  were slower (315 -> 432, 361 -> 489).
* ``dqk_pairs``: pairs per program of ``_bwd_dqk``; 32 halves its pair-dimension tiles, so at
  4 warps two programs fit an SM. 16 or 64 pairs, 8 warps and a 32-token chunk cap were all
  slower at both shapes (bench 4189 us of kernels, the best other 4979; step 1093 against
  1299).
* ``max_chunk``: the longest chunk the kernels run (any chunking computes the same function).
* ``final_chunks``: chunks' phi per load of ``_final`` (one at a time it took 50 us at L 4096).
* ``group_rows``: (token, group) rows per program of ``_group_sum``, whole head rows: 16 rows
  at 4 warps, 41 us at the step's shape (a split-row kernel took 95) and 195 at the bench's.
* ``min_bp``: the smallest headdim tile with 64-token chunks (a 32-wide one faulted on an
  H100).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from megacpp.errors import ConfigError
from megacpp.kernels.launch import DEFAULT, Launch

KERNELS = ("prep", "state_fwd", "out_fwd", "state_bwd", "bwd_dx", "bwd_dqk", "bwd_tokens",
           "final", "group_sum")


@dataclass(frozen=True)
class ScanConfig:
    """Every kernel's launch (``launch``; ``narrow_launch`` for d_state <= 64) and the tiles
    described above."""

    launch: Mapping[str, Launch]
    narrow_launch: Mapping[str, Launch]
    pairs: int
    min_state_programs_per_sm: int
    dqk_pairs: int
    max_chunk: int
    final_chunks: int
    group_rows: int
    min_bp: int

    def __post_init__(self) -> None:
        if set(self.launch) != set(KERNELS) or not set(self.narrow_launch) <= set(KERNELS):
            raise ConfigError(f"mamba3_scan launch settings: need exactly the kernels "
                              f"{list(KERNELS)}, got {sorted(self.launch)} (narrow: "
                              f"{sorted(self.narrow_launch)})")

    def options(self, kernel: str, n2b: int) -> dict[str, int]:
        """Triton launch options of ``kernel`` when the pairs pad to ``n2b``."""
        launch = self.narrow_launch.get(kernel) if n2b <= 32 else None
        return (launch or self.launch[kernel]).options()


_ONE_STAGE = Launch(num_warps=4, num_stages=1)

CONFIGS = MappingProxyType({
    DEFAULT: ScanConfig(
        launch=MappingProxyType({
            "prep": Launch(num_warps=2, num_stages=1),
            "state_fwd": Launch(num_warps=4, num_stages=2),
            "out_fwd": Launch(num_warps=4, num_stages=1, maxnreg=168),
            "state_bwd": Launch(num_warps=4, num_stages=2, maxnreg=128),
            "bwd_dx": _ONE_STAGE,
            "bwd_dqk": _ONE_STAGE,
            "bwd_tokens": _ONE_STAGE,
            "final": _ONE_STAGE,
            "group_sum": _ONE_STAGE,
        }),
        narrow_launch=MappingProxyType({
            "out_fwd": Launch(num_warps=4, num_stages=1, maxnreg=128),
        }),
        pairs=32, min_state_programs_per_sm=2, dqk_pairs=32, max_chunk=64, final_chunks=32,
        group_rows=16, min_bp=64,
    ),
})
