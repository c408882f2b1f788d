"""run_batch: more requests than the engine's queue holds, all finished, greedy results equal
to the engine running each request alone, stop strings and the function-body completion."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from megacpp.data.tokenizer import CppTokenizer, train_tokenizer
from megacpp.infer.batch import BatchRequest, BatchResult, run_batch
from megacpp.infer.engine import Engine, EngineConfig
from megacpp.infer.sampling import SamplingParams
from megacpp.model.config import load_config
from megacpp.model.model import HybridLM

HEADERS = sorted(Path("/usr/include/c++/12/bits").glob("stl_*.h"))[:4]
PROMPTS = ["int main() {", "template <typename T>", "#include <vector>\n", "namespace a {",
           "struct S { int x;", "void f(int n) {", "return", "//"]


@pytest.fixture(scope="module")
def tokenizer() -> CppTokenizer:
    return CppTokenizer.from_hf(train_tokenizer(
        [p.read_text(encoding="utf-8") for p in HEADERS], vocab_size=600))


@pytest.fixture(scope="module")
def model(tokenizer) -> HybridLM:
    torch.manual_seed(0)
    cfg = dataclasses.replace(load_config("tiny"), vocab_size=tokenizer.vocab_size, init_std=0.3)
    return HybridLM(cfg).double().eval()


def _engine(model, tokenizer, **config) -> Engine:
    return Engine(model, tokenizer, EngineConfig(**{"max_num_seqs": 4, "max_model_len": 64,
                                                    **config}), dtype=torch.float64)


def test_all_requests_finish_and_match_running_alone(model, tokenizer) -> None:
    greedy = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    requests = [BatchRequest(f"r{i}", p, greedy) for i, p in enumerate(PROMPTS[:5])]
    finished = []
    results = run_batch(_engine(model, tokenizer, max_waiting=2), requests,
                        on_finish=lambda rid, _r: finished.append(rid))
    assert set(results) == set(finished) == {r.request_id for r in requests}
    assert all(r.completion_tokens == 4 and r.finish_reason == "length" for r in results.values())
    for request in requests[:1]:  # each alone, in a fresh engine: the same greedy text
        alone = run_batch(_engine(model, tokenizer), [request])
        assert alone[request.request_id].text == results[request.request_id].text


def test_stop_strings_and_function_bodies(model, tokenizer) -> None:
    sampled = SamplingParams(temperature=1.0, max_new_tokens=10, stop=("\n}", ";"), seed=3)
    results = run_batch(_engine(model, tokenizer),
                        [BatchRequest(str(i), p, sampled) for i, p in enumerate(PROMPTS[:4])])
    assert len(results) == 4
    for result in results.values():
        assert "\n}" not in result.text and ";" not in result.text
        assert result.finish_reason in ("stop", "length", "eos")
    assert BatchResult("  return 1;", "stop", 5).function_body() == "  return 1;\n}\n"
    assert BatchResult("  return", "length", 5).function_body() == "  return"
