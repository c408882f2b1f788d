"""The DSA index cache (``[dsa] index_from``): a layer reuses an earlier DSA layer's top-k
selection, has no indexer of its own, and attends densely when no valid entry exists."""

from __future__ import annotations

import pytest
import torch

from megacpp.errors import ConfigError
from megacpp.model.cache import LockstepCache
from megacpp.model.config import ModelConfig
from megacpp.model.counting import count_model
from megacpp.model.dsa import DeepSeekSparseAttention, indexer_parameters
from megacpp.model.mla import MultiHeadLatentAttention
from megacpp.model.mlp import SwiGLU
from megacpp.model.model import HybridLM, next_token_labels
from tests.model.conftest import paged_decode
from tests.model.test_cut13 import small_cut13
from tests.model.test_dsa import DOCS, D, _x

CUT13_DSA = [3, 6, 9]  # the A:dsa layers of "A:mla E M A:dsa E M A:dsa E M A:dsa E R"


def _pair(top_k: int = 4, query_chunk: int = 4, seed: int = 0):
    """A source DSA layer and a second DSA layer (other weights) that reuses its indices."""
    layers = []
    for s in (seed, seed + 1):
        torch.manual_seed(s)
        attn = MultiHeadLatentAttention(D, 4, 12, 16, 8, 4, 6)
        layers.append(DeepSeekSparseAttention(attn, 16, 8, top_k, query_chunk=query_chunk))
    source, reuser = (m.double().eval() for m in layers)
    reuser.reuse_indices_of(source)
    return source, reuser


def _cached_selection(source: DeepSeekSparseAttention, L: int) -> torch.Tensor:
    """The source's last selection as a [B, L, L] keep mask (valid picks only)."""
    chunks = sorted(source.index_cache._entries, key=lambda entry: entry[0][1])  # by first row
    picked = torch.cat([indices for _, indices, _ in chunks], dim=1)
    valid = torch.cat([valid for *_, valid in chunks], dim=1)
    keep = torch.zeros(picked.shape[0], L, L, dtype=torch.bool)
    return keep.scatter(-1, picked, valid)


def _attend_with(layer: DeepSeekSparseAttention, x: torch.Tensor, keep: torch.Tensor):
    """The layer's naive (per-head K/V) MLA under the boolean mask ``keep`` [B, L, L]."""
    L = x.shape[1]
    cos, sin = layer.attn.rope_tables(0, L, x)
    q_nope, q_rope, _ = layer.attn.queries(x, cos, sin)
    latent, k_rope = layer.attn.compress_kv(x, cos, sin)
    return layer.attn.attend_naive(q_nope, q_rope, latent, k_rope, keep[:, None])


def _dense(layer: DeepSeekSparseAttention, run):
    """``run()`` with the layer in dense mode (every allowed key): the fallback's truth."""
    layer.mode = "dense_warmup"
    try:
        return run()
    finally:
        layer.mode = "sparse"


# -- reuse ----------------------------------------------------------------------------------
@pytest.mark.parametrize("doc_ids", [None, DOCS])
def test_reusing_layer_attends_over_the_source_selection(doc_ids):
    source, reuser = _pair()
    x_src, x = _x(1, 15, seed=1), _x(1, 15, seed=2)
    source(x_src, doc_ids=doc_ids)
    out = reuser(x, doc_ids=doc_ids)
    keep = _cached_selection(source, 15)
    torch.testing.assert_close(out, _attend_with(reuser, x, keep), rtol=1e-10, atol=1e-10)
    assert reuser.index_cache_misses == 0
    # the reused selection is not the reuser's dense attention (the test can fail)
    dense = _dense(reuser, lambda: reuser(x, doc_ids=doc_ids))
    assert not torch.allclose(out, dense, atol=1e-6)


