"""A:dsa -- DeepSeek sparse attention: the index path op, the layer, its KL loss, capture."""

from __future__ import annotations

import pytest
import torch

from megacpp.errors import ConfigError
from megacpp.kernels.ops.document_attention.reference import document_causal_mask
from megacpp.kernels.ops.sparse_attention import (
    allowed_keys,
    gather_keys,
    indexer_kl_loss,
    indexer_scores,
    latent_attention,
    select_topk,
)
from megacpp.model.dsa import (
    DeepSeekSparseAttention,
    LightningIndexer,
    indexer_parameters,
    set_dsa_mode,
)
from megacpp.model.mla import MultiHeadLatentAttention
from tests.model.conftest import paged_decode

D = 32
DOCS = torch.tensor([[0] * 6 + [1] * 5 + [2] * 4])  # a packed row of 15 tokens


def _dsa(top_k: int = 4, mode: str = "sparse", query_chunk: int = 4) -> DeepSeekSparseAttention:
    """16 index heads: an exact tie of two ReLU-summed scores is then vanishingly unlikely, so
    top-k picks the same keys wherever the scores are the same."""
    torch.manual_seed(0)
    attn = MultiHeadLatentAttention(D, 4, 12, 16, 8, 4, 6)
    dsa = DeepSeekSparseAttention(attn, 16, 8, top_k, mode=mode, query_chunk=query_chunk)
    return dsa.double().eval()


