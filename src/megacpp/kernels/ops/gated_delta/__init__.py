"""The gated delta rule (Gated DeltaNet): ``reference.py`` (the plain-PyTorch forms and their
FLOP count, exported here), the Triton kernels (``op.py``, ``chunk_fwd.py``, ``chunk_bwd.py``,
``common.py``), ``configs.py`` (their launch settings) and ``spec.py`` (the catalog entry)."""

from megacpp.kernels.ops.gated_delta.reference import (
    chunk_layout,
    flops_per_token,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
)

__all__ = [
    "chunk_layout",
    "flops_per_token",
    "gated_delta_rule_chunked",
    "gated_delta_rule_recurrent",
]
