"""Serving a model whose DSA layers share indices (``[dsa] index_from``): the engine's paged
prefill and decode steps reuse the source layer's selection (no cache misses) and decode the
full forward's greedy tokens."""

from __future__ import annotations

import torch

from megacpp.infer.generate import TextGenerator
from megacpp.model.config import ModelConfig
from megacpp.model.model import HybridLM
from tests.infer.test_one_decode_path import (  # noqa: F401 (tokenizer: a fixture)
    PROMPTS,
    assert_greedy_is_full_forward_argmax,
    tokenizer,
)


def _model(vocab: int) -> HybridLM:
    """Two A:dsa layers, the second reusing the first's selection; top-k 4 is below the
    prompt lengths (sparse), 16 index heads make exact indexer-score ties unlikely."""
    cfg = ModelConfig.from_dict({
        "model": {"pattern": "A:dsa R A:dsa D", "vocab_size": vocab, "d_model": 32,
                  "init_std": 0.3},
        "mla": {"n_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 16,
                "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8},
        "dsa": {"index_n_heads": 16, "index_head_dim": 16, "top_k": 4, "query_chunk": 8,
                "index_from": [-1, 0]},
        "rnn": {"n_heads": 2, "head_k_dim": 8, "head_v_dim": 16, "chunk_size": 4},
        "mlp": {"ffn": 48},
    })
    torch.manual_seed(0)
    return HybridLM(cfg).eval()


def test_engine_decodes_with_shared_indices_like_the_full_forward(tokenizer):  # noqa: F811
    model = _model(tokenizer.vocab_size)
    source, reuser = model.blocks[0].mixer, model.blocks[2].mixer
    assert reuser.indexer is None and "index_k" not in reuser.paged_layout()
    generator = TextGenerator(model, tokenizer)
    for prompt in PROMPTS:
        assert_greedy_is_full_forward_argmax(model, generator, tokenizer, prompt)
    assert reuser.index_cache_misses == 0 and len(source.index_cache) > 0
