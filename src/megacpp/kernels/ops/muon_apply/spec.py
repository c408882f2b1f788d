"""Muon's weight update (an optimizer pass, no autograd): the ``muon_apply`` catalog entry.

``SURFACE`` is the contract with its check and bench cases and its FLOP and byte model;
``BACKENDS`` are its rows. ``megacpp.kernels.registry`` collects both."""

from __future__ import annotations

from megacpp.kernels.catalog import Backend, Requirements, Surface
from megacpp.kernels.declare import lazy, triton_sm80
from megacpp.kernels.ops.muon_apply.reference import muon_apply_reference

SURFACE = Surface(
    "muon_apply",
    "params: a list of float32 [*, rows, cols], ortho [sum of matrices, rows, cols] "
    "contiguous (the Newton-Schulz result, any float dtype), lr (float or a device "
    "scalar, for a captured step), weight_decay, scale -> params = params * (1 - lr * "
    "weight_decay) - scale * lr * ortho in place; no autograd (see muon_momentum)",
    muon_apply_reference,
)

BACKENDS = (
    Backend("triton_multi_tensor", "muon_apply", "chosen", triton_sm80(("float32",)),
            lazy("megacpp.kernels.ops.muon_apply.triton", "muon_apply_triton")),
    Backend("reference", "muon_apply", "fallback", Requirements(), muon_apply_reference),
)
