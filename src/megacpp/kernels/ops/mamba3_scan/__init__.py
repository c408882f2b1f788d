"""Mamba-3 SISO scan (exponential-trapezoidal SSM with data-dependent rotations):
``reference.py`` (the plain-PyTorch forms and the state type, exported here), the Triton
kernels (``op.py``, ``chunk_fwd.py``, ``chunk_bwd.py``, ``common.py``), ``configs.py`` (their
launch settings) and ``spec.py`` (the catalog entry)."""

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
