"""The structure-id embedding and the hashed n-gram branch (model/features.py): config
validation, the hash against a plain-Python reference, document boundaries and decode
context, zero init, the cached decode path, parameter counting and optimizer grouping."""

from __future__ import annotations

import pytest
import torch

from megacpp.data.structure import NUM_STRUCTURE_IDS as DATA_STRUCTURE_IDS
from megacpp.errors import ConfigError, MegaCppError
from megacpp.model.config import ModelConfig, list_presets, load_config
from megacpp.model.counting import count_model
from megacpp.model.features import NUM_STRUCTURE_IDS, ngram_multipliers
from megacpp.model.model import HybridLM
from megacpp.train.optim import group_parameters

VOCAB = 300


def config(structure: bool = False, orders: tuple[int, ...] = (), table_size: int = 97,
           pattern: str = "AEMR") -> ModelConfig:
    return ModelConfig.from_dict({
        "model": {"pattern": pattern, "vocab_size": VOCAB, "d_model": 32, "init_std": 0.3},
        "attention": {"n_heads": 2, "n_kv_heads": 1, "head_dim": 16},
        "mamba": {"d_state": 16, "headdim": 16, "chunk_size": 8},
        "rnn": {"n_heads": 2, "head_k_dim": 16, "head_v_dim": 16, "chunk_size": 8},
        "moe": {"n_experts": 4, "top_k": 2, "expert_ffn": 32},
        "structure": {"embedding": structure},
        "ngram": {"orders": list(orders), "table_size": table_size, "hash_seed": 7},
    })


def model_with_random_features(cfg: ModelConfig) -> HybridLM:
    """A float64 model whose feature tables are random (they start at zero)."""
    torch.manual_seed(0)
    model = HybridLM(cfg).double().eval()
    for module in (model.structure_embed, model.ngram_embed):
        for p in [] if module is None else module.parameters():
            torch.nn.init.normal_(p, std=0.5)
    return model


def test_the_model_has_one_structure_row_per_data_structure_id():
    assert NUM_STRUCTURE_IDS == DATA_STRUCTURE_IDS


def test_both_features_are_off_by_default_and_in_every_preset():
    assert not ModelConfig().structure.embedding and ModelConfig().ngram.orders == ()
    for preset in list_presets():
        cfg = load_config(preset)
        assert not cfg.structure.embedding and cfg.ngram.orders == (), preset
        model_keys = {n for n, _ in HybridLM(cfg).named_parameters()} if preset == "tiny" else set()
        assert not any("structure" in n or "ngram" in n for n in model_keys)


@pytest.mark.parametrize(("table", "message"), [
    ({"ngram": {"orders": [1, 2]}}, "ngram.orders"),
    ({"ngram": {"orders": [3, 2]}}, "ngram.orders"),
    ({"ngram": {"orders": [2, 2]}}, "ngram.orders"),
    ({"ngram": {"orders": [2, 9]}}, "ngram.orders"),
    ({"ngram": {"orders": ["2"]}}, "ngram.orders"),
    ({"ngram": {"orders": 2}}, "ngram.orders"),
    ({"ngram": {"orders": [2], "table_size": 0}}, "ngram.table_size"),
    ({"ngram": {"hash_seed": -1}}, "ngram.hash_seed"),
    ({"ngram": {"order": [2]}}, "order"),
    ({"structure": {"embedding": 1}}, "structure.embedding"),
    ({"structure": {"enabled": True}}, "enabled"),
])
def test_bad_feature_config_is_a_clear_error(table, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict({"model": {"pattern": "A"}, **table})


def test_config_round_trips_through_its_dict():
    cfg = config(structure=True, orders=(2, 4))
    data = cfg.to_dict()
    assert data["ngram"] == {"orders": [2, 4], "table_size": 97, "hash_seed": 7}
    assert data["structure"] == {"embedding": True}
    assert ModelConfig.from_dict(data) == cfg
    saved = {k: v for k, v in data.items() if k not in ("structure", "ngram")}
    old = ModelConfig.from_saved(saved)  # a config saved before the tables existed: both off
    assert not old.structure.embedding and old.ngram.orders == ()


def _reference_hash(tokens: list[int], docs: list[int], i: int, n: int, row: list[int],
                    table_size: int) -> int:
    h = 0
    for j in range(n):
        same = i - j >= 0 and docs[i - j] == docs[i]
        value = tokens[i - j] + 1 if same else 0
        h ^= value * row[j]
    return h % table_size


def test_hash_ids_match_a_plain_python_reference_with_document_boundaries():
    cfg = config(orders=(2, 3))
    model = HybridLM(cfg)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, 15), generator=g)
    docs = torch.tensor([[0] * 6 + [1] * 9, [0] * 15])
    got = model.ngram_embed.hash_ids(ids, doc_ids=docs)  # [2 orders, B, L]
    mult = ngram_multipliers((2, 3), 7).tolist()
    for k, n in enumerate((2, 3)):
        for b in range(2):
            for i in range(15):
                want = _reference_hash(ids[b].tolist(), docs[b].tolist(), i, n, mult[k], 97)
                assert got[k, b, i].item() == want
    # a document's features do not depend on what is packed before it
    alone = model.ngram_embed.hash_ids(ids[:1, 6:])
    assert torch.equal(got[:, :1, 6:], alone)
    assert len(set(got[1].flatten().tolist())) > 10  # the hash spreads over the table


