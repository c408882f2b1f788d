"""The Mamba-3 MIMO chunked scan: the ``mamba3_mimo_scan`` catalog entry.

``SURFACE`` is the contract with its check and bench cases and its FLOP and byte model;
``BACKENDS`` are its rows. ``megacpp.kernels.registry`` collects both."""

from __future__ import annotations

from typing import Any

import torch

from megacpp.kernels.catalog import Backend, Requirements, Surface
from megacpp.kernels.declare import CUDA_SM80, FLOATS, lazy
from megacpp.kernels.ops.mamba3_mimo_scan.reference import (
    flops_per_token,
    mamba3_mimo_scan_chunked,
)
from megacpp.kernels.ops.mamba3_scan.spec import scan_bytes

_GRADS = ("q", "k", "v", "adt", "dt", "trap", "q_bias", "k_bias", "mimo_v", "angles", "mimo_z",
          "mimo_o", "D", "z")


def _mimo_inputs(case: dict[str, int], dtype, device, gen) -> dict[str, Any]:
    """Model-like scan inputs: q/k RMS-normed, dt = softplus(.) and adt = A dt <= 0 in float32
    (as the mixer makes them), float32 per-head biases, MIMO projections (around mamba_ssm's
    init: 1/R, 1, 1/R) and D; packed documents if asked."""
    b, length, g, h = case["batch"], case["seq"], case["groups"], case["heads"]
    n, p, a, r = case["d_state"], case["headdim"], case["angles"], case["rank"]

    def rn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device) * scale

    dt = torch.nn.functional.softplus(rn(b, length, h) - 2)
    inputs = {
        "q": torch.nn.functional.rms_norm(rn(b, length, r, g, n), (n,)).to(dtype),
        "k": torch.nn.functional.rms_norm(rn(b, length, r, g, n), (n,)).to(dtype),
        "v": rn(b, length, h, p).to(dtype),
        "adt": -torch.rand(b, length, h, generator=gen, device=device) * dt,
        "dt": dt,
        "trap": rn(b, length, h).to(dtype),
        "q_bias": 1 + rn(h, r, n, scale=0.1), "k_bias": 1 + rn(h, r, n, scale=0.1),
        "mimo_v": (1 + rn(h, r, p, scale=0.1)) / r,
        "angles": rn(b, length, h, a, scale=2.0),
        "mimo_z": 1 + rn(h, r, p, scale=0.1),
        "mimo_o": (1 + rn(h, r, p, scale=0.1)) / r,
        "D": rn(h),
        "z": rn(b, length, h, p).to(dtype),
    }
    inputs = {name: t.requires_grad_() for name, t in inputs.items()}
    if case.get("resets"):
        reset = torch.rand(b, length, generator=gen, device=device) < 4 / length
        reset[:, 0] = False
        inputs["reset"] = reset
    inputs["chunk_size"] = case["chunk"]
    inputs["output_final_state"] = bool(case.get("final_state", 1))
    return inputs


def _mimo_flops(inp: dict[str, Any]) -> float:
    """Forward matmul FLOPs of the chunked form, times 3 for forward + backward."""
    b, length, h, p = inp["v"].shape
    rank, n = inp["q"].shape[2], inp["q"].shape[-1]
    return 3 * b * length * flops_per_token(length, inp["chunk_size"], h, p, n, rank)


def _mimo_bytes(inp: dict[str, Any]) -> float:
    return scan_bytes(inp, _GRADS)


SURFACE = Surface(
    "mamba3_mimo_scan",
    "Mamba-3 MIMO chunked scan (rank R): q, k [B, L, R, G, N], v, z [B, L, H, P], "
    "adt/dt/trap [B, L, H], angles [B, L, H, A] (dims i and i + N/2 rotate together), "
    "biases [H, R, N], mimo_v / mimo_z / mimo_o [H, R, P], D [H], reset [B, L] bool -> y "
    "[B, L, H, P] (summed with mimo_o; [B, L, R, H, P] with mimo_o=None) in v.dtype + final "
    "state (angle [B, H, A], ssm [B, H, P, N], k [B, R, H, N], v [B, H, P]; None with "
    "output_final_state=False); fp32 accumulation. triton_intra: the chunked form with "
    "its intra-chunk [T*R, T*R] form and its pass over chunks in Triton (fwd+bwd, nothing "
    "[T*R, T*R] stored) and the rest in PyTorch; chunk_size * R <= 128, d_state and "
    "headdim <= 128, no float64. Both rows keep only their inputs for backward and "
    "recompute the forward there",
    mamba3_mimo_scan_chunked, _mimo_inputs,
    {"check": {"batch": 2, "seq": 128, "groups": 1, "heads": 4, "d_state": 32, "headdim": 32,
               "angles": 8, "rank": 4, "chunk": 16},
     # mamba_ssm's MIMO kernels' tuned shape: 32 heads x 64, d_state 128, R 4, chunk 64 / R
     "seq4096": {"batch": 8, "seq": 4096, "groups": 1, "heads": 32, "d_state": 128,
                 "headdim": 64, "angles": 32, "rank": 4, "chunk": 16, "final_state": 0}},
    _GRADS, _mimo_flops, _mimo_bytes,
)

BACKENDS = (
    Backend("triton_intra", "mamba3_mimo_scan", "chosen",
            Requirements(packages=("triton",), dtypes=FLOATS, **CUDA_SM80),
            lazy("megacpp.kernels.ops.mamba3_mimo_scan.triton", "mamba3_mimo_scan_triton")),
    Backend("reference", "mamba3_mimo_scan", "fallback", Requirements(), mamba3_mimo_scan_chunked),
    Backend("triton_chunked", "mamba3_mimo_scan", "deferred",
            Requirements(devices=("cuda",), packages=("triton",)), None,
            "not written: a whole-scan kernel (state passing and read-out fused, as the SISO "
            "triton_chunked); triton_intra moves only the intra-chunk form"),
    Backend("mamba_ssm", "mamba3_mimo_scan", "donor",
            Requirements(devices=("cuda",), min_capability=(9, 0),
                         packages=("mamba_ssm", "tilelang"), dtypes=("bfloat16",)),
            lazy("megacpp.kernels.peers", "mamba3_mimo_tilelang"),
            "peer: mamba_ssm's mamba3_mimo (TileLang, bf16, tuned on H100), called through "
            "an adapter from this surface's layout (no packed documents, no initial state); "
            "the bar a fast kernel of ours must meet, not a dependency of the training path"),
)
