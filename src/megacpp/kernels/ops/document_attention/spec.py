"""Causal attention inside the documents of packed rows: the ``document_attention`` catalog entry.

``SURFACE`` is the contract with its check and bench cases and its FLOP and byte model;
``BACKENDS`` are its rows. ``megacpp.kernels.registry`` collects both."""

from __future__ import annotations

from typing import Any

import torch

from megacpp.kernels.catalog import Backend, Requirements, Surface
from megacpp.kernels.declare import CUDA_SM80, FLOATS, randn
from megacpp.kernels.ops.document_attention.flex import document_attention_flex
from megacpp.kernels.ops.document_attention.reference import document_attention_reference


def _document_ids(batch: int, length: int, docs: int, device, gen) -> torch.Tensor:
    """[B, L] int64 ids of ``docs`` contiguous documents per row, random lengths (>= 1)."""
    rows = []
    for _ in range(batch):
        cuts = torch.randperm(length - 1, generator=gen, device=device)[: docs - 1] + 1
        starts = torch.zeros(length, dtype=torch.int64, device=device)
        starts[cuts] = 1
        rows.append(starts.cumsum(0))
    return torch.stack(rows)


def _document_attention_inputs(case: dict[str, int], dtype, device, gen) -> dict[str, Any]:
    b, length, dh = case["batch"], case["seq"], case["head_dim"]
    inputs = {name: randn((b, h, length, dh), dtype, device, gen)
              for name, h in (("q", case["heads"]), ("k", case["kv_heads"]),
                              ("v", case["kv_heads"]))}
    inputs["doc_ids"] = _document_ids(b, length, case["docs"], device, gen)
    return inputs


def _document_attention_flops(inp: dict[str, Any]) -> float:
    """fwd+bwd (3.5x the forward) over the (query, key) pairs each document leaves visible."""
    _, h, _, dh = inp["q"].shape
    pairs = 0.0
    for row in inp["doc_ids"]:
        n = torch.unique_consecutive(row, return_counts=True)[1].double()
        pairs += float((n * (n + 1) / 2).sum())
    return 3.5 * 4 * h * dh * pairs


SURFACE = Surface(
    "document_attention",
    "q [B, H, L, Dh], k, v [B, Hkv, L, Dh] (H a multiple of Hkv), doc_ids [B, L] int -> "
    "[B, H, L, Dh] in q.dtype: query i sees key j iff j <= i and both are in one "
    "document, scale 1/sqrt(Dh) (the model's attention over packed rows); flex: "
    "FlexAttention over a [128, 128]-tile block mask made from doc_ids (empty tiles "
    "skipped, full ones unmasked; on sm90 at head dim 64 in bf16 / fp16, 64-row "
    "kernel tiles: flex_kernel_options), saves q, k, v, out and logsumexp; reference: SDPA "
    "with the dense [B, 1, L, L] mask",
    document_attention_reference, _document_attention_inputs,
    {"check": {"batch": 2, "heads": 4, "kv_heads": 2, "seq": 300, "head_dim": 64,
               "docs": 3},
     "step": {"batch": 8, "heads": 12, "kv_heads": 2, "seq": 2048, "head_dim": 64,
              "docs": 2}},
    ("q", "k", "v"), _document_attention_flops,
)

BACKENDS = (
    Backend("flex", "document_attention", "chosen",
            Requirements(packages=("triton",), torch_ops=("compile",), dtypes=FLOATS,
                         **CUDA_SM80),
            document_attention_flex),
    Backend("reference", "document_attention", "fallback", Requirements(),
            document_attention_reference),
)
