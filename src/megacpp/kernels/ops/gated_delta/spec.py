"""The gated delta rule (Gated DeltaNet), chunked: the ``gated_delta`` catalog entry.

``SURFACE`` is the contract with its check and bench cases and its FLOP and byte model;
``BACKENDS`` are its rows. ``megacpp.kernels.registry`` collects both."""

from __future__ import annotations

from typing import Any

import torch

from megacpp.kernels.catalog import Backend, Requirements, Surface
from megacpp.kernels.declare import CUDA_SM80, HALF, lazy, randn
from megacpp.kernels.ops.gated_delta.reference import flops_per_token, gated_delta_rule_chunked
from megacpp.kernels.peers import fla_check_guard


def _gated_delta_inputs(case: dict[str, int], dtype, device, gen) -> dict[str, Any]:
    """The mixer's call: unit-norm q and k (it L2-normalises them), g = log decay <= 0 and
    beta in (0, 1) in float32, doc resets every ~doc_len tokens (0: none)."""
    B, L, H = case["batch"], case["seq"], case["heads"]
    K, V = case["head_k"], case["head_v"]

    def unit(shape):
        x = torch.randn(shape, generator=gen, device=device)
        return (x / x.norm(dim=-1, keepdim=True)).to(dtype).requires_grad_()

    def f32(shape, shift=0.0):
        return torch.randn(shape, generator=gen, device=device) + shift

    reset = None
    if case.get("doc_len"):
        reset = torch.rand(B, L, generator=gen, device=device) < 1.0 / case["doc_len"]
    return {"q": unit((B, L, H, K)), "k": unit((B, L, H, K)),
            "v": randn((B, L, H, V), dtype, device, gen),
            "g": torch.nn.functional.logsigmoid(f32((B, L, H), 2.0)).requires_grad_(),
            "beta": torch.sigmoid(f32((B, L, H))).requires_grad_(),
            "reset": reset, "output_final_state": bool(case.get("final_state", 0))}


def _gated_delta_flops(inp: dict[str, Any]) -> float:
    B, L, H, K = inp["q"].shape
    V = inp["v"].shape[-1]
    return 3 * B * L * flops_per_token(L, H, K, V)  # fwd matmuls; bwd ~ 2x fwd


def _gated_delta_bytes(inp: dict[str, Any]) -> float:
    # fwd: read q, k, v, g, beta; write o.  bwd: read them again and do; write every grad.
    B, L, H, K = inp["q"].shape
    V = inp["v"].shape[-1]
    qkv = (2 * K + V) * inp["q"].element_size()
    o = V * inp["q"].element_size()
    gates = 2 * 4  # g and beta, float32
    return B * L * H * (3 * qkv + 2 * o + 3 * gates)


SURFACE = Surface(
    "gated_delta",
    "gated delta rule, chunked: q, k [B, L, H, K], v [B, L, H, V] (same dtype), g, beta "
    "[B, L, H] (float32), reset [B, L] bool doc starts or None, initial_state "
    "[B, H, K, V] or None -> o [B, L, H, V] in q.dtype + final state [B, H, K, V] "
    "float32 (see ops/gated_delta); triton saves q, k, v, g, beta, T [B, H, L, 64], "
    "w, chunk-entry states [B, H, L/64, K, V], v_new (T, v_new bf16 for bf16 inputs, "
    "else fp32) and the decays (backward adds dL/dP [B, H, L/64, 64, 64] and a "
    "[B, H, L/64, 1 + K/BKS, 64, 64] fp32 scratch); "
    "bf16 inputs take bf16 products (T's inverse tf32); calls it cannot take (float16/float64, "
    "K > 128, CPU) run the reference",
    gated_delta_rule_chunked, _gated_delta_inputs,
    {"check": {"batch": 2, "seq": 200, "heads": 2, "head_k": 32, "head_v": 64,
               "doc_len": 60, "final_state": 1},
     "nam56r_4k": {"batch": 8, "seq": 4096, "heads": 4, "head_k": 64, "head_v": 128},
     "nam56r_8k": {"batch": 8, "seq": 8192, "heads": 4, "head_k": 64, "head_v": 128},
     "h16_d128_4k": {"batch": 8, "seq": 4096, "heads": 16, "head_k": 128,
                     "head_v": 128}},
    ("q", "k", "v", "g", "beta"), _gated_delta_flops, _gated_delta_bytes,
)

BACKENDS = (
    Backend("triton_chunked", "gated_delta", "chosen",
            Requirements(packages=("triton",), dtypes=("float32", "bfloat16"), **CUDA_SM80),
            lazy("megacpp.kernels.ops.gated_delta.op", "gated_delta_rule_triton")),
    Backend("reference", "gated_delta", "fallback", Requirements(), gated_delta_rule_chunked),
    Backend("fla", "gated_delta", "donor",
            Requirements(devices=("cuda",), min_capability=(8, 0), packages=("fla",),
                         dtypes=HALF), lazy("megacpp.kernels.peers", "fla_chunk_gated_delta_rule"),
            "peer: flash-linear-attention 0.6.0 (fla-core) chunk_gated_delta_rule, doc resets "
            "as cu_seqlens; the speed bar for our Triton kernel, not on the training path",
            check_guard=fla_check_guard),
)
