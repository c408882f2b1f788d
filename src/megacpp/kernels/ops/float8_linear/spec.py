"""Linear layers with FP8 GEMMs in training: the ``float8_linear`` catalog entry.

The training lane (``parallel.float8``, :mod:`megacpp.train.float8`) swaps qualifying
``nn.Linear`` layers for torchao's Float8Linear; these rows are its requirements, which the
lane checks before training starts (it never falls back to bf16 on its own). No check or
bench cases: the GEMMs are tested against :func:`float8_linear_reference` in
``tests/kernels/test_float8_linear.py`` and timed in whole steps by
``benchmarks/fp8.py``."""

from __future__ import annotations

from megacpp.kernels.catalog import Backend, Requirements, Surface
from megacpp.kernels.declare import lazy
from megacpp.kernels.ops.float8_linear.reference import float8_linear_reference

_MODULE = "megacpp.kernels.ops.float8_linear.torchao_float8"

SURFACE = Surface(
    "float8_linear",
    "x [..., K] (bf16 under autocast), weight [N, K] (its master dtype) -> [..., N]: both "
    "operands cast to float8 e4m3 with dynamic scales (per tensor: tensorwise; per row "
    "of the reduction dim, rounded down to powers of two: rowwise), the GEMM by torch._scaled_mm "
    "(fp32 accumulation), the output in x's dtype; backward casts the output gradient "
    "(e5m2 tensorwise, e4m3 rowwise) for the two gradient GEMMs; K and N multiples of 16; "
    "saves the float8 operands",
    float8_linear_reference,
)

BACKENDS = (
    Backend("torchao_tensorwise", "float8_linear", "chosen",
            Requirements(devices=("cuda",), min_capability=(8, 9), packages=("torchao",),
                         torch_ops=("_scaled_mm",), dtypes=("bfloat16",)),
            lazy(_MODULE, "float8_linear_tensorwise")),
    # row-wise _scaled_mm is a CUTLASS kernel written for sm90 (TMA); sm89 builds of it came
    # later and are not the path this project measures
    Backend("torchao_rowwise", "float8_linear", "chosen",
            Requirements(devices=("cuda",), min_capability=(9, 0), packages=("torchao",),
                         torch_ops=("_scaled_mm",), dtypes=("bfloat16",)),
            lazy(_MODULE, "float8_linear_rowwise")),
    Backend("reference", "float8_linear", "fallback", Requirements(), float8_linear_reference),
)


def backend_of(recipe: str) -> Backend:
    """The catalog row of an FP8 recipe (tensorwise | rowwise)."""
    for backend in BACKENDS:
        if backend.name == f"torchao_{recipe}":
            return backend
    names = ", ".join(b.name.removeprefix("torchao_") for b in BACKENDS if b.role == "chosen")
    raise ValueError(f"FP8 recipe {recipe!r} not one of {names}")
