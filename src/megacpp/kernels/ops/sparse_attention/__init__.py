"""DeepSeek sparse attention: lightning indexer, top-k selection and latent attention.

The ``sparse_attention`` catalog surface (``spec.py``) is the latent attention over the
selected keys (:func:`sparse_latent_attention`); its Triton backend is ``triton.py``. The
index path (scores, top-k) runs the plain-PyTorch reference."""

from megacpp.kernels.ops.sparse_attention.reference import (
    allowed_keys,
    gather_keys,
    indexer_kl_loss,
    indexer_kl_to_target,
    indexer_scores,
    latent_attention,
    select_topk,
    sparse_latent_attention,
)

__all__ = [
    "allowed_keys",
    "gather_keys",
    "indexer_kl_loss",
    "indexer_kl_to_target",
    "indexer_scores",
    "latent_attention",
    "select_topk",
    "sparse_latent_attention",
]