def _x(B: int, L: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(B, L, D, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _mask_reference(dsa: DeepSeekSparseAttention, x: torch.Tensor, doc_ids=None) -> torch.Tensor:
    """DSA the obvious way: score every key, keep the top-k allowed ones as a boolean mask,
    run naive (per-head K/V) MLA under that mask. No chunking, gathering or absorption."""
    B, L, _ = x.shape
    cos, sin = dsa.attn.rope_tables(0, L, x)
    q_nope, q_rope, q_in = dsa.attn.queries(x, cos, sin)
    latent, k_rope = dsa.attn.compress_kv(x, cos, sin)
    index_q, weights = dsa.indexer.queries(x, q_in, cos, sin)
    index_k = dsa.indexer.keys(x, cos, sin)
    logits = torch.einsum("blhd,btd->blht", index_q, index_k) * dsa.indexer.scale
    scores = torch.einsum("blht,blh->blt", logits.relu(), weights)
    if doc_ids is None:
        allowed = torch.ones(1, L, L, dtype=torch.bool).tril()
    else:
        allowed = document_causal_mask(doc_ids)
    top = scores.masked_fill(~allowed, float("-inf")).topk(min(dsa.top_k, L), dim=-1).indices
    keep = torch.zeros(B, L, L, dtype=torch.bool).scatter(-1, top, True) & allowed
    return dsa.attn.attend_naive(q_nope, q_rope, latent, k_rope, keep[:, None])


# -- the op ---------------------------------------------------------------------------------
def test_selection_only_picks_past_keys_of_the_same_document():
    g = torch.Generator().manual_seed(0)
    L = DOCS.shape[1]
    scores = torch.randn(1, L, L, generator=g)
    allowed = allowed_keys(torch.arange(L), L, DOCS, DOCS)
    picked, valid = select_topk(scores, allowed, top_k=3)
    assert picked.shape == valid.shape == (1, L, 3)
    query = torch.arange(L)[:, None].expand(L, 3)
    doc = DOCS[0]
    ok = (picked[0] <= query) & (doc[picked[0]] == doc[query])
    assert torch.equal(valid[0], ok)  # valid exactly where the pick is allowed
    n_allowed = allowed[0].sum(-1)  # the first token of each doc has one allowed key
    assert torch.equal(valid[0].sum(-1), n_allowed.clamp(max=3))


def test_gathered_attention_with_every_key_equals_dense():
    g = torch.Generator().manual_seed(0)
    B, C, H, T, r, dr = 2, 5, 3, 7, 6, 4
    q_lat, q_rope = torch.randn(B, C, H, r, generator=g), torch.randn(B, C, H, dr, generator=g)
    latent, k_rope = torch.randn(B, T, r, generator=g), torch.randn(B, T, dr, generator=g)
    allowed = allowed_keys(torch.arange(T - C, T), T)
    picked, valid = select_topk(torch.randn(B, C, T, generator=g), allowed, top_k=T)
    sparse, _ = latent_attention(
        q_lat, q_rope, gather_keys(latent, picked), gather_keys(k_rope, picked), valid, 0.3
    )
    dense, _ = latent_attention(q_lat, q_rope, latent[:, None], k_rope[:, None], allowed, 0.3)
    torch.testing.assert_close(sparse, dense, rtol=1e-6, atol=1e-6)


def test_kl_loss_is_zero_when_the_indexer_matches_attention():
    probs = torch.softmax(torch.randn(1, 2, 3, 5), -1)  # [B, C, H, K]
    allowed = torch.ones(1, 2, 5, dtype=torch.bool)
    matching = probs.mean(2).log()
    torch.testing.assert_close(
        indexer_kl_loss(probs, matching, allowed), torch.zeros(1, 2), rtol=0, atol=1e-6
    )
    assert (indexer_kl_loss(probs, torch.randn(1, 2, 5), allowed) > 0).all()


# -- the layer ------------------------------------------------------------------------------
def test_top_k_covering_every_key_equals_dense_causal_attention():
    dsa = _dsa(top_k=64)
    x = _x(2, 13)
    torch.testing.assert_close(dsa(x), dsa.attn(x), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(
        dsa(x[:1, :15], doc_ids=DOCS[:, :13]), dsa.attn(x[:1], doc_ids=DOCS[:, :13])
    )


def test_dense_warmup_attends_densely_whatever_top_k():
    dsa = _dsa(top_k=2, mode="dense_warmup")
    x = _x(2, 13)
    torch.testing.assert_close(dsa(x), dsa.attn(x), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("doc_ids", [None, DOCS])
def test_sparse_path_equals_the_mask_reference(doc_ids):
    dsa = _dsa(top_k=3, query_chunk=4)
    x = _x(1, 15)
    torch.testing.assert_close(
        dsa(x, doc_ids=doc_ids), _mask_reference(dsa, x, doc_ids), rtol=1e-10, atol=1e-10
    )
    assert not torch.allclose(dsa(x), dsa.attn(x))  # top-3 really is sparser than dense


def test_query_chunk_does_not_change_the_result():
    x = _x(2, 15)
    torch.testing.assert_close(_dsa(query_chunk=2)(x), _dsa(query_chunk=64)(x))


def test_causality():
    dsa = _dsa(top_k=3)
    x = _x(1, 12)
    base = dsa(x)
    for t in (0, 5, 11):
        changed = x.clone()
        changed[:, t] += 1.0
        out = dsa(changed)
        torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=1e-12)
        assert not torch.allclose(out[:, t:], base[:, t:])


def test_packed_row_equals_documents_alone():
    dsa = _dsa(top_k=3)
    x = _x(1, 15)
    packed = dsa(x, doc_ids=DOCS)
    for lo, hi in [(0, 6), (6, 11), (11, 15)]:
        torch.testing.assert_close(packed[:, lo:hi], dsa(x[:, lo:hi]), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mode", ["sparse", "dense_warmup"])
def test_paged_decode_equals_full_forward(mode):
    dsa = _dsa(top_k=3, mode=mode)
    x = _x(2, 12)
    out, pool = paged_decode(dsa, x, prompt=5)
    torch.testing.assert_close(out, dsa(x), rtol=1e-10, atol=1e-10)
    assert pool.tensors["index_k"].shape == (6, 4, 8)  # [B * 3 blocks, block_size, di]
    assert pool.nbytes() == 2 * 12 * dsa.cache_bytes_per_token(torch.float64)


# -- the indexer's training signal ---------------------------------------------------------
@pytest.mark.parametrize("mode", ["sparse", "dense_warmup"])
def test_kl_trains_the_indexer_only_and_the_lm_loss_never_reaches_it(mode):
    dsa = _dsa(top_k=3, mode=mode).train()
    x = _x(2, 12).requires_grad_()
    out = dsa(x)
    assert dsa.aux_loss is not None and dsa.aux_loss.ndim == 0
    assert torch.isfinite(dsa.aux_loss) and dsa.aux_loss > 0
    indexer = {id(p) for p in indexer_parameters(dsa)}
    out.square().sum().backward(retain_graph=True)  # stands in for the LM loss
    for name, p in dsa.named_parameters():
        assert (p.grad is None) == (id(p) in indexer), name
    dsa.zero_grad(set_to_none=True)
    x.grad = None
    dsa.aux_loss.backward()
    for name, p in dsa.named_parameters():
        has_grad = p.grad is not None and p.grad.abs().sum() > 0
        assert has_grad == (id(p) in indexer), name
    assert x.grad is None  # the indexer's inputs are detached
    dsa.eval()
    dsa(x)
    assert dsa.aux_loss is None


def test_set_dsa_mode_and_bad_modes():
    dsa = _dsa()
    set_dsa_mode(dsa, "dense_warmup")
    assert dsa.mode == "dense_warmup"
    with pytest.raises(ConfigError, match="dsa.mode = 'dense'.*'dense_warmup' or 'sparse'"):
        set_dsa_mode(dsa, "dense")
    with pytest.raises(ConfigError, match="dsa.mode"):
        DeepSeekSparseAttention(dsa.attn, 2, 8, 4, mode="sparce")


def test_indexer_ropes_only_its_first_dims():
    indexer = LightningIndexer(D, 12, n_heads=2, head_dim=8, rope_dim=4).double()
    x = _x(1, 5)
    cos, sin = torch.ones(5, 2, dtype=torch.float64), torch.zeros(5, 2, dtype=torch.float64)
    k_still = indexer.keys(x, cos, sin)  # angle 0: RoPE is the identity
    cos2, sin2 = torch.zeros_like(cos), torch.ones_like(sin)  # angle 90 degrees
    k_turned = indexer.keys(x, cos2, sin2)
    torch.testing.assert_close(k_turned[..., 4:], k_still[..., 4:])
    assert not torch.allclose(k_turned[..., :4], k_still[..., :4])


def test_flops_match_flop_counter_in_training_mode():
    from torch.utils.flop_counter import FlopCounterMode

    for mode, top_k in [("sparse", 5), ("sparse", 64), ("dense_warmup", 5)]:
        dsa = _dsa(top_k=top_k, mode=mode).float().train()
        B, L = 2, 16
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            dsa(torch.randn(B, L, D))
        assert counter.get_total_flops() == B * L * dsa.flops_per_token(L), (mode, top_k)


# -- capture safety ---------------------------------------------------------------------------
def _index_path(index_q, weights, index_k, q_latent, q_rope, latent, k_rope, allowed):
    """Indexer scores -> top-k -> gather -> sparse latent attention, as one function."""
    scores = indexer_scores(index_q, weights, index_k[:, None], 0.35)
    picked, valid = select_topk(scores, allowed, top_k=3)
    keys_latent, keys_rope = gather_keys(latent, picked), gather_keys(k_rope, picked)
    o_latent, _ = latent_attention(q_latent, q_rope, keys_latent, keys_rope, valid, 0.3)
    return o_latent, picked


def _index_inputs(device: str = "cpu") -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device=device).manual_seed(0)
    B, C, T, Hi, di, H, r, dr = 2, 4, 9, 3, 8, 2, 6, 4

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=device)

    allowed = allowed_keys(torch.arange(T - C, T, device=device), T)
    return (
        rand(B, C, Hi, di), rand(B, C, Hi), rand(B, T, di), rand(B, C, H, r), rand(B, C, H, dr),
        rand(B, T, r), rand(B, T, dr), allowed,
    )  # fmt: skip


def test_index_path_compiles_without_graph_breaks():
    """fullgraph=True fails on any host sync (.item(), nonzero...) or data-dependent branch.
    aot_eager traces the graph through AOTAutograd like inductor does, minus inductor's C++
    codegen (about a minute on a small CPU; see docs/mla-dsa-mtp.md)."""
    torch._dynamo.reset()
    inputs = _index_inputs()
    compiled = torch.compile(_index_path, fullgraph=True, backend="aot_eager")
    o_latent, picked = compiled(*inputs)
    ref_o, ref_picked = _index_path(*inputs)
    assert torch.equal(picked, ref_picked)
    torch.testing.assert_close(o_latent, ref_o)


def test_whole_dsa_layer_compiles_as_one_graph():
    """The full layer in training mode -- chunk loop, selection, gather, KL -- in one graph."""
    torch._dynamo.reset()
    dsa = _dsa(top_k=3, query_chunk=4).float().train()
    x = torch.randn(1, 10, D)
    out = torch.compile(dsa, fullgraph=True, backend="eager")(x)
    (out.sum() + dsa.aux_loss).backward()
    torch.testing.assert_close(out, dsa(x))
    assert all(p.grad is not None for p in indexer_parameters(dsa))


@pytest.mark.gpu
def test_index_path_captures_in_a_cuda_graph():
    inputs = _index_inputs("cuda")
    expected_o, expected_picked = _index_path(*inputs)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up outside the capture
        _index_path(*inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_latent, picked = _index_path(*inputs)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(picked, expected_picked)
    torch.testing.assert_close(o_latent, expected_o)
