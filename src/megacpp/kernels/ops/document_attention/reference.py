"""Causal attention inside the documents of packed rows, in plain PyTorch: SDPA with the
dense document-causal mask.

Contract: q [B, H, L, Dh], k, v [B, Hkv, L, Dh] (H a multiple of Hkv: grouped-query heads),
doc_ids [B, L] integer (a per-token document index) -> [B, H, L, Dh] in q.dtype, softmax scale
1/sqrt(Dh): query i sees key j iff j <= i and doc_ids[b, i] == doc_ids[b, j]. Every query sees
at least itself, so no row is empty.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def document_causal_mask(doc_ids: Tensor) -> Tensor:
    """[B, L] document ids -> [B, L, L] bool: query i may see key j iff j <= i, same doc."""
    length = doc_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=doc_ids.device).tril()
    return causal & (doc_ids[:, :, None] == doc_ids[:, None, :])


def document_attention_reference(q: Tensor, k: Tensor, v: Tensor, doc_ids: Tensor) -> Tensor:
    """SDPA with the dense [B, 1, L, L] document-causal mask (grouped-query heads shared)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=document_causal_mask(doc_ids)[:, None],
                                          enable_gqa=True)
