"""DeepSeek sparse attention: lightning indexer, top-k selection and latent attention."""

from megacpp.kernels.ops.sparse_attention.reference import (
    allowed_keys,
    gather_keys,
    indexer_kl_loss,
    indexer_scores,
    latent_attention,
    select_topk,
)

__all__ = [
    "allowed_keys",
    "gather_keys",
    "indexer_kl_loss",
    "indexer_scores",
    "latent_attention",
    "select_topk",
]
