"""Self-speculative decoding (MTP drafts, main-model verify): greedy output identical to plain
greedy decoding for a hybrid A/E/M/R model, with the MTP module's own drafts and with drafts
of controlled quality (rows accepting different numbers of tokens), k = 1..3; refusals."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from megacpp.data.tokenizer import CppTokenizer, train_tokenizer
from megacpp.errors import ConfigError
from megacpp.infer.engine import Engine, EngineConfig
from megacpp.infer.sampling import SamplingParams
from megacpp.infer.speculative import SpeculativeDecoder
from megacpp.model.config import ModelConfig, MtpConfig, NgramConfig
from megacpp.model.model import HybridLM

HEADERS = sorted(Path("/usr/include/c++/12/bits").glob("stl_*.h"))[:6]
LENGTHS = (1, 5, 17, 9)  # mixed prompt lengths, prefilled in chunks of 8
NEW = 10
GREEDY = SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def tokenizer() -> CppTokenizer:
    texts = [p.read_text(encoding="utf-8") for p in HEADERS]
    return CppTokenizer.from_hf(train_tokenizer(texts, vocab_size=600))


@pytest.fixture(scope="module")
def model(tokenizer) -> HybridLM:
    # A, E, M, R sublayers; init_std 0.3 so greedy tokens vary; one MTP module ("AE")
    cfg = _small(tokenizer.vocab_size, mtp=MtpConfig(depth=1))
    torch.manual_seed(0)
    return HybridLM(cfg).double().eval()


def _small(vocab: int, **changes) -> ModelConfig:
    return dataclasses.replace(ModelConfig.from_dict({
        "model": {"pattern": "A E M R", "vocab_size": vocab, "d_model": 64, "init_std": 0.3},
        "attention": {"n_heads": 4, "n_kv_heads": 2, "head_dim": 16},
        "mamba": {"d_state": 16, "headdim": 16, "expand": 2, "chunk_size": 8},
        "rnn": {"n_heads": 2, "head_k_dim": 16, "head_v_dim": 16, "chunk_size": 8},
        "moe": {"n_experts": 4, "top_k": 2, "expert_ffn": 32},
    }), **changes)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [[1, *torch.randint(3, vocab, (n - 1,), generator=g).tolist()] for n in LENGTHS]


def _engine(model, tokenizer, k: int, device: str = "cpu", **config) -> Engine:
    defaults = {"max_num_seqs": 8, "block_size": 4, "max_model_len": 96, "prefill_chunk": 8}
    return Engine(model, tokenizer, EngineConfig(**{**defaults, **config},
                                                 speculative_tokens=k), device=device)


def _run(engine: Engine, prompts, params=GREEDY) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return out


@pytest.fixture(scope="module")
def plain(model, tokenizer) -> dict[str, list[int]]:
    return _run(_engine(model, tokenizer, 0), _prompts(tokenizer.vocab_size))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_mtp_drafts_give_plain_greedy_output(model, tokenizer, plain, k):
    engine = _engine(model, tokenizer, k)
    assert _run(engine, _prompts(tokenizer.vocab_size)) == plain
    stats = engine.stats()
    assert stats.spec_draft_tokens > 0  # it speculated (a random MTP head is rarely right)
    assert stats.generated_tokens == NEW * len(LENGTHS)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_rows_accepting_different_prefixes(model, tokenizer, plain, k, monkeypatch):
    """Drafts that are the true greedy continuation up to a row-dependent point (row i is
    wrong at draft i % (k + 1): row 0 rejects at once, row k accepts everything) exercise
    accept-all, accept-some and reject-all in one batch, and the M/R rollback after each."""
    prompts = _prompts(tokenizer.vocab_size)
    truth = {rid: prompts[int(rid)] + tokens for rid, tokens in plain.items()}
    real_draft = SpeculativeDecoder._draft
    accepted_by_row: dict[str, list[int]] = {}

    def controlled_draft(self, rows, n):
        real_draft(self, rows, n)  # the MTP module still runs (its cache, its draft)
        drafts = []
        for r in rows:
            row = [truth[r.request_id][r.start + j] if r.start + j < len(truth[r.request_id])
                   else 0 for j in range(1, n + 1)]
            wrong_at = int(r.request_id) % (k + 1)
            if wrong_at < n:
                row[wrong_at] = (row[wrong_at] + 1) % tokenizer.vocab_size
            drafts.append(row)
        return torch.tensor(drafts, device=self.cache.device)

    real_step = SpeculativeDecoder._step

    def recording_step(self, rows, n):
        out = real_step(self, rows, n)
        for rid, step in out.items():
            accepted_by_row.setdefault(rid, []).append(step.accepted)
        return out

    monkeypatch.setattr(SpeculativeDecoder, "_draft", controlled_draft)
    monkeypatch.setattr(SpeculativeDecoder, "_step", recording_step)
    engine = _engine(model, tokenizer, k)
    assert _run(engine, prompts) == plain
    for rid, accepted in accepted_by_row.items():
        wrong_at = int(rid) % (k + 1)
        # a row accepts its drafts up to the wrong one (fewer only where drafts were capped)
        assert max(accepted) == min(wrong_at, k)
    assert engine.stats().spec_accepted_tokens > 0
    assert len({max(a) for a in accepted_by_row.values()}) == min(k + 1, len(LENGTHS))


def test_tight_blocks_and_max_model_len(model, tokenizer, plain):
    """Drafts near max_model_len are capped and preemption under block pressure recomputes
    the MTP cache: still the plain greedy tokens."""
    prompts = _prompts(tokenizer.vocab_size)
    longest = max(LENGTHS) + NEW
    engine = _engine(model, tokenizer, 3, max_model_len=longest, num_blocks=-(-longest // 4) + 8)
    assert _run(engine, prompts) == plain
    assert engine.stats().preemptions > 0


def test_sampled_requests_do_not_speculate(model, tokenizer):
    prompts = _prompts(tokenizer.vocab_size)[:2]
    params = SamplingParams(temperature=0.8, max_new_tokens=5, seed=3, ignore_eos=True)
    spec = _engine(model, tokenizer, 2)
    assert _run(spec, prompts, params) == _run(_engine(model, tokenizer, 0), prompts, params)
    assert spec.stats().spec_draft_tokens == 0


def test_model_without_mtp_is_refused(tokenizer):
    cfg = _small(tokenizer.vocab_size)
    with pytest.raises(ConfigError, match=r"needs a model with multi-token-prediction heads"):
        _engine(HybridLM(cfg), tokenizer, 2)


def test_recurrent_mtp_module_is_refused(tokenizer):
    cfg = _small(tokenizer.vocab_size, mtp=MtpConfig(depth=1, pattern="ME"))
    with pytest.raises(ConfigError, match=r"must be attention, MoE or dense MLP .* has M"):
        _engine(HybridLM(cfg), tokenizer, 1)


@pytest.mark.parametrize("k", [-1, 17, True])
def test_bad_speculative_tokens(k):
    with pytest.raises(ConfigError, match="speculative_tokens must be an integer in 0..16"):
        EngineConfig(speculative_tokens=k)


def test_ngram_model_speculates_exactly(tokenizer):
    """A hashed n-gram branch reads the tokens before each verified draft (history, then the
    drafts themselves): still plain greedy output."""
    cfg = _small(tokenizer.vocab_size, mtp=MtpConfig(depth=1),
                 ngram=NgramConfig(orders=(2, 3), table_size=256))
    torch.manual_seed(0)
    model = HybridLM(cfg).double().eval()
    prompts = _prompts(tokenizer.vocab_size)[1:3]
    assert _run(_engine(model, tokenizer, 2), prompts) == _run(_engine(model, tokenizer, 0), prompts)


def test_text_generator_speculates(model, tokenizer):
    """`megacpp generate --temperature 0 --speculative-tokens K`'s path: the same text."""
    from megacpp.infer.generate import TextGenerator

    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    prompt = "template <typename T>\nstruct box {"
    plain_text = TextGenerator(model, tokenizer).complete(prompt, 1, params)
    spec_text = TextGenerator(model, tokenizer, speculative_tokens=3).complete(prompt, 1, params)
    assert spec_text == plain_text
    with pytest.raises(ConfigError, match="speculative_tokens must be an integer"):
        TextGenerator(model, tokenizer, speculative_tokens=99)


def test_mimo_layers_roll_back_like_siso_ones(tokenizer):
    """Mamba-3 MIMO layers in the main stack: per-position states from the verify forward
    (rank-R keys) roll back to the last accepted token; greedy output equals plain."""
    cfg = dataclasses.replace(_small(tokenizer.vocab_size, mtp=MtpConfig(depth=1)),
                              pattern="A E M:mimo R")
    torch.manual_seed(0)
    model = HybridLM(cfg).double().eval()
    prompts = _prompts(tokenizer.vocab_size)
    want = _run(_engine(model, tokenizer, 0), prompts)
    engine = _engine(model, tokenizer, 2)
    assert _run(engine, prompts) == want and engine.stats().spec_draft_tokens > 0
