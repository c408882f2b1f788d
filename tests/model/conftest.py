from __future__ import annotations

import pytest

from megacpp.model.config import ModelConfig


def small_config(pattern: str = "AEMRDAM", **model) -> ModelConfig:
    """Every block family at test width (float64-friendly, a few thousand parameters)."""
    return ModelConfig.from_dict(
        {
            "model": {"pattern": pattern, "vocab_size": 97, "d_model": 32, **model},
            "attention": {"n_heads": 4, "n_kv_heads": 2, "head_dim": 8},
            "mamba": {"d_state": 8, "headdim": 8, "expand": 2, "chunk_size": 4},
            "rnn": {"n_heads": 2, "head_k_dim": 8, "head_v_dim": 16, "chunk_size": 4},
            "moe": {"n_experts": 4, "top_k": 2, "expert_ffn": 16, "seq_aux_loss_coef": 0.01},
            "mlp": {"ffn": 48},
        }
    )


@pytest.fixture
def cfg() -> ModelConfig:
    return small_config()


def paged_decode(mixer, x, prompt: int, block_size: int = 4):
    """An attention mixer over x [B, L, D] through a paged cache: the first ``prompt`` tokens
    in one forward, then one token per step -> (outputs [B, L, D], the pool)."""
    from itertools import pairwise

    import torch

    from megacpp.model.cache import PagedView, lockstep_batch, paged_pool

    B, L, _ = x.shape
    width = -(-L // block_size)
    pool = paged_pool(mixer.paged_layout(), B * width, block_size, x.device, x.dtype)
    tables = torch.arange(B * width).view(B, width)
    bounds = [0, prompt, *range(prompt + 1, L + 1)]
    parts = [mixer.forward_paged(x[:, lo:hi], PagedView(pool, lockstep_batch(tables, block_size,
                                                                              lo, hi - lo)))
             for lo, hi in pairwise(bounds)]
    return torch.cat(parts, dim=1), pool
