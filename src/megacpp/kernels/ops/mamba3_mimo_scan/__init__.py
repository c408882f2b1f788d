"""Mamba-3 MIMO scan (the SISO scan with rank-R inputs and outputs per head):
``reference.py`` (the plain-PyTorch recurrent and chunked forms, the state shapes and the
FLOP count, exported here) and ``spec.py`` (the catalog entry). The state type is the SISO
scan's :class:`~megacpp.kernels.ops.mamba3_scan.Mamba3ScanState`."""

from megacpp.kernels.ops.mamba3_mimo_scan.reference import (
    flops_per_token,
    mamba3_mimo_scan_chunked,
    mamba3_mimo_scan_recurrent,
    mimo_state_shapes,
    zero_mimo_state,
)

__all__ = [
    "flops_per_token",
    "mamba3_mimo_scan_chunked",
    "mamba3_mimo_scan_recurrent",
    "mimo_state_shapes",
    "zero_mimo_state",
]
