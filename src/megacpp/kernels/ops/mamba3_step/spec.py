"""One Mamba-3 SISO decode step on the serving engine's state pool: the ``mamba3_step``
catalog entry.

``SURFACE`` is the contract with its check and bench cases and its byte model; ``BACKENDS``
are its rows. ``megacpp.kernels.registry`` collects both."""

from __future__ import annotations

import math
from typing import Any

import torch

from megacpp.kernels.catalog import Backend, Requirements, Surface
from megacpp.kernels.declare import lazy, triton_sm80
from megacpp.kernels.ops.mamba3_step.reference import mamba3_step_reference, step_split


def _step_inputs(case: dict[str, int], dtype, device, gen) -> dict[str, Any]:
    """in_proj's output for ``batch`` rows in ``dtype``, a float32 state pool of ``pool``
    slots with model-like contents, the rows in distinct slots in random order, and the
    mixer's parameters in ``dtype`` (as a served model holds them)."""
    b, h, p = case["batch"], case["heads"], case["headdim"]
    n, g, r = case["d_state"], case["groups"], case["angles"]
    f32 = {"device": device, "dtype": torch.float32}

    def rn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen, **f32) * scale

    def near_one(*shape: int) -> torch.Tensor:
        return (1 + rn(*shape, scale=0.1)).to(dtype)

    dt = torch.exp(torch.empty(h, **f32).uniform_(math.log(1e-3), math.log(0.1), generator=gen))
    slots = case["pool"]
    return {
        "proj": rn(b, sum(step_split(h, p, g, n, r))).to(dtype),
        "angle": torch.rand(slots, h, r, generator=gen, **f32) * 2 * math.pi,
        "ssm": rn(slots, h, p, n, scale=0.1),
        "k": rn(slots, h, n),
        "v": rn(slots, h, p),
        "slots": torch.randperm(slots, generator=gen, device=device)[:b],
        "dt_bias": (dt + torch.log(-torch.expm1(-dt))).to(dtype),  # inverse softplus
        "B_norm_weight": near_one(n), "C_norm_weight": near_one(n),
        "B_bias": near_one(h, n), "C_bias": near_one(h, n),
        "D": near_one(h),
        "norm_weight": near_one(h * p) if case.get("norm", 1) else None,
        "ngroups": g, "A_floor": 1e-4, "eps": 1e-5,
    }


def _step_bytes(inp: dict[str, Any]) -> float:
    """Fewest bytes of a step: in_proj's output and the rows' state read, the state written,
    y written."""
    rows = inp["proj"].shape[0]
    state = sum(inp[name][0].numel() * inp[name].element_size()
                for name in ("angle", "ssm", "k", "v"))
    y = inp["ssm"].shape[1] * inp["ssm"].shape[2] * inp["proj"].element_size()
    return rows * (inp["proj"][0].numel() * inp["proj"].element_size() + 2 * state + y)


SURFACE = Surface(
    "mamba3_step",
    "one Mamba-3 SISO decode step (inference: forward only, no autograd) between the "
    "mixer's in_proj and out_proj: proj [B, 2HP + 2GN + 3H + R] (in_proj's output for "
    "one token per row), the state pool angle [S, H, R], ssm [S, H, P, N], k [S, H, N], "
    "v [S, H, P] (float32/float64) with slots [B] int (each row's pool row), the "
    "mixer's parameters (dt_bias [H], B/C norm weights [N], B/C biases [H, N], D [H], "
    "output-norm weight [H*P] or None) -> y [B, H*P] in proj's dtype (out_proj's input), "
    "pool rows updated in place. float32 math (float64 for float64 proj), rounded where "
    "the mixer rounds. triton_fused: one launch over (head, row), no host sync (CUDA-graph "
    "capturable); padding rows may share one scratch slot (its contents unspecified)",
    mamba3_step_reference, _step_inputs,
    {"check": {"batch": 5, "pool": 9, "heads": 4, "headdim": 64, "d_state": 64,
               "groups": 2, "angles": 16},
     # nam56r-350m's M layers: d_model 768, expand 2, headdim 64 -> 24 heads; d_state 64
     "nam56r_b1": {"batch": 1, "pool": 2, "heads": 24, "headdim": 64, "d_state": 64,
                   "groups": 1, "angles": 16},
     "nam56r_b64": {"batch": 64, "pool": 65, "heads": 24, "headdim": 64, "d_state": 64,
                    "groups": 1, "angles": 16}},
    (), None, _step_bytes,
)

BACKENDS = (
    Backend("triton_fused", "mamba3_step", "chosen",
            triton_sm80(("float32", "bfloat16", "float16", "float64")),
            lazy("megacpp.kernels.ops.mamba3_step.triton", "mamba3_step_triton")),
    Backend("reference", "mamba3_step", "fallback", Requirements(), mamba3_step_reference),
)
