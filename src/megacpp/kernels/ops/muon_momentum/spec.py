"""Muon's momentum pass (an optimizer pass, no autograd): the ``muon_momentum`` catalog entry.

``SURFACE`` is the contract with its check and bench cases and its FLOP and byte model;
``BACKENDS`` are its rows. ``megacpp.kernels.registry`` collects both."""

from __future__ import annotations

from megacpp.kernels.catalog import Backend, Requirements, Surface
from megacpp.kernels.declare import lazy, triton_sm80
from megacpp.kernels.ops.muon_momentum.reference import muon_momentum_reference

SURFACE = Surface(
    "muon_momentum",
    "bufs, grads: lists of float32 [*, rows, cols] (Muon's momentum buffers and the "
    "gradients), momentum, nesterov, out [sum of matrices, rows, cols] (any float "
    "dtype: the Newton-Schulz input) -> bufs = momentum * bufs + grads in place; the "
    "update (grads + momentum * bufs with Nesterov, else bufs) written into out in "
    "parameter order; optional grad_scale (one float32 on the device: the clipping "
    "coefficient) multiplies every grad first, the grads left unwritten; no autograd "
    "(an optimizer pass): checked by what it writes "
    "(tests/kernels/test_muon.py), not by kernels check",
    muon_momentum_reference,
)

BACKENDS = (
    Backend("triton_multi_tensor", "muon_momentum", "chosen", triton_sm80(("float32",)),
            lazy("megacpp.kernels.ops.muon_momentum.triton", "muon_momentum_triton")),
    Backend("reference", "muon_momentum", "fallback", Requirements(),
            muon_momentum_reference),
)
