"""A:mla -- multi-head latent attention: naive vs absorbed decode, masks, cache, counting."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from megacpp.model.attention import GroupedQueryAttention
from megacpp.model.mla import MultiHeadLatentAttention
from tests.model.conftest import paged_decode

D = 32


def _mla(q_lora_rank: int = 12, seed: int = 0) -> MultiHeadLatentAttention:
    torch.manual_seed(seed)
    return MultiHeadLatentAttention(
        d_model=D,
        n_heads=4,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
    ).double()


def _x(B: int, L: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(B, L, D, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _decode(mla: MultiHeadLatentAttention, x: torch.Tensor, prompt: int) -> torch.Tensor:
    """Prefill ``prompt`` tokens, then one token per step, through a fresh paged cache."""
    return paged_decode(mla, x, prompt)[0]


@pytest.mark.parametrize("q_lora_rank", [12, 0])
def test_absorbed_decode_equals_naive_decode_equals_full_forward(q_lora_rank):
    mla = _mla(q_lora_rank)
    x = _x(2, 11)
    full = mla(x)
    mla.decode_mode = "naive"
    naive = _decode(mla, x, prompt=4)
    mla.decode_mode = "absorbed"
    absorbed = _decode(mla, x, prompt=4)
    torch.testing.assert_close(naive, full, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(absorbed, full, rtol=1e-10, atol=1e-10)


def test_absorbed_attention_never_builds_per_head_keys():
    """The absorbed path must not call kv_up (the per-head up-projection) at all."""
    mla = _mla()
    calls = []
    mla.kv_up.register_forward_hook(lambda *_: calls.append(1))
    _decode(mla, _x(1, 6), prompt=3)
    assert calls == []
    mla.decode_mode = "naive"
    _decode(mla, _x(1, 6), prompt=3)
    assert len(calls) == 4  # prefill + 3 steps


def test_causality():
    mla = _mla()
    x = _x(1, 10)
    base = mla(x)
    for t in (0, 4, 9):
        changed = x.clone()
        changed[:, t] += 1.0
        out = mla(changed)
        torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=1e-12)
        assert not torch.allclose(out[:, t:], base[:, t:])


def test_packed_row_equals_documents_alone():
    mla = _mla()
    x = _x(1, 12)
    doc = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3])
    packed = mla(x, doc_ids=doc)
    for lo, hi in [(0, 5), (5, 9), (9, 12)]:  # RoPE is relative: position in the row is moot
        torch.testing.assert_close(packed[:, lo:hi], mla(x[:, lo:hi]), rtol=1e-10, atol=1e-10)


def test_cache_layout_and_bytes():
    mla = _mla()
    assert mla.paged_layout() == {"latent": (16,), "k_rope": (4,)}
    _, pool = paged_decode(mla, _x(3, 8), prompt=3)
    assert pool.tensors["latent"].shape == (6, 4, 16) and pool.tensors["k_rope"].shape == (6, 4, 4)
    assert pool.nbytes() == 3 * 8 * mla.cache_bytes_per_token(torch.float64)
    assert mla.cache_bytes_per_token(torch.bfloat16) == (16 + 4) * 2
    gqa = GroupedQueryAttention(D, n_heads=4, n_kv_heads=4, head_dim=10)  # same q.k width
    assert mla.cache_bytes_per_token() < gqa.cache_bytes_per_token()


@pytest.mark.parametrize("q_lora_rank", [12, 0])
def test_flops_match_flop_counter(q_lora_rank):
    mla = _mla(q_lora_rank).float()
    B, L = 2, 16
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, torch.no_grad():
        mla(torch.randn(B, L, D))
    assert counter.get_total_flops() == B * L * mla.flops_per_token(L)
