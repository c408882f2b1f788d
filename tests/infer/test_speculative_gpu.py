"""Self-speculative decoding on a GPU: the eager speculative step beside the CUDA-graph plain
decode and the prefill graphs gives the plain greedy tokens (float64), and runs in bf16."""

from __future__ import annotations

import pytest
import torch

from megacpp.data.tokenizer import CppTokenizer, train_tokenizer
from megacpp.infer.engine import Engine, EngineConfig
from megacpp.infer.sampling import SamplingParams
from megacpp.model.config import MtpConfig
from megacpp.model.model import HybridLM
from tests.infer.test_speculative import HEADERS, LENGTHS, _engine, _prompts, _run, _small


@pytest.fixture(scope="module")
def tokenizer() -> CppTokenizer:
    texts = [p.read_text(encoding="utf-8") for p in HEADERS]
    return CppTokenizer.from_hf(train_tokenizer(texts, vocab_size=600))


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 3])
def test_speculative_equals_graph_decode_on_gpu(tokenizer, k):
    torch.manual_seed(0)
    model = HybridLM(_small(tokenizer.vocab_size, mtp=MtpConfig(depth=1))).double().cuda().eval()
    prompts = _prompts(tokenizer.vocab_size)
    plain_engine = _engine(model, tokenizer, 0, device="cuda")
    assert plain_engine.graphs is not None
    plain = _run(plain_engine, prompts)
    spec = _engine(model, tokenizer, k, device="cuda")
    assert _run(spec, prompts) == plain
    assert spec.stats().spec_draft_tokens > 0


@pytest.mark.gpu
def test_speculative_runs_in_bf16(tokenizer):
    torch.manual_seed(0)
    model = HybridLM(_small(tokenizer.vocab_size, mtp=MtpConfig(depth=1))).eval()
    config = EngineConfig(max_num_seqs=8, block_size=4, max_model_len=96, prefill_chunk=8,
                          speculative_tokens=2)
    engine = Engine(model, tokenizer, config, device="cuda", dtype=torch.bfloat16)
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    out = _run(engine, _prompts(tokenizer.vocab_size), params)
    assert all(len(tokens) == 8 for tokens in out.values()) and len(out) == len(LENGTHS)
