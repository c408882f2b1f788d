"""Short causal depthwise conv + SiLU (Gated DeltaNet's q | k | v conv): the plain-PyTorch
truth of the ``short_conv`` surface.

Per channel c and token t of one document, with W taps (tap W-1 multiplies the current token)::

    y[t, c] = silu(sum_{j < W} weight[c, W-1-j] * x[t-j, c])     x[t-j] = 0 before the document

:func:`short_causal_conv` is the full form the mixer uses (a cache's conv inputs before ``x``,
and the new tail it keeps); :func:`short_conv_reference` is the surface's training-path form
(no cache: every row starts from zeros), which the fast backends implement.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def short_causal_conv(
    x: Tensor, weight: Tensor, conv_state: Tensor | None, doc_ids: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Depthwise causal conv + SiLU that never reads across a document boundary.

    ``x`` [B, L, C]; ``weight`` [C, W] (tap W-1 multiplies the current token);
    ``conv_state`` [B, C, W-1] the inputs before ``x`` (oldest first; None means zeros), taken
    to belong to the first token's document; ``doc_ids`` [B, L] or None (one document).
    Returns ``y`` [B, L, C] and the new tail [B, C, W-1]: the last W-1 inputs, zeroed where
    they belong to an earlier document than the last token.
    """
    B, L, C = x.shape
    W = weight.shape[1]
    if conv_state is None:
        history = x.new_zeros(B, W - 1, C)
    else:
        history = conv_state.transpose(1, 2).to(x.dtype)
    padded = torch.cat([history, x], dim=1)  # [B, W-1+L, C]
    same_doc = None
    if doc_ids is not None:
        docs = torch.cat([doc_ids[:, :1].expand(B, W - 1), doc_ids], dim=1)  # [B, W-1+L]
        same_doc = docs.unfold(1, W, 1) == doc_ids[:, :, None]  # [B, L, W]
    # one multiply-add per tap, float32 sums (an einsum over unfolded windows ran as a batched
    # GEMV with K = W on the GPU: magma/gemv kernels, ~2 ms per layer fwd+bwd at 16k tokens)
    compute = torch.promote_types(x.dtype, torch.float32)
    w = weight.to(compute)
    acc = None
    for tap in range(W):
        term = padded[:, tap : tap + L].to(compute) * w[:, tap]
        if same_doc is not None:
            term = term * same_doc[:, :, tap, None]
        acc = term if acc is None else acc + term
    y = F.silu(acc).to(x.dtype)
    tail = padded[:, L:].transpose(1, 2)  # [B, C, W-1]: the last W-1 inputs
    if same_doc is not None:
        tail = tail * same_doc[:, -1, 1:][:, None, :].to(x.dtype)
    return y, tail


def short_conv_reference(x: Tensor, weight: Tensor, doc_ids: Tensor | None = None) -> Tensor:
    """x [B, L, C], weight [C, W], doc_ids [B, L] or None -> y [B, L, C] in x.dtype:
    :func:`short_causal_conv` from zeros, without the tail."""
    return short_causal_conv(x, weight, None, doc_ids)[0]
