"""The Hugging Face export, one tiny model per block family, loaded by real transformers:
logits equal HybridLM's, greedy generate() equals megacpp's greedy decoding, the tokenizer
round-trips C++ text, and the export reads back (load_hf_export, init_from's reader)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megacpp.data.tokenizer import CppTokenizer, train_tokenizer
from megacpp.errors import MegaCppError
from megacpp.export import hf_format
from megacpp.export.hf import load_hf_export, write_model_dir
from megacpp.infer.generate import TextGenerator
from megacpp.infer.sampling import SamplingParams
from megacpp.model.config import ModelConfig
from megacpp.model.model import HybridLM
from tests.train.helpers import HEADERS, LIBSTDCXX

transformers = pytest.importorskip("transformers")

VOCAB = 512
MLA = {"n_heads": 2, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
       "v_head_dim": 8}
FAMILIES: dict[str, dict] = {
    "A:gqa": {"model": {"pattern": "A:gqa"}},
    "A:mla": {"model": {"pattern": "A:mla"}, "mla": MLA},
    # top_k 4 of up to ~40 keys: the sparse path really selects
    "A:dsa": {"model": {"pattern": "A:dsa"}, "mla": MLA,
              "dsa": {"index_n_heads": 2, "index_head_dim": 8, "top_k": 4, "query_chunk": 8}},
    "E": {"model": {"pattern": "E"}},
    "M": {"model": {"pattern": "M"}},
    "M:mimo": {"model": {"pattern": "M:mimo"},
               "mamba": {"d_state": 16, "headdim": 16, "mimo_rank": 2, "mimo_chunk_size": 4}},
    "R": {"model": {"pattern": "R"}},
    "D": {"model": {"pattern": "D"}},
    "MTP": {"model": {"pattern": "AD"}, "mtp": {"depth": 1, "pattern": "AE"}},
    "ngram": {"model": {"pattern": "AM"}, "ngram": {"orders": [2, 3], "table_size": 64}},
}
CPP_TEXT = ("#include <vector>\r\n\ttemplate <typename T>\nint f(int x) {  // <|eos|> é ✓\n"
            "    return x  +  1;\n}\n\n")
PROMPT = "int add(int a, int b) {\n    return"


def family_config(name: str) -> ModelConfig:
    """A tiny model of one family; init_std 0.3 so that the logits vary over the vocabulary."""
    spec = FAMILIES[name]
    return ModelConfig.from_dict({
        "model": {"vocab_size": VOCAB, "d_model": 32, "init_std": 0.3, **spec["model"]},
        "attention": {"n_heads": 2, "n_kv_heads": 1, "head_dim": 16},
        "mamba": {"d_state": 16, "headdim": 16, "chunk_size": 8},
        "rnn": {"n_heads": 2, "head_k_dim": 16, "head_v_dim": 16, "chunk_size": 8},
        "moe": {"n_experts": 4, "top_k": 2, "expert_ffn": 32},
        "mlp": {"ffn": 64},
        **{k: v for k, v in spec.items() if k != "model"},
    })


def family_model(name: str) -> HybridLM:
    torch.manual_seed(0)
    model = HybridLM(family_config(name))
    for block in model.moe_blocks():  # a trained-looking routing bias, so its export counts
        block.mixer.expert_bias.copy_(torch.randn_like(block.mixer.expert_bias))
    if model.ngram_embed is not None:  # trained-looking n-gram tables (they start at zero)
        for table in model.ngram_embed.tables:
            torch.nn.init.normal_(table.weight, std=1.0)
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer() -> CppTokenizer:
    if not (LIBSTDCXX / "utility").is_file():
        pytest.skip(f"needs the libstdc++ headers in {LIBSTDCXX}")
    texts = [(LIBSTDCXX / rel).read_text(encoding="utf-8") for rel in HEADERS[:8]]
    return CppTokenizer.from_hf(train_tokenizer(texts, VOCAB))


def export(model: HybridLM, tokenizer: CppTokenizer, out: Path, **kwargs) -> Path:
    return write_model_dir(model, tokenizer, out, card="# test\n", **kwargs)


def megacpp_greedy(model: HybridLM, tokenizer: CppTokenizer, prompt: str, n: int) -> list[int]:
    """The token ids `megacpp generate --temperature 0` produces (its TextGenerator)."""
    params = SamplingParams(temperature=0, max_new_tokens=n)
    return TextGenerator(model, tokenizer).complete(prompt, 1, params)[0].token_ids


@pytest.mark.parametrize("family", list(FAMILIES))
def test_transformers_loads_the_export_with_equal_logits_and_greedy_tokens(
        family, tokenizer, tmp_path):
    model = family_model(family)
    out = export(model, tokenizer, tmp_path / f"hf-{family.replace(':', '-')}")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    assert type(hf_model).__name__ == "MegaCppForCausalLM" and hf_model.dtype == torch.float32

    ids = torch.tensor([hf_tok(CPP_TEXT + PROMPT).input_ids])  # [1, L], BOS first
    assert ids[0, 0] == tokenizer.bos_id
    with torch.no_grad():
        expected = model(ids).logits
        got = hf_model(ids).logits
    assert got.shape == expected.shape == (1, ids.shape[1], VOCAB)
    assert (got - expected).abs().max().item() <= 1e-5

    new = 12
    prompt = torch.tensor([hf_tok(PROMPT).input_ids])  # [1, P]
    gen = hf_model.generate(prompt, max_new_tokens=new, do_sample=False,
                            return_dict_in_generate=True, output_logits=True)
    hf_tokens = gen.sequences[0, prompt.shape[1]:].tolist()
    if hf_tokens and hf_tokens[-1] == tokenizer.eos_id:
        hf_tokens = hf_tokens[:-1]  # megacpp reports the tokens before EOS
    assert hf_tokens == megacpp_greedy(model, tokenizer, PROMPT, new)
    # each decoding step's logits (through the cache) are the uncached forward's
    step_logits = torch.stack(gen.logits, dim=1)  # [1, new, V]
    with torch.no_grad():
        uncached = model(gen.sequences[:, :-1]).logits[:, prompt.shape[1] - 1:]
    assert (step_logits - uncached).abs().max().item() <= 1e-4


def test_export_refuses_a_structure_embedding_model(tokenizer, tmp_path):
    cfg = ModelConfig.from_dict({**family_config("A:gqa").to_dict(),
                                 "structure": {"embedding": True}})
    with pytest.raises(MegaCppError, match=r"structure-id embedding"):
        export(HybridLM(cfg), tokenizer, tmp_path / "hf-structure")
    assert not (tmp_path / "hf-structure").exists()


def test_the_weights_are_needed_for_equal_logits(tokenizer, tmp_path):
    """The comparison above can fail: another init of the same config gives other logits."""
    out = export(family_model("E"), tokenizer, tmp_path / "hf")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    torch.manual_seed(1)
    other = HybridLM(family_config("E")).eval()
    ids = torch.tensor([[1, 40, 41, 42, 43]])
    with torch.no_grad():
        assert (hf_model(ids).logits - other(ids).logits).abs().max().item() > 1e-3


def test_auto_tokenizer_has_bos_eos_pad_and_round_trips_cpp(tokenizer, tmp_path):
    out = export(family_model("D"), tokenizer, tmp_path / "hf")
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)  # no trust_remote_code needed
    assert isinstance(hf_tok, transformers.PreTrainedTokenizerFast)
    assert (hf_tok.bos_token, hf_tok.eos_token, hf_tok.pad_token) == (
        "<|bos|>", "<|eos|>", "<|pad|>")
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id) == (
        tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id)
    ids = hf_tok(CPP_TEXT).input_ids
    # megacpp's encoding behind one BOS: a literal "<|eos|>" in the source stays text
    assert ids == [tokenizer.bos_id, *tokenizer.encode(CPP_TEXT).tolist()]
    assert tokenizer.eos_id not in ids
    assert hf_tok.decode(ids, skip_special_tokens=True) == CPP_TEXT
    assert hf_tok.decode(ids[1:]) == CPP_TEXT
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert json.loads((out / "special_tokens_map.json").read_text())["pad_token"] == "<|pad|>"


def test_sharded_export_has_an_index_transformers_reads(tokenizer, tmp_path):
    model = family_model("MTP")
    out = export(model, tokenizer, tmp_path / "hf", max_shard_size="20KB")
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert set(index["weight_map"]) == {f"model.{k}" for k in model.state_dict()}
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    ids = torch.tensor([[1, 7, 8, 9]])
    with torch.no_grad():
        assert (hf_model(ids).logits - model(ids).logits).abs().max().item() <= 1e-5


def test_config_and_generation_config(tokenizer, tmp_path):
    out = export(family_model("A:dsa"), tokenizer, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "megacpp"
    assert config["auto_map"] == {"AutoConfig": "configuration_megacpp.MegaCppConfig",
                                  "AutoModelForCausalLM": "modeling_megacpp.MegaCppForCausalLM"}
    assert ModelConfig.from_dict(config["megacpp"]) == family_config("A:dsa")
    auto = transformers.AutoConfig.from_pretrained(out, trust_remote_code=True)
    assert (auto.vocab_size, auto.hidden_size, auto.pattern) == (VOCAB, 32, "A:dsa")
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"],
            generation["pad_token_id"]) == (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id)


def test_load_hf_export_round_trips_the_model(tokenizer, tmp_path):
    model = family_model("MTP")
    out = export(model, tokenizer, tmp_path / "hf")
    loaded, tok, cfg = load_hf_export(out)
    assert cfg == model.cfg and tok.vocab_size == VOCAB
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert set(hf_format.read_weights(out)) == set(model.state_dict())


def test_generate_refuses_what_the_cache_cannot_do(tokenizer, tmp_path):
    out = export(family_model("M"), tokenizer, tmp_path / "hf")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    ids = torch.tensor([[1, 40, 41, 42]])
    with pytest.raises(ValueError, match="beam search"):
        hf_model.generate(ids, max_new_tokens=2, num_beams=2, do_sample=False)
    padded = torch.tensor([[0, 1, 40, 41]])
    with pytest.raises(ValueError, match="unpadded"):
        hf_model.generate(padded, attention_mask=torch.tensor([[0, 1, 1, 1]]), max_new_tokens=2)


def test_labels_give_the_models_training_loss(tokenizer, tmp_path):
    model = family_model("E").train()
    out = export(model.eval(), tokenizer, tmp_path / "hf")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    ids = torch.tensor([[1, 40, 41, 42, 43, 44]])
    loss = hf_model(ids, labels=ids).loss
    expected = torch.nn.functional.cross_entropy(model(ids).logits[0, :-1], ids[0, 1:])
    assert abs(loss.item() - expected.item()) < 1e-5


def test_export_refuses_a_nonempty_out_dir_and_bad_reads(tokenizer, tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    with pytest.raises(MegaCppError, match="not an empty directory"):
        export(family_model("D"), tokenizer, tmp_path / "taken")
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"
    with pytest.raises(MegaCppError, match="not a megacpp Hugging Face export"):
        load_hf_export(tmp_path / "taken")
    out = export(family_model("D"), tokenizer, tmp_path / "hf")
    (out / "model.safetensors").write_bytes(b"\0" * 16)
    with pytest.raises(MegaCppError, match="not a readable safetensors file"):
        load_hf_export(out)
