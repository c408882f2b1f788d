"""Short causal depthwise conv + SiLU, the R mixer's q | k | v conv:
the ``short_conv`` catalog entry.

``SURFACE`` is the contract with its check and bench cases and its FLOP and byte model;
``BACKENDS`` are its rows. ``megacpp.kernels.registry`` collects both."""

from __future__ import annotations

from typing import Any

import torch

from megacpp.kernels.catalog import Backend, Requirements, Surface
from megacpp.kernels.declare import lazy, randn, triton_sm80
from megacpp.kernels.ops.short_conv.reference import short_conv_reference


def _short_conv_inputs(case: dict[str, int], dtype, device, gen) -> dict[str, Any]:
    """x as the channel slice of a wider projection output (as the R mixer's in_proj split
    gives it), a weight, packed documents of ~``doc_len`` tokens."""
    b, length, c, w = case["batch"], case["seq"], case["channels"], case["taps"]
    wide = randn((b, length, c + case.get("pad", 0)), dtype, device, gen, grad=False)
    starts = torch.rand(b, length, generator=gen, device=device) < 1 / case["doc_len"]
    return {"x": wide[..., :c].requires_grad_(),
            "weight": randn((c, w), torch.float32, device, gen, scale=w**-0.5),
            "doc_ids": starts.cumsum(1)}


def _short_conv_bytes(inp: dict[str, Any]) -> float:
    # fwd: read x, write y.  bwd: read x, dy; write dx (the weight and doc ids are small).
    return 5 * inp["x"].numel() * inp["x"].element_size()


SURFACE = Surface(
    "short_conv",
    "x [B, L, C] (unit channel stride: a column slice of a projection output is fine), "
    "weight [C, W] (tap W-1 on the current token), doc_ids [B, L] int or None -> y "
    "[B, L, C] in x.dtype = silu(causal depthwise conv) inside each document, from "
    "zeros, fp32 sums (the R mixer's q | k | v conv without a cache; a cached step runs "
    "the reference, which also returns the tail); triton saves x, weight and doc_ids "
    "and recomputes the conv in backward",
    short_conv_reference, _short_conv_inputs,
    {"check": {"batch": 2, "seq": 77, "channels": 150, "taps": 4, "doc_len": 20,
               "pad": 9},
     "nam56r": {"batch": 8, "seq": 2048, "channels": 1024, "taps": 4, "doc_len": 512,
                "pad": 520}},
    ("x", "weight"), None, _short_conv_bytes,
)

BACKENDS = (
    Backend("triton", "short_conv", "chosen", triton_sm80(),
            lazy("megacpp.kernels.ops.short_conv.triton", "short_conv_triton")),
    Backend("reference", "short_conv", "fallback", Requirements(), short_conv_reference),
    Backend("torch_compile", "short_conv", "donor",
            Requirements(devices=("cuda",), packages=("triton",), torch_ops=("compile",)),
            lazy("megacpp.kernels.peers", "short_conv_compiled"),
            "peer: inductor's fusion of the reference, which a compiled model ran before "
            "the Triton kernel; measured, not selected"),
)
