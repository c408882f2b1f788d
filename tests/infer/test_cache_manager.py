"""The engine's cache memory: per-family pool layouts, block/slot counters, paged forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megacpp.errors import MegaCppError
from megacpp.infer.cache_manager import CacheManager, IdAllocator
from megacpp.model.attention import grouped_attention
from megacpp.model.cache import LockstepCache, PagedBatch, PagedPool
from megacpp.model.model import HybridLM
from tests.model.conftest import small_config


def _manager(pattern: str = "AEMRDA:mla", **kw) -> tuple[HybridLM, CacheManager]:
    torch.manual_seed(0)
    model = HybridLM(small_config(pattern)).double().eval()
    args = {"num_blocks": 6, "block_size": 4, "max_num_seqs": 3, "device": torch.device("cpu"),
            "dtype": torch.float64, **kw}
    return model, CacheManager(model, **args)


def test_pools_are_laid_out_by_family():
    model, cache = _manager("AEMRDA:mlaA:dsa")
    gqa, moe, mamba, rnn, dense, mla, dsa = cache.layers
    assert moe is None and dense is None
    assert isinstance(gqa, PagedPool) and set(gqa.tensors) == {"k", "v"}
    assert gqa.tensors["k"].shape == (7, 4, 2, 8)  # [num_blocks + scratch, bs, Hkv, hd]
    assert set(mla.tensors) == {"latent", "k_rope"}
    assert set(dsa.tensors) == {"latent", "k_rope", "index_k"}
    assert mla.tensors["latent"].shape[:2] == (7, 4)
    assert mamba.ssm.shape[0] == 4 and rnn.state.shape[0] == 4  # max_num_seqs + scratch slot
    assert mamba.ssm.dtype == torch.float64
    by_family = cache.bytes_by_family()
    assert set(by_family) == {"A", "M", "R"}
    assert by_family["A"] == gqa.nbytes() + mla.nbytes() + dsa.nbytes()
    assert by_family["M"] == model.blocks[2].mixer.state_bytes(4, torch.float64)
    assert by_family["R"] == model.blocks[3].mixer.state_bytes(4, torch.float64)
    assert cache.nbytes() == sum(by_family.values())


def test_block_and_slot_counters():
    _, cache = _manager()
    assert cache.reserve("a", 9)  # 3 blocks
    assert cache.tables["a"] == [0, 1, 2] and cache.blocks.num_free == 3
    assert cache.reserve("a", 12) and len(cache.tables["a"]) == 3  # still fits
    assert cache.reserve("b", 1) and cache.blocks_needed("b", 13) == 3
    assert cache.blocks_needed("b", 13) > cache.blocks.num_free and not cache.reserve("b", 13)
    assert cache.blocks.num_free == 2  # a failed reserve allocates nothing
    cache.open_slot("a")
    cache.open_slot("b")
    assert cache.slots.num_free == 1
    cache.release("a")
    assert cache.blocks.num_free == 5 and cache.slots.num_free == 2 and "a" not in cache.tables
    cache.release("a")  # twice: no-op
    assert cache.blocks.num_free == 5
    with pytest.raises(MegaCppError, match="out of state slots"):
        IdAllocator(1, "state slots").allocate(2)


def test_a_new_slot_starts_from_the_empty_state():
    _, cache = _manager()
    mamba = cache.layers[2]
    mamba.ssm.fill_(3.0)
    slot = cache.open_slot("a")
    assert mamba.ssm[slot].abs().sum() == 0 and mamba.ssm[slot + 1].abs().sum() > 0


@pytest.mark.parametrize("pattern", ["AEMRD", "A:mlaMA:dsaR"])
def test_paged_forward_with_rows_at_different_positions_equals_each_row_alone(pattern):
    """Two rows at lengths 5 and 9, blocks scattered through the pool, one batched decode
    step: each row's logits equal its own decode in a one-row cache and the full forward's
    (float64)."""
    model, cache = _manager(pattern, num_blocks=8)
    g = torch.Generator().manual_seed(3)
    seqs = {"a": torch.randint(0, 97, (6,), generator=g), "b": torch.randint(0, 97, (10,), generator=g)}
    expected = []
    for tokens in seqs.values():
        ref = LockstepCache(model, 1, 16, "cpu", torch.float64)
        model.forward_paged(tokens[None, :-1], ref.layers, ref.advance(len(tokens) - 1))
        expected.append(model.forward_paged(tokens[None, -1:], ref.layers, ref.advance(1)))
        torch.testing.assert_close(expected[-1][0], model(tokens[None]).logits[0, -1],
                                   rtol=1e-9, atol=1e-9)
    cache.reserve("pad", 4)  # so the sequences' blocks are not 0, 1, 2...
    for sid, tokens in seqs.items():
        cache.open_slot(sid)
        cache.reserve(sid, len(tokens))
        n = len(tokens) - 1
        positions = torch.arange(n)[None]
        table = torch.tensor(cache.tables[sid])
        batch = PagedBatch(positions, table[positions[0] // 4] * 4 + positions[0] % 4,
                           table[None], torch.tensor([cache.slot_of[sid]]))
        model.forward_paged(tokens[None, :-1], cache.layers, batch)
    pos = torch.tensor([5, 9])
    tables = torch.tensor([cache.tables["a"] + [cache.null_block], cache.tables["b"]])
    batch = PagedBatch(
        positions=pos[:, None],
        slot_mapping=tables[torch.arange(2), pos // 4] * 4 + pos % 4,
        block_tables=tables,
        state_slots=torch.tensor([cache.slot_of["a"], cache.slot_of["b"]]),
    )
    tokens = torch.stack([seqs["a"][-1:], seqs["b"][-1:]])
    logits = model.forward_paged(tokens, cache.layers, batch)
    torch.testing.assert_close(logits, torch.cat(expected), rtol=1e-9, atol=1e-9)


def test_grouped_attention_equals_sdpa_with_gqa():
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, L, T, hd = 3, 6, 2, 4, 11, 8
    q = torch.randn(B, H, L, hd, generator=g, dtype=torch.float64)
    k = torch.randn(B, T, Hkv, hd, generator=g, dtype=torch.float64)
    v = torch.randn(B, T, Hkv, hd, generator=g, dtype=torch.float64)
    positions = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10], [0, 1, 2, 3]])
    allowed = torch.arange(T)[None, None] <= positions[:, :, None]  # [B, L, T]
    expected = F.scaled_dot_product_attention(
        q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed[:, None], enable_gqa=True
    )
    torch.testing.assert_close(grouped_attention(q, k, v, allowed), expected)
