"""Launch settings of the fused linear cross-entropy, by device (read-only; no tuner writes
them).

The CE row kernel (``_ce_rows``: lse, the loss, and the gradient written over the logits) on
an H100, a sweep of 112 settings on a [1024, 65536] bf16 chunk: 4096-column blocks, 32 warps,
one persistent program per SM (a row's second sweep finds it still in L2) took 118.6 us, where
16 warps, 2 programs per SM and a cross-warp reduction per block took 159.5. Logit chunks of
at most 128 MiB (1024 rows at V 65536 in bf16).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from megacpp.kernels.launch import DEFAULT


@dataclass(frozen=True)
class LinearCEConfig:
    """``chunk_bytes``: the most bytes of logits one token chunk holds; the row kernel's
    ``block`` (columns a load), ``num_warps`` and persistent ``programs_per_sm``."""

    chunk_bytes: int
    block: int
    num_warps: int
    programs_per_sm: int


CONFIGS = MappingProxyType({
    DEFAULT: LinearCEConfig(chunk_bytes=128 * 2**20, block=4096, num_warps=32,
                            programs_per_sm=1),
})
