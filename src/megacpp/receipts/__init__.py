"""megacpp.receipts: every result carries the environment that produced it.

- :func:`write_receipt` -- capture the fingerprint and write a versioned JSON receipt;
- :func:`read_receipt` -- read and validate one (clear errors for corrupt files);
- :func:`compare_receipts` -- metric ratios, refused when the environments drifted;
- :func:`mark_golden` -- bless a receipt from a clean, verified environment.
"""

from megacpp.receipts.compare import Comparison, DriftError, MetricRow, compare_receipts
from megacpp.receipts.schema import (
    KINDS,
    RECEIPT_SCHEMA,
    RECEIPT_VERSION,
    Artifact,
    Receipt,
    ReceiptError,
)
from megacpp.receipts.store import (
    golden_problems,
    mark_golden,
    read_receipt,
    verify_artifacts,
    write_receipt,
)

__all__ = [
    "KINDS",
    "RECEIPT_SCHEMA",
    "RECEIPT_VERSION",
    "Artifact",
    "Comparison",
    "DriftError",
    "MetricRow",
    "Receipt",
    "ReceiptError",
    "compare_receipts",
    "golden_problems",
    "mark_golden",
    "read_receipt",
    "verify_artifacts",
    "write_receipt",
]
