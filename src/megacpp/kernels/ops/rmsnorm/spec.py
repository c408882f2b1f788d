"""RMSNorm with an optional fused residual add: the ``rmsnorm`` catalog entry.

``SURFACE`` is the contract with its check and bench cases and its FLOP and byte model;
``BACKENDS`` are its rows. ``megacpp.kernels.registry`` collects both."""

from __future__ import annotations

from typing import Any

import torch

from megacpp.kernels.catalog import Backend, Requirements, Surface
from megacpp.kernels.declare import lazy, randn, triton_sm80
from megacpp.kernels.ops.rmsnorm.reference import rmsnorm_reference


def _rmsnorm_inputs(case: dict[str, int], dtype, device, gen) -> dict[str, Any]:
    t, d = case["tokens"], case["dim"]
    return {"x": randn((t, d), dtype, device, gen), "residual": randn((t, d), dtype, device, gen),
            "weight": (1 + 0.1 * torch.randn(d, generator=gen, device=device)).requires_grad_(),
            "eps": 1e-5}


def _rmsnorm_bytes(inp: dict[str, Any]) -> float:
    # fwd: read x, residual; write y, h.  bwd: read dy, dh_out, h; write dh.
    return 8 * inp["x"].numel() * inp["x"].element_size()


SURFACE = Surface(
    "rmsnorm",
    "x, residual [T, D] (any float dtype), weight [D] -> (y, h) [T, D] in x.dtype; "
    "h = x + residual (fp32 sum), y = h * rsqrt(mean(h^2) + eps) * weight; "
    "fanout=n (<= 3): y n times then h, each copy with its own gradient, summed by the "
    "backward; "
    "rope=(cos, sin) [L, D/2] (a QK-norm of x [..., L, D]; no residual, fanout 1): y "
    "rotated (half-split pairs, as apply_rope) before its one rounding; x may be a "
    "strided view (read in place, dx with its strides); saves h, weight, rstd [T] fp32 "
    "(and the tables)",
    rmsnorm_reference, _rmsnorm_inputs,
    # bench: 262144 rows (4 GiB moved); at 16384 rows the ~0.1 ms of kernels hide
    # under ~0.8 ms of host launch time and every backend measures the host
    {"check": {"tokens": 67, "dim": 384}, "bench": {"tokens": 262144, "dim": 1024}},
    ("x", "residual", "weight"), None, _rmsnorm_bytes,
)

BACKENDS = (
    Backend("triton_fused", "rmsnorm", "chosen", triton_sm80(),
            lazy("megacpp.kernels.ops.rmsnorm.triton", "rmsnorm_triton")),
    Backend("reference", "rmsnorm", "fallback", Requirements(), rmsnorm_reference),
    Backend("torch_compile", "rmsnorm", "donor",
            Requirements(devices=("cuda",), packages=("triton",), torch_ops=("compile",)),
            lazy("megacpp.kernels.peers", "rmsnorm_compiled"),
            "peer: inductor's fusion of the reference; compile is applied from outside the "
            "model (train.parallelize), so it is measured, not selected"),
)
