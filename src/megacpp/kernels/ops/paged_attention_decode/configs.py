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
    program for 16-bit inputs, ``num_warps_f32`` for float32 (full-precision dots)."""

    block_n: int = 64
    target_programs: int = 264
    num_warps: int = 4
    num_warps_f32: int = 8


# 264: two programs per SM of an H100 (132 SMs), so B=64 rows x 2 K/V heads (nam56r-350m)
# split 384 keys in three and B=1 in six (one 64-key tile each). Compiled for sm_90 at that
# shape (tests/kernels/test_paged_attention_decode.py): bf16 212 registers at 4 warps, float32
# 238 at 8 (868 bytes spilled at 4); no spills. Not timed against other settings on a GPU yet
CONFIGS = MappingProxyType({DEFAULT: DecodeConfig()})


def split_keys(batch: int, kv_heads: int, n_keys: int, config: DecodeConfig) -> tuple[int, int]:
    """(splits, keys per split) for a launch: a function of the shapes only (a table of
    ``n_keys`` slots), so a captured graph's grid is fixed. Splits until about
    ``config.target_programs`` programs run, each split a whole number of ``block_n`` tiles."""
    tiles = -(-n_keys // config.block_n)
    want = -(-config.target_programs // max(1, batch * kv_heads))
    splits = max(1, min(tiles, want))
    tiles_per_split = -(-tiles // splits)
    splits = -(-tiles // tiles_per_split)  # no split left without a tile of the table
    return splits, tiles_per_split * config.block_n
