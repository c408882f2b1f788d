"""The Mamba-3 SISO chunked scan: the ``mamba3_scan`` catalog entry.

``SURFACE`` is the contract with its check and bench cases and its FLOP and byte model;
``BACKENDS`` are its rows. ``megacpp.kernels.registry`` collects both."""

from __future__ import annotations

from typing import Any

import torch

from megacpp.kernels.catalog import Backend, Requirements, Surface
from megacpp.kernels.declare import CUDA_SM80, FLOATS, lazy
from megacpp.kernels.ops.mamba3_scan.reference import flops_per_token, mamba3_scan_chunked

_GRADS = ("q", "k", "v", "adt", "dt", "trap", "q_bias", "k_bias", "angles", "D", "z")


def _mamba3_inputs(case: dict[str, int], dtype, device, gen) -> dict[str, Any]:
    """Model-like scan inputs: q/k RMS-normed, dt = softplus(.) and adt = A dt <= 0 in float32
    (as the mixer makes them), per-head float32 biases and D; packed documents if asked."""
    b, length, g, h = case["batch"], case["seq"], case["groups"], case["heads"]
    n, p, r = case["d_state"], case["headdim"], case["angles"]

    def rn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device) * scale

    dt = torch.nn.functional.softplus(rn(b, length, h) - 2)
    inputs = {
        "q": torch.nn.functional.rms_norm(rn(b, length, g, n), (n,)).to(dtype),
        "k": torch.nn.functional.rms_norm(rn(b, length, g, n), (n,)).to(dtype),
        "v": rn(b, length, h, p).to(dtype),
        "adt": -torch.rand(b, length, h, generator=gen, device=device) * dt,
        "dt": dt,
        "trap": rn(b, length, h).to(dtype),
        "q_bias": 1 + rn(h, n, scale=0.1), "k_bias": 1 + rn(h, n, scale=0.1),
        "angles": rn(b, length, h, r, scale=2.0).to(dtype),
        "D": rn(h),
        "z": rn(b, length, h, p).to(dtype),
    }
    inputs = {name: t.requires_grad_() for name, t in inputs.items()}
    if case.get("resets"):
        reset = torch.rand(b, length, generator=gen, device=device) < 4 / length
        reset[:, 0] = False
        inputs["reset"] = reset
    inputs["chunk_size"] = case["chunk"]
    # the bench cases time what a training step runs (and the mamba_ssm peer returns): y only
    inputs["output_final_state"] = bool(case.get("final_state", 1))
    return inputs


def _mamba3_flops(inp: dict[str, Any]) -> float:
    """Forward matmul FLOPs of the chunked form, times 3 for forward + backward."""
    b, length, h, p = inp["v"].shape
    per_token = flops_per_token(length, inp["chunk_size"], h, p, inp["q"].shape[-1])
    return 3 * b * length * per_token


def _mamba3_bytes(inp: dict[str, Any]) -> float:
    return scan_bytes(inp, _GRADS)


def scan_bytes(inp: dict[str, Any], grads: tuple[str, ...]) -> float:
    """Fewest bytes of a scan's forward + backward: each differentiable input (``grads``) read
    by the forward and the backward and its gradient written (3x), y written and dy read (2x
    v)."""
    read3 = sum(inp[name].numel() * inp[name].element_size() for name in grads)
    return 3 * read3 + 2 * inp["v"].numel() * inp["v"].element_size()


SURFACE = Surface(
    "mamba3_scan",
    "Mamba-3 SISO chunked scan: q, k [B, L, G, N], v, z [B, L, H, P], adt/dt/trap "
    "[B, L, H], angles [B, L, H, R], biases [H, N], D [H], reset [B, L] bool -> y "
    "[B, L, H, P] in v.dtype + final state (float32; None with output_final_state=False, "
    "what a training step without a cache asks); fp32 accumulation. triton_chunked: "
    "initial_state=None only (a cached prefill runs the reference: the mixer picks it), "
    "chunk_size 16/32/64 (fp32 v runs chunks of <= 32 tokens: same function), headdim "
    "<= 64, d_state <= 128, no gradient through the final state; bf16 matmul operands "
    "unless v is fp32; saves the inputs, the state entering every chunk [B, H, L/T, P, "
    "N] (bf16; fp32 for fp32 v), the per-head rotation table (cos, sin of the in-chunk "
    "angle) [B, H, L, 2, R] (fp16; fp32 for fp32 v) and y before the gate",
    mamba3_scan_chunked, _mamba3_inputs,
    {"check": {"batch": 2, "seq": 300, "groups": 2, "heads": 4, "d_state": 64,
               "headdim": 64, "angles": 16, "chunk": 64, "resets": 1},
     "seq4096": {"batch": 8, "seq": 4096, "groups": 1, "heads": 32, "d_state": 128,
                 "headdim": 64, "angles": 32, "chunk": 64, "final_state": 0},
     "seq8192": {"batch": 8, "seq": 8192, "groups": 1, "heads": 32, "d_state": 128,
                 "headdim": 64, "angles": 32, "chunk": 64, "final_state": 0}},
    _GRADS, _mamba3_flops, _mamba3_bytes,
)

BACKENDS = (
    Backend("triton_chunked", "mamba3_scan", "chosen",
            Requirements(packages=("triton",), dtypes=FLOATS, **CUDA_SM80),
            lazy("megacpp.kernels.ops.mamba3_scan.op", "mamba3_scan_triton")),
    Backend("reference", "mamba3_scan", "fallback", Requirements(), mamba3_scan_chunked),
    Backend("mamba_ssm", "mamba3_scan", "donor",
            Requirements(devices=("cuda",), min_capability=(8, 0), packages=("mamba_ssm",),
                         dtypes=("bfloat16",)),
            lazy("megacpp.kernels.peers", "mamba3_siso_combined"),
            "peer: mamba_ssm 2.3.2's mamba3_siso_combined (Triton, bf16), called through an "
            "adapter from this surface's layout (no packed documents: its varlen form did not "
            "match this surface); the speed bar for our Triton scan, not a dependency of the "
            "training path"),
)
