"""One Gated DeltaNet decode step on the serving engine's state pool: the ``gated_delta_step``
catalog entry.

``SURFACE`` is the contract with its check and bench cases and its byte model; ``BACKENDS``
are its rows. ``megacpp.kernels.registry`` collects both."""

from __future__ import annotations

import math
from typing import Any

import torch

from megacpp.kernels.catalog import Backend, Requirements, Surface
from megacpp.kernels.declare import lazy, triton_sm80
from megacpp.kernels.ops.gated_delta_step.reference import gated_delta_step_reference, step_split


def _step_inputs(case: dict[str, int], dtype, device, gen) -> dict[str, Any]:
    """in_proj's output for ``batch`` rows in ``dtype``, a float32 state pool of ``pool``
    slots with model-like contents (conv inputs rounded to ``dtype``, as the mixer writes
    them), the rows in distinct slots in random order, and the mixer's parameters in
    ``dtype`` (as a served model holds them)."""
    b, h, k, v, w = case["batch"], case["heads"], case["head_k_dim"], case["head_v_dim"], \
        case["conv_size"]
    f32 = {"device": device, "dtype": torch.float32}
    conv_dim = 2 * h * k + h * v

    def rn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen, **f32) * scale

    dt = torch.exp(torch.empty(h, **f32).uniform_(math.log(1e-3), math.log(0.1), generator=gen))
    slots = case["pool"]
    return {
        "proj": rn(b, sum(step_split(h, k, v))).to(dtype),
        "state": rn(slots, h, k, v, scale=0.1),
        "conv_state": rn(slots, conv_dim, w - 1).to(dtype).float(),
        "slots": torch.randperm(slots, generator=gen, device=device)[:b],
        "conv_weight": (rn(conv_dim, w) / math.sqrt(w)).to(dtype),
        "A_log": torch.empty(h, **f32).uniform_(1.0, 16.0, generator=gen).log().to(dtype),
        "dt_bias": (dt + torch.log(-torch.expm1(-dt))).to(dtype),  # inverse softplus
        "norm_weight": (1 + rn(v, scale=0.1)).to(dtype),
        "eps": 1e-5,
    }


def _step_bytes(inp: dict[str, Any]) -> float:
    """Fewest bytes of a step: in_proj's output and the rows' state and conv tail read, both
    written, y written."""
    rows = inp["proj"].shape[0]
    state = sum(inp[name][0].numel() * inp[name].element_size()
                for name in ("state", "conv_state"))
    _, h, _, v = inp["state"].shape
    y = h * v * inp["proj"].element_size()
    return rows * (inp["proj"][0].numel() * inp["proj"].element_size() + 2 * state + y)


SURFACE = Surface(
    "gated_delta_step",
    "one Gated DeltaNet decode step (inference: forward only, no autograd) between the R "
    "mixer's in_proj and o_proj: proj [B, 2HK + 2HV + 2H] (in_proj's output for one token "
    "per row: q | k | v | gate | a | b), the state pool state [S, H, K, V] and conv_state "
    "[S, C, W-1] (C = 2HK + HV; float32/float64) with slots [B] int (each row's pool row), "
    "the mixer's parameters (conv_weight [C, W], A_log [H], dt_bias [H], norm_weight [V]) -> "
    "y [B, H*V] in proj's dtype (o_proj's input), pool rows updated in place. float32 math "
    "(float64 for float64 proj), rounded where the mixer rounds. triton_fused: one launch "
    "over (head, row), no host sync (CUDA-graph capturable); padding rows may share one "
    "scratch slot (its contents unspecified)",
    gated_delta_step_reference, _step_inputs,
    {"check": {"batch": 5, "pool": 9, "heads": 3, "head_k_dim": 32, "head_v_dim": 48,
               "conv_size": 4},
     # nam56r-350m's R layers: 4 heads, K 64, V 128, 4 conv taps
     "nam56r_b1": {"batch": 1, "pool": 2, "heads": 4, "head_k_dim": 64, "head_v_dim": 128,
                   "conv_size": 4},
     "nam56r_b64": {"batch": 64, "pool": 65, "heads": 4, "head_k_dim": 64, "head_v_dim": 128,
                    "conv_size": 4}},
    (), None, _step_bytes,
)

BACKENDS = (
    Backend("triton_fused", "gated_delta_step", "chosen",
            triton_sm80(("float32", "bfloat16", "float16", "float64")),
            lazy("megacpp.kernels.ops.gated_delta_step.triton", "gated_delta_step_triton")),
    Backend("reference", "gated_delta_step", "fallback", Requirements(),
            gated_delta_step_reference),
)
