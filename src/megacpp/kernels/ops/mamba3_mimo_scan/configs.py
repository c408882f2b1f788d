"""Launch settings of the MIMO scan's intra-chunk kernels, by device (read-only; no tuner
writes them). Not yet timed on a GPU: the default is an untuned starting point."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from megacpp.kernels.launch import DEFAULT


@dataclass(frozen=True)
class MimoIntraConfig:
    """Both kernels run one program per (row, chunk, head) at ``num_warps``."""

    num_warps: int


CONFIGS = MappingProxyType({
    DEFAULT: MimoIntraConfig(num_warps=4),
})
