"""Routed-expert compute: dispatch, the experts' SwiGLU FFNs, combine:
the ``moe_experts`` catalog entry.

``SURFACE`` is the contract with its check and bench cases and its FLOP and byte model;
``BACKENDS`` are its rows. ``megacpp.kernels.registry`` collects both."""

from __future__ import annotations

from typing import Any

import torch

from megacpp.kernels.catalog import Backend, Requirements, Surface
from megacpp.kernels.declare import HALF, lazy, randn
from megacpp.kernels.ops.moe_experts.reference import moe_experts_reference


def _moe_inputs(case: dict[str, int], dtype, device, gen) -> dict[str, Any]:
    t, d, e, k, f = case["tokens"], case["dim"], case["experts"], case["top_k"], case["ffn"]
    scores = torch.rand(t, e, generator=gen, device=device)
    expert_idx = scores.topk(k, dim=-1).indices  # distinct experts per token
    weights = torch.rand(t, k, generator=gen, device=device) + 0.1
    return {"x": randn((t, d), dtype, device, gen), "expert_idx": expert_idx,
            "weights": (weights / weights.sum(-1, keepdim=True)).requires_grad_(),
            "w_in": randn((e, 2 * f, d), dtype, device, gen, scale=d**-0.5),
            "w_out": randn((e, d, f), dtype, device, gen, scale=f**-0.5)}


def _moe_flops(inp: dict[str, Any]) -> float:
    routed = inp["expert_idx"].numel()
    (_, two_f, d) = inp["w_in"].shape
    return 3 * 2 * routed * d * (two_f + two_f // 2)  # fwd + 2x for bwd


SURFACE = Surface(
    "moe_experts",
    "x [T, D], expert_idx [T, k] int64, weights [T, k], w_in [E, 2F, D] (gate|up), "
    "w_out [E, D, F], optional addend [T, D] -> [T, D] = sum_j w[t,j] * SwiGLU_e(x[t]) "
    "(+ addend[t], summed in the combine); dropless; grouped "
    "backend: no host sync (device offsets), routing weight folded into the SwiGLU "
    "output, fp32 gather-sum combine; saves permuted x, gate|up, weighted SwiGLU "
    "output and the dispatch plan",
    moe_experts_reference, _moe_inputs,
    {"check": {"tokens": 96, "dim": 64, "experts": 8, "top_k": 2, "ffn": 32},
     "e64_k8": {"tokens": 16384, "dim": 1024, "experts": 64, "top_k": 8, "ffn": 512},
     "e16_k2": {"tokens": 16384, "dim": 1024, "experts": 16, "top_k": 2, "ffn": 2048}},
    ("x", "weights", "w_in", "w_out"), _moe_flops,
)

BACKENDS = (
    Backend("grouped_mm", "moe_experts", "chosen",
            Requirements(devices=("cuda",), min_capability=(9, 0), packages=("triton",),
                         torch_ops=("_grouped_mm",), dtypes=("bfloat16",)),
            lazy("megacpp.kernels.ops.moe_experts.grouped", "moe_experts_grouped")),
    Backend("reference", "moe_experts", "fallback", Requirements(), moe_experts_reference),
    Backend("triton_grouped", "moe_experts", "deferred",
            Requirements(devices=("cuda",), packages=("triton",), dtypes=HALF), None,
            "the whole expert path in Triton for devices whose torch lacks a CUDA "
            "_grouped_mm (pre-Hopper): not written yet (grouped_mm_triton and "
            "grouped_wgrad_triton, inside the chosen backend, load through tensor "
            "descriptors: sm90+); such devices use the reference"),
)
