"""Greedy decoding through the serving engine (paged caches) equals the contiguous-cache
TextGenerator, token for token, for every layer family: A (GQA), A:mla, A:dsa (sparse: the
prompts are longer than its top_k), M, R, E -- CPU, float32, several prompts, n > 1."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megacpp.data.tokenizer import CppTokenizer, train_tokenizer
from megacpp.infer.engine import Engine, EngineConfig
from megacpp.infer.generate import TextGenerator
from megacpp.infer.sampling import SamplingParams
from megacpp.model.config import ModelConfig
from megacpp.model.model import HybridLM

HEADERS = sorted(Path("/usr/include/c++/12/bits").glob("stl_*.h"))[:4]
PROMPTS = ["int main() {", "template <typename T>\nstruct vector_base {\n  T* begin_;",
           "#include <vector>\n", "void f(int n) { for (int i = 0; i < n; ++i)"]
PATTERNS = ["A E M R", "A:mla M E", "A:dsa R D", "A M A:mla R A:dsa E"]
GREEDY = SamplingParams(temperature=0, max_new_tokens=12)


@pytest.fixture(scope="module")
def tokenizer() -> CppTokenizer:
    return CppTokenizer.from_hf(train_tokenizer(
        [p.read_text(encoding="utf-8") for p in HEADERS], vocab_size=600))


def _model(pattern: str, vocab: int) -> HybridLM:
    cfg = ModelConfig.from_dict({
        # init_std 0.3: a random model whose greedy tokens vary from step to step
        "model": {"pattern": pattern, "vocab_size": vocab, "d_model": 32, "init_std": 0.3},
        "attention": {"n_heads": 4, "n_kv_heads": 2, "head_dim": 8},
        "mla": {"n_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 16,
                "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8},
        "dsa": {"index_n_heads": 2, "index_head_dim": 16, "top_k": 4, "query_chunk": 8},
        "mamba": {"d_state": 8, "headdim": 8, "expand": 2, "chunk_size": 4},
        "rnn": {"n_heads": 2, "head_k_dim": 8, "head_v_dim": 16, "chunk_size": 4},
        "moe": {"n_experts": 4, "top_k": 2, "expert_ffn": 16},
        "mlp": {"ffn": 48},
    })
    torch.manual_seed(0)
    return HybridLM(cfg).eval()


def _engine_greedy(model, tokenizer, prompts: list[str], n: int) -> list[list[list[int]]]:
    """Every prompt's n greedy completions (token ids, EOS left off) from one engine run."""
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=4, block_size=4,
                                                   max_model_len=96, prefill_chunk=16))
    for i, prompt in enumerate(prompts):
        for j in range(n):
            engine.add_request(f"{i}/{j}", prompt, GREEDY)
    ids: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            ids.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason == "eos":
                ids[out.request_id].pop()
    return [[ids[f"{i}/{j}"] for j in range(n)] for i in range(len(prompts))]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_engine_greedy_equals_the_contiguous_text_generator(pattern, tokenizer):
    model = _model(pattern, tokenizer.vocab_size)
    generator = TextGenerator(model, tokenizer)
    old = [[c.token_ids for c in generator.complete(p, 2, GREEDY)] for p in PROMPTS]
    new = _engine_greedy(model, tokenizer, PROMPTS, 2)
    assert new == old
    assert len({t for rows in old for row in rows for t in row}) > 4  # the tokens vary