def test_reusing_layer_has_no_indexer_params_cache_entry_flops_or_kl():
    source, reuser = _pair()
    assert reuser.indexer is None and not list(indexer_parameters(reuser))
    assert not any("indexer" in name for name in reuser.state_dict())
    assert "index_k" in source.paged_layout() and "index_k" not in reuser.paged_layout()
    assert source.cache_bytes_per_token() - reuser.cache_bytes_per_token() == 8 * 2
    assert reuser.flops_per_token(64) < source.flops_per_token(64)
    source.train(), reuser.train()
    x = _x(2, 12).requires_grad_()
    source(x)
    out = reuser(x)
    assert source.aux_loss is not None and reuser.aux_loss is None
    out.square().sum().backward()
    assert all(p.grad is not None for p in reuser.parameters())  # all of it is trained


# -- no valid cache: dense fallback, one test per case --------------------------------------
def test_source_that_never_ran_falls_back_to_dense():
    _source, reuser = _pair()
    x = _x(2, 12)
    out = reuser(x)
    assert reuser.index_cache_misses == 3  # three chunks of 4
    torch.testing.assert_close(out, _dense(reuser, lambda: reuser(x)), rtol=1e-12, atol=1e-12)


def test_other_sequence_length_falls_back_to_dense():
    source, reuser = _pair()
    source(_x(2, 12))
    x = _x(2, 10)
    out = reuser(x)
    assert reuser.index_cache_misses == 3  # chunks 0:4, 4:8, 8:10 -- none with 12 keys
    torch.testing.assert_close(out, _dense(reuser, lambda: reuser(x)), rtol=1e-12, atol=1e-12)


def test_other_chunking_falls_back_to_dense():
    source, reuser = _pair()
    reuser.query_chunk = 3  # changed after linking: rows 0:3, 3:6, ... are not cached
    x = _x(2, 12)
    source(x)
    out = reuser(x)
    assert reuser.index_cache_misses == 4
    torch.testing.assert_close(out, _dense(reuser, lambda: reuser(x)), rtol=1e-12, atol=1e-12)


def test_source_in_dense_mode_leaves_no_stale_entry():
    source, reuser = _pair()
    x = _x(2, 12)
    source(x)  # sparse: fills the cache
    source.mode = "dense_warmup"
    source(x)  # dense: clears it, stores nothing
    assert len(source.index_cache) == 0
    out = reuser(x)
    assert reuser.index_cache_misses == 3
    torch.testing.assert_close(out, _dense(reuser, lambda: reuser(x)), rtol=1e-12, atol=1e-12)


def test_paged_path_without_cached_paged_indices_falls_back_to_dense():
    source, reuser = _pair(top_k=3)
    x = _x(2, 12)
    source(x)  # a full forward's entries do not serve the paged path
    out, _ = paged_decode(reuser, x, prompt=5)
    assert reuser.index_cache_misses > 0
    dense, _ = _dense(reuser, lambda: paged_decode(reuser, x, prompt=5))
    torch.testing.assert_close(out, dense, rtol=1e-10, atol=1e-10)


def test_a_layer_that_is_not_a_dsa_layer_with_its_own_indexer_is_refused():
    source, reuser = _pair()
    with pytest.raises(ConfigError, match="A:dsa layer with its own indexer only, not of SwiGLU"):
        reuser.reuse_indices_of(SwiGLU(D, 16))
    with pytest.raises(ConfigError, match="reuses indices itself"):
        source.reuse_indices_of(reuser)
    other, _ = _pair(top_k=5)
    with pytest.raises(ConfigError, match="top_k and query_chunk"):
        other.reuse_indices_of(source)


# -- the config and the model -----------------------------------------------------------------
def _cut13(index_from, **model) -> ModelConfig:
    data = small_cut13().to_dict()
    data["dsa"]["index_from"] = index_from
    data["model"].update(model)
    return ModelConfig.from_dict(data)


@pytest.mark.parametrize(("index_from", "match"), [
    ([-1, 3], r"one entry per A:dsa layer: 3 \(layers \[3, 6, 9\]\)"),
    ([-1, 1, 3], "earlier A:dsa layer"),  # layer 1 is E: not a DSA layer
    ([-1, 9, 3], "earlier A:dsa layer"),  # a later layer
    ([-1, 3, 6], "with its own indexer"),  # layer 6 reuses itself
    ([0, 3, 3], "earlier A:dsa layer"),  # layer 0 is A:mla
])
def test_config_refuses_a_bad_index_from(index_from, match):
    with pytest.raises(ConfigError, match=match):
        _cut13(index_from)


