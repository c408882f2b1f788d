"""Mamba-3 SISO scan (exponential-trapezoidal SSM with data-dependent rotations)."""

from megacpp.kernels.ops.mamba3_scan.reference import (
    Mamba3ScanState,
    flops_per_token,
    mamba3_scan_chunked,
    mamba3_scan_recurrent,
    zero_scan_state,
)

__all__ = [
    "Mamba3ScanState",
    "flops_per_token",
    "mamba3_scan_chunked",
    "mamba3_scan_recurrent",
    "zero_scan_state",
]
