"""Decode attention over the serving engine's paged K/V pool: the ``paged_attention_decode``
catalog entry.

``SURFACE`` is the contract with its check and bench cases and its byte model; ``BACKENDS``
are its rows. ``megacpp.kernels.registry`` collects both."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import torch

from megacpp.kernels.catalog import Backend, Requirements, Surface
from megacpp.kernels.declare import lazy, triton_sm80
from megacpp.kernels.ops.paged_attention_decode.reference import (
    paged_attention_decode_reference,
)


def _decode_inputs(case: dict[str, int], dtype, device, gen) -> dict[str, Any]:
    """Queries of ``batch`` rows and a pool of their blocks in random order plus one scratch
    block; row lengths drawn from (context - spread, context], each row's table ``context``
    tokens wide (entries past its length point at the scratch block, as the engine pads)."""
    b, h, hkv, hd = case["batch"], case["heads"], case["kv_heads"], case["head_dim"]
    page, context, spread = case["page"], case["context"], case.get("spread", 0)
    width = -(-context // page)
    n_blocks = b * width + 1
    scratch = n_blocks - 1
    kw = {"device": device, "dtype": torch.float32}
    lengths = context - torch.randint(0, spread + 1, (b,), generator=gen, device=device)
    order = torch.randperm(b * width, generator=gen, device=device).view(b, width)
    used = torch.arange(width, device=device)[None, :] * page < lengths[:, None]
    tables = torch.where(used, order, torch.full_like(order, scratch))
    return {
        "q": torch.randn(b, h, hd, generator=gen, **kw).to(dtype),
        "k_pool": torch.randn(n_blocks, page, hkv, hd, generator=gen, **kw).to(dtype),
        "v_pool": torch.randn(n_blocks, page, hkv, hd, generator=gen, **kw).to(dtype),
        "block_tables": tables,
        "positions": lengths - 1,
    }


def _decode_bytes(inp: dict[str, Any]) -> float:
    """Fewest bytes: each row's keys and values 0..pos read once, q read, the output written."""
    q, k_pool = inp["q"], inp["k_pool"]
    per_key = 2 * k_pool.shape[2] * k_pool.shape[3] * k_pool.element_size()
    keys = int((inp["positions"] + 1).sum())
    return keys * per_key + 2 * q.numel() * q.element_size()


# nam56r-350m's A layers: 12 query heads over 2 K/V heads of 64, the engine's 16-token blocks;
# 384 tokens of context (a 128-token prompt and 256 new tokens)
_NAM56R = MappingProxyType({"heads": 12, "kv_heads": 2, "head_dim": 64, "page": 16,
                           "context": 384, "spread": 32})

SURFACE = Surface(
    "paged_attention_decode",
    "decode attention of one query token per row over the serving engine's paged K/V pool "
    "(inference: forward only, no autograd): q [B, H, hd] (after QK-norm and RoPE), k_pool, "
    "v_pool [num_blocks, block_size, Hkv, hd] (H a multiple of Hkv; the new token already "
    "written), block_tables [B, W] int, positions [B] int -> [B, H, hd] in q's dtype; row b "
    "attends to its keys 0..positions[b] (GQA: query head h reads K/V head h // (H / Hkv)), "
    "scale hd^-0.5, no soft-capping, scores and softmax in float32. triton: K/V read in "
    "place through the block table, online softmax, keys split over programs by shape only "
    "(no host sync; CUDA-graph capturable); padding rows may point at a scratch block",
    paged_attention_decode_reference, _decode_inputs,
    {"check": {"batch": 5, "heads": 8, "kv_heads": 2, "head_dim": 64, "page": 16,
               "context": 100, "spread": 80},
     "nam56r_b1": {"batch": 1, **_NAM56R},
     "nam56r_b64": {"batch": 64, **_NAM56R}},
    (), None, _decode_bytes,
)

BACKENDS = (
    Backend("triton", "paged_attention_decode", "chosen", triton_sm80(),
            lazy("megacpp.kernels.ops.paged_attention_decode.triton",
                 "paged_attention_decode_triton")),
    Backend("reference", "paged_attention_decode", "fallback", Requirements(),
            paged_attention_decode_reference),
)
