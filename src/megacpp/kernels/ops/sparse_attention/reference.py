"""Plain-PyTorch reference for DeepSeek sparse attention's index path and latent attention.

The pieces, in the order a DSA layer runs them for one chunk of C queries over T keys:

1. :func:`allowed_keys` -- which keys each query may see: causal, and (in packed rows) only
   its own document. ``[B|1, C, T]`` bool.
2. :func:`indexer_scores` -- the lightning indexer: ``I[t, s] = sum_h w[t, h] * relu(scale *
   q[t, h] . k[s])`` with a few small index heads and one shared index key per token.
3. :func:`select_topk` -- the ``top_k`` highest-scoring *allowed* keys per query, plus a
   ``valid`` flag (a query with fewer allowed keys than ``top_k`` still gets ``top_k``
   indices; the extra ones are marked invalid and masked out of attention).
4. :func:`gather_keys` -- the selected keys' rows, ``[B, T, d] -> [B, C, k, d]``.
5. :func:`latent_attention` -- multi-head latent attention in its absorbed (MQA) form over
   per-query key sets: every head attends to the same compressed latents.
   :func:`sparse_latent_attention` is 4 + 5 over the selected keys, the ``sparse_attention``
   catalog surface (its Triton backend loads the selected rows by index instead).
6. :func:`indexer_kl_loss` -- the indexer's training signal: KL from the (detached,
   head-summed, renormalised) attention distribution to ``softmax(I)``.

Capture safety: nothing here reads a tensor value on the host (no ``.item()``, no
``.tolist()``, no ``nonzero``) and no Python branch depends on tensor data, so the path can
be compiled with ``torch.compile(fullgraph=True)`` and captured in a CUDA graph. Shapes
(``top_k`` against ``T``) may select code paths; values never do.

Memory: every function works on one chunk of queries, so the caller bounds the score
tensors to ``C x T`` per head (never ``L x L`` for the whole sequence).
"""

from __future__ import annotations

import torch
from torch import Tensor


def allowed_keys(
    query_pos: Tensor,
    n_keys: int,
    query_doc: Tensor | None = None,
    key_doc: Tensor | None = None,
) -> Tensor:
    """Which keys each query may attend to.

    Args:
        query_pos: [C] absolute positions of the queries (keys sit at positions 0..n_keys-1).
        n_keys: T, the number of keys.
        query_doc: [B, C] document ids of the queries (packed rows), or None.
        key_doc: [B, T] document ids of the keys; required with ``query_doc``.
    Returns:
        [1, C, T] (no documents) or [B, C, T] bool: key position <= query position, and the
        same document when documents are given.
    """
    key_pos = torch.arange(n_keys, device=query_pos.device)
    causal = (key_pos[None, :] <= query_pos[:, None])[None]  # [1, C, T]
    if query_doc is None:
        return causal
    return causal & (query_doc[:, :, None] == key_doc[:, None, :])


def indexer_scores(q: Tensor, weights: Tensor, keys: Tensor, scale: float) -> Tensor:
    """Lightning-indexer scores ``sum_h weights[h] * relu(scale * q[h] . k)``.

    Args:
        q: [B, C, Hi, di] index queries.
        weights: [B, C, Hi] per-query head weights.
        keys: [B, C|1, K, di] index keys (per query, or one set broadcast to all queries).
        scale: ``di ** -0.5``.
    Returns:
        [B, C, K] scores in at least float32.
    """
    dtype = torch.promote_types(q.dtype, torch.float32)
    logits = torch.einsum("bchd,bckd->bchk", q.to(dtype), keys.to(dtype))
    return torch.einsum("bchk,bch->bck", torch.relu(logits * scale), weights.to(dtype))


