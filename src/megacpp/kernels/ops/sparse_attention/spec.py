"""DSA's latent attention over each query's selected keys: the ``sparse_attention`` catalog
entry.

``SURFACE`` is the contract with its check and bench cases and its FLOP and byte model;
``BACKENDS`` are its rows. ``megacpp.kernels.registry`` collects both."""

from __future__ import annotations

from typing import Any

import torch

from megacpp.kernels.catalog import Backend, Requirements, Surface
from megacpp.kernels.declare import lazy, randn, triton_sm80
from megacpp.kernels.ops.sparse_attention.reference import sparse_latent_attention


def random_selection(batch: int, seq: int, top_k: int, device, gen,
                     block: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query t, ``min(top_k, t + 1)`` distinct random past keys (causal, as the indexer
    picks them), the remaining slots invalid: indices, valid [B, L, k] (query blocks of
    ``block`` rows, so no [L, L] tensor is made)."""
    k = min(top_k, seq)
    indices, valid = [], []
    for start in range(0, seq, block):
        rows = torch.arange(start, min(start + block, seq), device=device)
        scores = torch.rand(batch, rows.numel(), seq, generator=gen, device=device)
        allowed = torch.arange(seq, device=device)[None, :] <= rows[:, None]
        picked = scores.masked_fill(~allowed, -1.0).topk(k, dim=-1).indices
        indices.append(picked)
        valid.append(allowed.expand(batch, -1, -1).gather(-1, picked))
    return torch.cat(indices, dim=1), torch.cat(valid, dim=1)


def _sparse_attention_inputs(case: dict[str, int], dtype, device, gen) -> dict[str, Any]:
    """Queries of one row of ``seq`` tokens over its own latents (T = L), unit-norm-ish
    latents as MLA's kv norm gives them, a causal random selection of ``top_k`` keys."""
    b, length, h = case["batch"], case["seq"], case["heads"]
    r, dr = case["rank"], case["rope"]
    indices, valid = random_selection(b, length, case["top_k"], device, gen)
    return {"q_latent": randn((b, length, h, r), dtype, device, gen, scale=r**-0.25),
            "q_rope": randn((b, length, h, dr), dtype, device, gen, scale=dr**-0.25),
            "latent": randn((b, length, r), dtype, device, gen),
            "k_rope": randn((b, length, dr), dtype, device, gen),
            "indices": indices, "valid": valid, "scale": (r + dr) ** -0.5,
            "with_probs": bool(case.get("probs", 0))}


def _sparse_attention_flops(inp: dict[str, Any]) -> float:
    """fwd+bwd (3.5x the forward) over every selected slot: per (query, head, slot) the
    score's r + dr and the output's r multiply-adds."""
    b, length, h, r = inp["q_latent"].shape
    dr, k = inp["q_rope"].shape[-1], inp["indices"].shape[-1]
    return 3.5 * b * length * h * k * 2 * (2 * r + dr)


def _sparse_attention_bytes(inp: dict[str, Any]) -> float:
    """The selected rows read once forward and once backward (bf16), their gradients added
    once (float32), plus the queries, output and gradients; each selected row counted each
    time it is picked (L2 hits are not subtracted)."""
    b, length, h, r = inp["q_latent"].shape
    dr, k = inp["q_rope"].shape[-1], inp["indices"].shape[-1]
    size = inp["q_latent"].element_size()
    rows = b * length * k * (r + dr) * (2 * size + 4)
    queries = b * length * h * (r + dr) * size * 5  # q fwd, q bwd, o, do, dq
    return rows + queries + b * length * k * 4 * 2


SURFACE = Surface(
    "sparse_attention",
    "q_latent [B, C, H, r], q_rope [B, C, H, dr], latent [B, T, r], k_rope [B, T, dr], "
    "indices [B, C, k] int (0 <= index < T), valid [B, C, k] bool (each query has a "
    "valid slot), scale, with_probs -> o_latent [B, C, H, r] in q_latent.dtype = softmax "
    "over the valid selected keys of scale * (q_latent . latent + q_rope . k_rope), every "
    "head over the same latents (DSA's absorbed MLA), and with_probs the detached "
    "head-mean probabilities [B, C, k] float32 (the indexer KL target), else None; "
    "triton loads the selected rows by index in-kernel (nothing [B, C, k, r] made), "
    "saves the inputs, int32 indices, the output and lse [B, C, H], recomputes the "
    "scores in backward and adds the key gradients with float32 atomics; reference: "
    "gather_keys + latent_attention, keeping the gathered rows for backward",
    sparse_latent_attention, _sparse_attention_inputs,
    {"check": {"batch": 2, "seq": 40, "heads": 4, "rank": 32, "rope": 16, "top_k": 24,
               "probs": 1},
     # nam56r-cut13's DSA layers (8 heads, kv_lora_rank 128, rope 32, top_k 512) at 8k tokens
     "cut13_8k": {"batch": 1, "seq": 8192, "heads": 8, "rank": 128, "rope": 32,
                  "top_k": 512, "probs": 1}},
    ("q_latent", "q_rope", "latent", "k_rope"), _sparse_attention_flops,
    _sparse_attention_bytes,
)

BACKENDS = (
    Backend("triton", "sparse_attention", "chosen", triton_sm80(),
            lazy("megacpp.kernels.ops.sparse_attention.triton",
                 "sparse_latent_attention_triton")),
    Backend("reference", "sparse_attention", "fallback", Requirements(), sparse_latent_attention),
)