def test_context_continues_a_sequence_exactly():
    """Features of tokens [t:] with the context of the tokens before == of the whole row."""
    model = HybridLM(config(orders=(2, 4)))
    emb = model.ngram_embed
    ids = torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(4))
    whole = emb.hash_ids(ids)
    context = emb.next_context(None, ids[:, :1])
    for t in range(1, 20):
        assert torch.equal(emb.hash_ids(ids[:, t:], context), whole[:, :, t:]), t
        context = emb.next_context(context, ids[:, t : t + 1])
    assert context.shape == (3, 3)
    with pytest.raises(ValueError, match="ngram context"):
        emb.hash_ids(ids, context[:, :2])


def test_zero_initialised_features_leave_the_function_unchanged():
    """Same seed, feature on or off: the same weights everywhere else (an ablation compares
    the feature alone), zero feature tables, hence the same logits."""
    torch.manual_seed(0)
    plain = HybridLM(config()).double().eval()
    torch.manual_seed(0)
    featured = HybridLM(config(structure=True, orders=(2, 3))).double().eval()
    featured_state = featured.state_dict()
    for name, value in plain.state_dict().items():
        assert torch.equal(featured_state[name], value), name
    extra = set(featured_state) - set(plain.state_dict())
    assert extra and all("structure" in n or "ngram" in n for n in extra)
    assert all(not featured_state[n].any() for n in extra)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    structure = torch.randint(0, NUM_STRUCTURE_IDS, (2, 12))
    assert torch.equal(plain(ids).logits, featured(ids, structure_ids=structure).logits)


def test_structure_ids_change_the_logits_and_are_required():
    model = model_with_random_features(config(structure=True))
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(6))
    zeros = torch.zeros_like(ids)
    comments = torch.full_like(ids, 2)
    assert not torch.allclose(model(ids, structure_ids=zeros).logits,
                              model(ids, structure_ids=comments).logits)
    with pytest.raises(MegaCppError, match="structure_ids"):
        model(ids)
    with pytest.raises(MegaCppError, match="structure ids"):
        model.generate_greedy(ids, 2)


@pytest.mark.parametrize("pattern", ["AEMR", "A:mla D"])
def test_cached_greedy_decode_equals_the_full_forward_with_ngrams(pattern):
    cfg = config(orders=(2, 3), pattern=pattern)
    if pattern == "A:mla D":
        cfg = ModelConfig.from_dict({**cfg.to_dict(), "mla": {
            "n_heads": 2, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
            "v_head_dim": 8}})
    model = model_with_random_features(cfg)
    prompt = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(8))
    out = model.generate_greedy(prompt, 10)
    for t in range(9, 19):  # each generated token is the full forward's argmax
        assert torch.equal(model(out[:, :t]).logits[:, -1].argmax(-1), out[:, t])
    assert len(set(out[:, 9:].flatten().tolist())) > 2  # not one repeated token


def test_counting_and_grouping_include_the_feature_tables():
    cfg = config(structure=True, orders=(2, 3, 5), table_size=101)
    model = HybridLM(cfg)
    cost = count_model(cfg)
    assert cost.structure_params == NUM_STRUCTURE_IDS * 32
    assert cost.ngram_params == 3 * 101 * 32
    assert cost.params == sum(p.numel() for p in model.parameters())
    assert cost.to_dict()["totals"]["ngram_params"] == 3 * 101 * 32
    groups = group_parameters(model)
    decay = {n for n, _ in groups.adamw_decay}
    assert {"structure_embed.weight", "ngram_embed.tables.0.weight",
            "ngram_embed.tables.2.weight"} <= decay
    assert not any("ngram" in n or "structure" in n for n, _ in groups.muon)
    assert "ngram_embed.multipliers" not in model.state_dict()  # derived from the config