def select_topk(scores: Tensor, allowed: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """The ``min(top_k, K)`` best allowed keys per query.

    Args:
        scores: [B, C, K] indexer scores.
        allowed: [B|1, C, K] bool.
        top_k: keys to keep per query.
    Returns:
        ``indices`` [B, C, k] (int64) and ``valid`` [B, C, k] bool -- False where a query had
        fewer than k allowed keys and the slot holds a disallowed key.
    """
    k = min(top_k, scores.shape[-1])
    masked = scores.masked_fill(~allowed, float("-inf"))
    indices = masked.topk(k, dim=-1).indices
    valid = allowed.expand_as(scores).gather(-1, indices)
    return indices, valid


def gather_keys(x: Tensor, indices: Tensor) -> Tensor:
    """Rows of ``x`` [B, T, d] picked per query by ``indices`` [B, C, k] -> [B, C, k, d]."""
    B, C, k = indices.shape
    flat = indices.reshape(B, C * k, 1).expand(B, C * k, x.shape[-1])
    return x.gather(1, flat).view(B, C, k, x.shape[-1])


def latent_attention(
    q_latent: Tensor,
    q_rope: Tensor,
    latent: Tensor,
    k_rope: Tensor,
    allowed: Tensor,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """Absorbed multi-head latent attention over per-query (or shared) key sets.

    ``score[h, s] = scale * (q_latent[h] . latent[s] + q_rope[h] . k_rope[s])``; the output
    is the probability-weighted sum of the latents (the caller up-projects it to values).

    Args:
        q_latent: [B, C, H, r] queries with W_UK folded in.
        q_rope: [B, C, H, dr] RoPE part of the queries.
        latent: [B, C|1, K, r] compressed keys/values (normalised latents).
        k_rope: [B, C|1, K, dr] the shared RoPE key of each token.
        allowed: [B|1, C, K] bool; every query must have at least one allowed key.
        scale: softmax scale, ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``.
    Returns:
        ``o_latent`` [B, C, H, r] in ``q_latent``'s dtype and ``probs`` [B, C, H, K] (at least
        float32) -- the attention distribution, for the indexer's KL target.
    """
    dtype = torch.promote_types(q_latent.dtype, torch.float32)
    scores = torch.einsum("bchr,bckr->bchk", q_latent, latent) + torch.einsum(
        "bchd,bckd->bchk", q_rope, k_rope
    )
    scores = (scores.to(dtype) * scale).masked_fill(~allowed[:, :, None], float("-inf"))
    probs = scores.softmax(dim=-1)
    o_latent = torch.einsum("bchk,bckr->bchr", probs.to(latent.dtype), latent)
    return o_latent, probs


def sparse_latent_attention(
    q_latent: Tensor,
    q_rope: Tensor,
    latent: Tensor,
    k_rope: Tensor,
    indices: Tensor,
    valid: Tensor,
    scale: float,
    with_probs: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Absorbed latent attention of each query over its selected keys (the ``sparse_attention``
    surface): :func:`gather_keys` then :func:`latent_attention`.

    Args:
        q_latent: [B, C, H, r] queries with W_UK folded in.
        q_rope: [B, C, H, dr].
        latent: [B, T, r] every key's latent; k_rope: [B, T, dr].
        indices: [B, C, k] int, the selected keys (0 <= index < T).
        valid: [B, C, k] bool, False for a slot to leave out; each query has a valid slot.
        scale: the softmax scale.
        with_probs: also return the attention distribution averaged over heads.
    Returns:
        ``o_latent`` [B, C, H, r] in ``q_latent``'s dtype, and (``with_probs``) the detached
        head-mean probabilities [B, C, k] in at least float32 (the indexer's KL target),
        else None.
    """
    picked_latent = gather_keys(latent, indices)  # [B, C, k, r]
    picked_rope = gather_keys(k_rope, indices)  # [B, C, k, dr]
    o_latent, probs = latent_attention(q_latent, q_rope, picked_latent, picked_rope, valid, scale)
    return o_latent, probs.detach().mean(dim=2) if with_probs else None


def indexer_kl_loss(attn_probs: Tensor, index_scores: Tensor, allowed: Tensor) -> Tensor:
    """Per-query ``KL(p || softmax(index_scores))`` over the allowed keys.

    ``p`` is the attention distribution summed over heads and renormalised (DeepSeek-V3.2),
    detached: the loss trains the indexer only.

    Args:
        attn_probs: [B, C, H, K] attention probabilities (rows sum to 1).
        index_scores: [B, C, K] indexer scores (differentiable).
        allowed: [B|1, C, K] bool; disallowed keys have p = 0 and are left out of softmax.
    Returns:
        [B, C] KL divergence per query (>= 0).
    """
    return indexer_kl_to_target(attn_probs.detach().mean(dim=2), index_scores, allowed)


def indexer_kl_to_target(target: Tensor, index_scores: Tensor, allowed: Tensor) -> Tensor:
    """:func:`indexer_kl_loss` from the head-mean distribution ``target`` [B, C, K] (rows sum
    to 1, zero off ``allowed``; treated as a constant) -> [B, C]."""
    target = target.detach()
    logits = index_scores.masked_fill(~allowed, float("-inf"))
    log_q = torch.log_softmax(logits, dim=-1).masked_fill(~allowed, 0.0)
    return (torch.xlogy(target, target) - target * log_q).sum(dim=-1)
