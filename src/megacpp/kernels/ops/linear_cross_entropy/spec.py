"""The LM head's linear layer + cross-entropy, without the full logits:
the ``linear_cross_entropy`` catalog entry.

``SURFACE`` is the contract with its check and bench cases and its FLOP and byte model;
``BACKENDS`` are its rows. ``megacpp.kernels.registry`` collects both."""

from __future__ import annotations

from typing import Any

import torch

from megacpp.kernels.catalog import Backend, Requirements, Surface
from megacpp.kernels.declare import CUDA_SM80, FLOATS, HALF, lazy, randn
from megacpp.kernels.ops.linear_cross_entropy.reference import (
    linear_cross_entropy_reference,
    linear_cross_entropy_torch,
)


def _linear_ce_inputs(case: dict[str, int], dtype, device, gen) -> dict[str, Any]:
    t, d, v = case["tokens"], case["hidden"], case["vocab"]
    labels = torch.randint(0, v, (t,), generator=gen, device=device)
    labels[torch.rand(t, generator=gen, device=device) < 0.05] = -100  # some ignored rows
    return {"h": randn((t, d), dtype, device, gen),
            "weight": randn((v, d), dtype, device, gen, scale=d**-0.5), "labels": labels}


def _linear_ce_flops(inp: dict[str, Any]) -> float:
    (t, d), v = inp["h"].shape, inp["weight"].shape[0]
    return 3 * 2 * t * d * v  # logits, dh, dW


SURFACE = Surface(
    "linear_cross_entropy",
    "h [T, D], weight [V, D] (same dtype), labels [T] int64 (-100 ignored) -> mean loss "
    "fp32 scalar; fused backend never holds [T, V] logits (one token chunk of <= 128 MiB "
    "at a time), computes the grads in forward with fp32 sums (dW accumulated by cuBLAS "
    "addmm into an fp32 [V, D] held as two row halves; backward casts the first half "
    "into a temporary and frees it before allocating the result: never fp32 dW + a full "
    "cast copy); keeps dh + the fp32 dW for backward, which scales them in place (a "
    "second backward is an error)",
    linear_cross_entropy_reference, _linear_ce_inputs,
    {"check": {"tokens": 300, "hidden": 64, "vocab": 1000},
     "bench": {"tokens": 16384, "hidden": 1024, "vocab": 65536}},
    ("h", "weight"), _linear_ce_flops,
)

BACKENDS = (
    Backend("triton_chunked", "linear_cross_entropy", "chosen",
            Requirements(packages=("triton",), dtypes=HALF, **CUDA_SM80),
            lazy("megacpp.kernels.ops.linear_cross_entropy.triton", "linear_cross_entropy_triton")),
    Backend("reference", "linear_cross_entropy", "fallback", Requirements(),
            linear_cross_entropy_reference),
    Backend("torch_plain", "linear_cross_entropy", "donor", Requirements(),
            linear_cross_entropy_torch,
            "peer: h @ W^T then F.cross_entropy on operand-dtype logits; materialises "
            "[T, V] logits and their gradient"),
    Backend("liger", "linear_cross_entropy", "donor",
            Requirements(devices=("cuda",), packages=("liger_kernel",), dtypes=FLOATS),
            lazy("megacpp.kernels.peers", "liger_linear_cross_entropy"),
            "peer: Liger-kernel 0.8.5 fused linear CE (fp32 accumulation); measured "
            "against, not a dependency of the training path"),
)
