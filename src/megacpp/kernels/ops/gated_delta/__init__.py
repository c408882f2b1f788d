"""The gated delta rule (Gated DeltaNet): plain-PyTorch reference forms and their FLOP count."""

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
