"""Newton-Schulz's polynomial a I + b A + c A A (forward only):
the ``muon_polynomial`` catalog entry.

``SURFACE`` is the contract with its check and bench cases and its FLOP and byte model;
``BACKENDS`` are its rows. ``megacpp.kernels.registry`` collects both."""

from __future__ import annotations

import math
from typing import Any

import torch

from megacpp.kernels.catalog import Backend, Requirements, Surface
from megacpp.kernels.declare import HALF, lazy
from megacpp.kernels.ops.muon_polynomial.reference import NS_COEFFS, muon_polynomial_reference


def _muon_polynomial_inputs(case: dict[str, int], dtype, device, gen) -> dict[str, Any]:
    """gram = X X^T of a random X [batch, m, cols] (m <= cols: NS works on the wide side):
    symmetric positive semi-definite, as Newton-Schulz hands it over, with Muon's
    coefficients. ``normalize`` 1: X left unnormalized and the surface scales it (NS's first
    step); 0: X normalized first (||X||_F = 1, the later steps)."""
    shape = (case["batch"], case["m"], case["cols"])
    x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    if not case["normalize"]:
        x = x / x.norm(dim=(-2, -1), keepdim=True)
    x = x.to(dtype)
    # the Gram matrix in the operand dtype (a float32 product, rounded once), exactly symmetric
    gram = torch.matmul(x.float(), x.float().mT)
    gram = ((gram + gram.mT) / 2).to(dtype)
    return {"gram": gram, **dict(zip("abc", NS_COEFFS, strict=True)),
            "normalize_eps": 1e-7 if case["normalize"] else None}


def _muon_polynomial_flops(inp: dict[str, Any]) -> float:
    # A A as a full product (2 m^3 per matrix); symmetric kernels compute half of it
    *lead, m, _ = inp["gram"].shape
    return 2.0 * math.prod(lead) * m**3


def _muon_polynomial_bytes(inp: dict[str, Any]) -> float:
    return 2 * inp["gram"].numel() * inp["gram"].element_size()  # read A, write P


SURFACE = Surface(
    "muon_polynomial",
    "gram [batch, m, m] symmetric (Newton-Schulz's A = X X^T; bf16 on the GPU), a, b, "
    "c -> a I + b A + c A A, a new tensor in gram's dtype (symmetric); float32 "
    "accumulation; normalize_eps (NS's first step): A is X X^T of an unnormalized X, "
    "s = 1 / (sqrt(trace A) + eps), result s (a I + b s^2 A + c s^4 A A); no autograd: "
    "kernels check compares the output, kernels bench times the forward",
    muon_polynomial_reference,
    _muon_polynomial_inputs,
    # nam56r-350m's Muon batches (Gram matrices of 391 MoE w_in halves 544 x 768,
    # 391 w_out 768 x 272 (transposed: 272 x 768), 28 dense 768 x 768), in the later
    # steps' form (X already normalized)
    {"check": {"batch": 3, "m": 136, "cols": 200, "normalize": 1},
     "nam56r_moe_in": {"batch": 391, "m": 544, "cols": 768, "normalize": 0},
     "nam56r_moe_out": {"batch": 391, "m": 272, "cols": 768, "normalize": 0},
     "nam56r_dense": {"batch": 28, "m": 768, "cols": 768, "normalize": 0}},
    (), _muon_polynomial_flops, _muon_polynomial_bytes,
)

BACKENDS = (
    Backend("triton_symmetric", "muon_polynomial", "chosen",
            Requirements(devices=("cuda",), min_capability=(9, 0), packages=("triton",),
                         dtypes=HALF),
            lazy("megacpp.kernels.ops.muon_polynomial.triton", "muon_polynomial_triton")),
    Backend("reference", "muon_polynomial", "fallback", Requirements(),
            muon_polynomial_reference),
)
