"""Launch settings of the RMSNorm kernels, by device: ``configs.json`` beside this file,
which ``benchmarks/moe_ce_probe.py --only rmsnorm --write`` rewrites for the device it ran on
(read-only at run time).

Rows of 512 columns or more ("wide") take ``fwd_rows`` rows per forward program and
``bwd_tile``-row backward tiles, ``bwd_programs_per_sm`` backward programs per SM. On an H100
at the nam56r-350m pre-norm (768 columns, float32 stream, bf16 residual and y, h routed
through the op) 4-row backward tiles at 2 programs per SM took its fwd+bwd from 223.5 to
215.9 us against 2-row tiles at 8 per SM (with fanout 2: 231.6 -> 225.6), and were the
fastest at 1024 columns too (288.0 -> 276.0).

Narrower rows (QK-norm, Mamba-3's B / C norms: 64 columns) would give 2-row tiles of 128
elements, too little work a program: their tiles hold at least ``narrow_fwd_elems`` /
``narrow_bwd_elems`` elements, with ``narrow_bwd_programs_per_sm`` backward programs per SM
(at 64 columns on an H100: q-norm forward 61.5 -> 17.4 us, backward 77.9 -> 35.5 us).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megacpp.kernels.launch import int_fields, read_table, write_entry

TABLE = Path(__file__).with_name("configs.json")
WIDE_COLUMNS = 512  # rows at least this wide take the "wide" settings


@dataclass(frozen=True)
class RMSNormConfig:
    fwd_rows: int
    bwd_tile: int
    bwd_programs_per_sm: int
    narrow_fwd_elems: int
    narrow_bwd_elems: int
    narrow_bwd_programs_per_sm: int


def _parse(entry: object, where: str) -> RMSNormConfig:
    return int_fields(RMSNormConfig, entry, where)


CONFIGS = read_table(TABLE, _parse)


def write_config(device_key: str, config: RMSNormConfig) -> None:
    """Record ``config`` as the setting of devices ``device_key`` in ``configs.json``."""
    write_entry(TABLE, device_key, {f: getattr(config, f) for f in config.__dataclass_fields__})
