"""Launch settings of the ``document_attention`` surface (read-only; no tuner writes them):
FlexAttention's kernel options per device and head dim, and the block-tile kernel's.

FlexAttention on an H100 (sm90) at head dim 64 in bf16 / fp16: 64-row forward tiles and
64 x 64 backward tiles at 4 warps, 3 stages. Inductor's defaults there (forward 128 x 128 at
4 warps; backward M1 64, N1 128, M2 128, N2 64 at 8 warps) replayed the nam56r step's shape
(B 8, H 12 / 2, L 2048) in 0.946 ms fwd+bwd a layer with 2 documents a row, these in 0.725
(8 documents a row: 0.605 -> 0.485), the forward alone 0.252 -> 0.171 ms; `megacpp train`
ran 101.3 -> 99.0 ms a step. They walk the same 64-row q blocks and 64-column kv blocks in
the same order as the defaults, so results are the defaults' bit for bit. Settings that lost
there: 128-row forward tiles, 32-row or 128-column backward tiles, 8 backward warps, 1 or 5
stages, TMA loads. Inductor orders the backward tiles (M1, N1, M2, N2); its template asserts
N1 % M1 == 0 and M2 % N2 == 0. Every other device and head dim keeps Inductor's own choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from megacpp.kernels.launch import DEFAULT


@dataclass(frozen=True)
class FlexOptions:
    """FlexAttention ``kernel_options`` for bf16 / fp16 queries of ``head_dim`` on a device of
    compute capability ``capability``."""

    capability: tuple[int, int]
    head_dim: int
    options: tuple[tuple[str, int], ...]

    def as_dict(self) -> dict[str, int]:
        return dict(self.options)


FLEX_OPTIONS: tuple[FlexOptions, ...] = (
    FlexOptions(capability=(9, 0), head_dim=64, options=(
        ("fwd_BLOCK_M", 64), ("fwd_BLOCK_N", 128), ("fwd_num_stages", 3), ("fwd_num_warps", 4),
        ("bwd_BLOCK_M1", 64), ("bwd_BLOCK_N1", 64), ("bwd_BLOCK_N2", 64), ("bwd_BLOCK_M2", 64),
        ("bwd_num_stages", 3), ("bwd_num_warps", 4))),
)


@dataclass(frozen=True)
class TilesConfig:
    """The block-tile kernel: rows of at most ``max_blocks`` 128-token tiles take it (longer
    ones the torch code: its [NB, NB] tiles live in registers), at ``num_warps``."""

    max_blocks: int
    num_warps: int


TILES_CONFIGS = MappingProxyType({DEFAULT: TilesConfig(max_blocks=64, num_warps=4)})