def test_config_refuses_a_source_in_another_pipeline_stage():
    pattern = "A:mla E M A:dsa E M | A:dsa E M A:dsa E R"
    with pytest.raises(ConfigError, match="same stage"):
        _cut13([-1, 3, 6], pattern=pattern)
    _cut13([-1, -1, 6], pattern=pattern)  # within the second stage: fine


def test_model_counts_drop_the_reusing_indexers():
    plain, shared = small_cut13(), _cut13([-1, 3, 3])
    indexer = sum(p.numel() for p in HybridLM(plain).blocks[3].mixer.indexer.parameters())
    model = HybridLM(shared)
    assert [model.blocks[i].mixer.indexer is None for i in CUT13_DSA] == [False, True, True]
    cost, base = count_model(shared, seq_len=16), count_model(plain, seq_len=16)
    assert base.params - cost.params == 2 * indexer
    assert cost.params == sum(p.numel() for p in model.parameters())
    assert cost.cache_bytes_per_token == base.cache_bytes_per_token - 2 * 8 * 2
    assert cost.fwd_flops_per_token < base.fwd_flops_per_token


def test_model_trains_with_shared_indices():
    torch.manual_seed(0)
    model = HybridLM(_cut13([-1, 3, 3])).train()
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    doc_ids = torch.tensor([[0] * 9 + [1] * 7, [0] * 16])
    out = model(ids, doc_ids=doc_ids, labels=next_token_labels(ids, doc_ids))
    out.loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    assert not missing, missing
    assert all(model.blocks[i].mixer.index_cache_misses == 0 for i in CUT13_DSA)
    assert len(model.blocks[3].mixer.index_cache) == 4  # 16 tokens in chunks of 4


def test_model_paged_decode_reuses_indices_and_reproduces_full_forward():
    torch.manual_seed(0)
    model = HybridLM(_cut13([-1, 3, 3])).double().eval()
    ids = torch.randint(0, 97, (2, 14), generator=torch.Generator().manual_seed(1))
    full = model(ids).logits
    cache = LockstepCache(model, 2, 14, dtype=torch.float64, block_size=4)
    prefill = model.forward_paged(ids[:, :6], cache.layers, cache.advance(6), all_positions=True)
    steps = [model.forward_paged(ids[:, t : t + 1], cache.layers, cache.advance(1))
             for t in range(6, 14)]
    torch.testing.assert_close(torch.cat([prefill, torch.stack(steps, 1)], 1), full,
                               rtol=1e-9, atol=1e-9)
    assert all(model.blocks[i].mixer.index_cache_misses == 0 for i in CUT13_DSA)
    assert "index_k" not in cache.layers[6].tensors and "index_k" in cache.layers[3].tensors


def test_source_and_reusing_layer_compile_as_one_graph():
    """The cache's writes and lookups trace without a graph break (fullgraph), training mode:
    the same output as eager, no miss."""
    source, reuser = _pair()
    source.train(), reuser.train()

    def both(x):
        return reuser(source(x))

    x = _x(2, 12)
    expected = both(x)
    torch.testing.assert_close(torch.compile(both, fullgraph=True, backend="eager")(x), expected)
    assert reuser.index_cache_misses == 0


def test_a_model_built_from_another_plan_checks_index_from_again():
    from megacpp.pattern import load

    cfg = _cut13([-1, 3, 3])
    with pytest.raises(ConfigError, match="index_from has 3 entries; the stack has 2"):
        HybridLM(cfg, load("A:dsa E A:dsa E"))
    with pytest.raises(ConfigError, match="layer 6 cannot reuse layer 3.*same stage"):
        HybridLM(cfg, load("A:mla E M A:dsa E M | A:dsa E M A:dsa E R"))
