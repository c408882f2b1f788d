"""Causal self-attention, the A family's core: the ``attention`` catalog entry.

``SURFACE`` is the contract with its check and bench cases and its FLOP and byte model;
``BACKENDS`` are its rows. ``megacpp.kernels.registry`` collects both."""

from __future__ import annotations

from typing import Any

from megacpp.kernels.catalog import Backend, Requirements, Surface
from megacpp.kernels.declare import CUDA_SM80, HALF, randn
from megacpp.kernels.ops.attention.reference import (
    causal_attention_reference,
    causal_attention_sdpa_flash,
)


def _attention_inputs(case: dict[str, int], dtype, device, gen) -> dict[str, Any]:
    shape = (case["batch"], case["heads"], case["seq"], case["head_dim"])
    return {name: randn(shape, dtype, device, gen) for name in ("q", "k", "v")}


def _attention_flops(inp: dict[str, Any]) -> float:
    b, h, length, dh = inp["q"].shape
    return 3.5 * 4 * b * h * length * length * dh / 2  # causal half; bwd = 2.5x fwd


SURFACE = Surface(
    "attention",
    "q, k, v [B, H, L, Dh] (GQA expanded), causal, scale 1/sqrt(Dh) -> [B, H, L, Dh]; "
    "flash saves q, k, v, out and logsumexp [B, H, L] fp32",
    causal_attention_reference, _attention_inputs,
    {"check": {"batch": 2, "heads": 4, "seq": 128, "head_dim": 64},
     "bench": {"batch": 8, "heads": 16, "seq": 2048, "head_dim": 64}},
    ("q", "k", "v"), _attention_flops,
)

BACKENDS = (
    Backend("sdpa_flash", "attention", "chosen",
            Requirements(dtypes=HALF, **CUDA_SM80), causal_attention_sdpa_flash),
    Backend("reference", "attention", "fallback", Requirements(), causal_attention_reference),
    Backend("flash_attn_3", "attention", "deferred",
            Requirements(devices=("cuda",), min_capability=(9, 0), max_capability=(9, 0),
                         packages=("flash_attn_interface",), dtypes=HALF), None,
            "FlashAttention-3 (Hopper) ships no wheel for this torch/CUDA; building it from "
            "source is outside this tree"),
    Backend("flash_attn_4", "attention", "deferred",
            Requirements(devices=("cuda",), min_capability=(10, 0), dtypes=HALF), None,
            "FlashAttention-4 (CuTe DSL) targets Blackwell; not installable or testable on "
            "the Hopper machines this project measures on"),
)
