from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from megacpp.errors import MegaCppError
from megacpp.model.cache import LockstepCache
from megacpp.model.model import IGNORE_INDEX, HybridLM, next_token_labels
from tests.model.conftest import small_config
from tests.pattern.unbuilt import add_unbuilt_variant


def _model(cfg, seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    return HybridLM(cfg).to(dtype).eval()


def _tokens(B, L, vocab, seed=1):
    return torch.randint(0, vocab, (B, L), generator=torch.Generator().manual_seed(seed))


def test_shapes_and_loss(cfg):
    model = _model(cfg, dtype=torch.float32).train()
    ids = _tokens(2, 12, cfg.vocab_size)
    out = model(ids, labels=next_token_labels(ids))
    assert out.logits.shape == (2, 12, cfg.vocab_size)
    assert out.loss.ndim == 0 and torch.isfinite(out.loss)
    assert out.aux_loss is not None  # the E layer's sequence-level balance loss is on


def test_lm_loss_without_targets_is_zero_not_nan(cfg):
    """As the fused cross-entropy kernel: no real target gives a 0 loss and zero grads (a
    packed micro-batch of one-token documents must not poison a run)."""
    model = _model(cfg, dtype=torch.float32).train()
    ids = _tokens(2, 12, cfg.vocab_size)
    out = model(ids, labels=torch.full_like(ids, IGNORE_INDEX))
    assert out.lm_loss.item() == 0.0
    out.lm_loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.count_nonzero(g) == 0 for g in grads)
    labels = next_token_labels(ids)
    expected = torch.nn.functional.cross_entropy(model(ids).logits.flatten(0, 1),
                                                 labels.flatten(), ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(model(ids, labels=labels).lm_loss, expected)


def test_causality(cfg):
    """Changing token t never changes the outputs before t."""
    model = _model(cfg)
    ids = _tokens(1, 16, cfg.vocab_size)
    base = model(ids).logits
    for t in (0, 5, 11, 15):
        changed = ids.clone()
        changed[0, t] = (changed[0, t] + 1) % cfg.vocab_size
        out = model(changed).logits
        torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=1e-12)
        assert not torch.allclose(out[:, t:], base[:, t:])


def test_document_isolation_in_packed_rows(cfg):
    """A packed row gives each document the same logits as running it alone."""
    model = _model(cfg)
    lengths = [7, 5, 9]
    ids = _tokens(1, sum(lengths), cfg.vocab_size)
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    packed = model(ids, doc_ids=doc_ids).logits
    start = 0
    for n in lengths:
        alone = model(ids[:, start : start + n]).logits
        torch.testing.assert_close(packed[:, start : start + n], alone, rtol=1e-9, atol=1e-9)
        start += n


def test_every_parameter_receives_a_gradient(cfg):
    model = _model(cfg, dtype=torch.float32).train()
    ids = _tokens(2, 16, cfg.vocab_size)
    model(ids, labels=next_token_labels(ids)).loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    assert not missing, missing


def test_seeded_determinism(cfg):
    ids = _tokens(2, 10, cfg.vocab_size)
    a, b = _model(cfg, seed=3), _model(cfg, seed=3)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb)
    assert torch.equal(a(ids).logits, b(ids).logits)
    assert not torch.equal(_model(cfg, seed=4)(ids).logits, a(ids).logits)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 2e-4)])
def test_paged_decode_reproduces_full_forward(cfg, dtype, tol):
    model = _model(cfg, dtype=dtype)
    ids = _tokens(2, 14, cfg.vocab_size)
    full = model(ids).logits
    got = _lockstep_decode(model, ids, prompt=6, dtype=dtype)
    torch.testing.assert_close(got, full, rtol=tol, atol=tol)


def _lockstep_decode(model, ids, prompt, dtype):
    """Logits [B, L, V] of ``prompt`` tokens in one forward, then one token per step,
    through a LockstepCache (the paged caches, blocks of 4 tokens)."""
    cache = LockstepCache(model, ids.shape[0], ids.shape[1], dtype=dtype, block_size=4)
    bounds = [0, prompt, *range(prompt + 1, ids.shape[1] + 1)]
    parts = [model.forward_paged(ids[:, lo:hi], cache.layers, cache.advance(hi - lo),
                                 all_positions=True) for lo, hi in pairwise(bounds)]
    assert cache.length == ids.shape[1]
    with pytest.raises(ValueError, match="do not fit the cache"):
        cache.advance(1)
    return torch.cat(parts, 1)


def test_greedy_generation_matches_full_forward_argmax(cfg):
    model = _model(cfg)
    prompt = _tokens(2, 5, cfg.vocab_size)
    seq = model.generate_greedy(prompt, max_new_tokens=8)
    logits = model(seq[:, :-1]).logits
    assert torch.equal(seq[:, 5:], logits[:, 4:].argmax(-1))


def test_next_token_labels_never_cross_documents():
    ids = torch.tensor([[10, 11, 12, 20, 21, 30]])
    doc = torch.tensor([[0, 0, 0, 1, 1, 2]])
    labels = next_token_labels(ids, doc)
    assert labels.tolist() == [[11, 12, IGNORE_INDEX, 21, IGNORE_INDEX, IGNORE_INDEX]]


@pytest.mark.parametrize(
    "pattern,where", [("AEM:later", "layer 2"), ("M:later", "layer 0"), ("DA:mlaM:later", "layer 2")]
)
def test_unimplemented_variants_fail_closed_naming_the_layer(monkeypatch, pattern, where):
    add_unbuilt_variant(monkeypatch)
    with pytest.raises(MegaCppError, match=where):
        HybridLM(small_config(pattern))


def test_untied_head(cfg):
    model = _model(small_config(tie_embeddings=False))
    assert model.lm_head is not None
    ids = _tokens(1, 4, 97)
    assert model(ids).logits.shape == (1, 4, 97)


@pytest.mark.parametrize("autocast", [False, True])
def test_chained_blocks_equal_one_block_at_a_time(cfg, autocast):
    """residual_stream defers each block's residual add into the next block's norm (pending /
    defer); the stream and its gradients are exactly those of calling the blocks one by one
    (float32, and bf16 autocast where the pending output is bf16 and the stream float32)."""
    model = _model(cfg, dtype=torch.float32).train()
    ids = _tokens(2, 12, cfg.vocab_size)
    results = []
    for chained in (True, False):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if chained:
                x = model.residual_stream(ids)
            else:
                x = model.embed(ids)
                for block in model.blocks:
                    x = block(x)
        assert x.dtype == torch.float32
        grads = torch.autograd.grad(x.square().sum(), [model.embed.weight, model.blocks[0].norm.weight])
        results.append((x, *grads))
    for got, want in zip(*results):
        assert torch.equal(got, want)
