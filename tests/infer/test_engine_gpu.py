"""The engine on a GPU: the CUDA-graph decode step equals the eager one (float64, exact
greedy tokens), across batch and width buckets, with preemption; bf16 smoke."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from megacpp.data.tokenizer import CppTokenizer, train_tokenizer
from megacpp.infer.engine import Engine, EngineConfig
from megacpp.infer.graphs import batch_buckets, bucket, width_buckets
from megacpp.infer.sampling import SamplingParams
from megacpp.model.config import load_config
from megacpp.model.model import HybridLM
from tests.infer.test_engine import _latent, _prompts, _run

SOURCES = sorted((Path(__file__).parents[2] / "src" / "megacpp" / "infer").glob("*.py"))
LENGTHS = (1, 5, 17, 40, 9, 23, 70, 3, 33)  # 9 rows: batch buckets 16 -> ... as rows finish


def test_buckets():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(3) == [1, 2, 3] and batch_buckets(1) == [1]
    assert width_buckets(128)[-3:] == [32, 64, 128] and width_buckets(5) == [1, 2, 4, 5]
    assert bucket([1, 2, 4, 8], 3) == 4


@pytest.fixture(scope="module")
def tokenizer() -> CppTokenizer:
    texts = [p.read_text(encoding="utf-8") for p in SOURCES]  # the GPU machine has no libstdc++ headers
    return CppTokenizer.from_hf(train_tokenizer(texts, vocab_size=600))


def _engine(model, tokenizer, **config) -> Engine:
    defaults = {"max_num_seqs": 12, "block_size": 4, "max_model_len": 128, "prefill_chunk": 16}
    return Engine(model, tokenizer, EngineConfig(**{**defaults, **config}), device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["tiny", "latent"])
def test_graph_decode_equals_eager_decode_and_generate_greedy(family, tokenizer):
    torch.manual_seed(0)
    vocab = tokenizer.vocab_size
    cfg = (dataclasses.replace(load_config("tiny"), vocab_size=vocab, init_std=0.3)
           if family == "tiny" else _latent(vocab))
    model = HybridLM(cfg).double().cuda().eval()
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    requests = {str(i): (p, params) for i, p in enumerate(_prompts(vocab, LENGTHS))}
    graphs = _engine(model, tokenizer)
    assert graphs.graphs is not None
    with_graphs = _run(graphs, requests)
    assert len(graphs.graphs.graphs) > 3  # several buckets were captured and replayed
    eager = _run(_engine(model, tokenizer, cuda_graphs=False), requests)
    assert with_graphs == eager
    for rid, (prompt, _) in requests.items():
        ref = model.generate_greedy(torch.tensor([prompt], device="cuda"), params.max_new_tokens)
        assert with_graphs[rid][0] == ref[0, len(prompt):].tolist()
    tight = _engine(model, tokenizer, num_blocks=40)  # 160 tokens for 9 rows: preempts
    assert _run(tight, requests) == eager and tight.stats().preemptions > 0
    assert tight.stats().free_blocks == 40


@pytest.mark.gpu
def test_bf16_engine_with_sampling_runs_and_is_seeded(tokenizer):
    torch.manual_seed(0)
    cfg = dataclasses.replace(load_config("tiny"), vocab_size=tokenizer.vocab_size)
    model = HybridLM(cfg).cuda()
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=8, max_model_len=256),
                    device="cuda", dtype=torch.bfloat16)
    params = SamplingParams(temperature=0.8, top_p=0.95, top_k=40, max_new_tokens=32, seed=3,
                            ignore_eos=True)
    requests = {str(i): ("int main() {" * (i + 1), params) for i in range(6)}
    first = _run(engine, requests)
    assert all(len(ids) == 32 and reason == "length" for ids, _, reason in first.values())
    assert _run(engine, requests) == first
    stats = engine.stats()
    assert (stats.free_blocks, stats.free_slots) == (stats.total_blocks, stats.total_slots)


@pytest.mark.gpu
def test_compiled_graph_decode_equals_eager_decode(tokenizer):
    """compile_decode: inductor-compiled blocks inside the captured graphs (float64)."""
    torch.manual_seed(0)
    cfg = dataclasses.replace(load_config("tiny"), vocab_size=tokenizer.vocab_size, init_std=0.3)
    model = HybridLM(cfg).double().cuda().eval()
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    requests = {str(i): (p, params) for i, p in enumerate(_prompts(cfg.vocab_size, (5, 17, 9)))}
    compiled = _run(_engine(model, tokenizer, max_num_seqs=4, compile_decode=True), requests)
    assert compiled == _run(_engine(model, tokenizer, cuda_graphs=False), requests)


@pytest.mark.gpu
def test_engine_under_auto_kernels_equals_reference_kernels(tokenizer):
    """Serving runs the catalog's chosen backends (``megacpp serve --kernels auto``): a first
    prefill's Mamba-3 scan is the Triton one, the R mixer's too, and the greedy tokens equal
    those of the reference kernels (float32, where the Triton scans qualify with IEEE dots)."""
    from megacpp.kernels.runtime import chosen_kernels, clear_resolutions, kernel_mode_override

    torch.manual_seed(0)
    cfg = dataclasses.replace(load_config("tiny"), vocab_size=tokenizer.vocab_size, init_std=0.3)
    model = HybridLM(cfg).cuda().eval()
    params = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    requests = {str(i): (p, params) for i, p in enumerate(_prompts(cfg.vocab_size, LENGTHS))}
    out = {}
    for mode in ("reference", "auto"):
        clear_resolutions()
        with kernel_mode_override(mode):
            out[mode] = _run(_engine(model, tokenizer), requests)
            chosen = chosen_kernels()
    assert chosen["mamba3_scan"] == "triton_chunked" and chosen["gated_delta"] == "triton_chunked"
    assert out["auto"] == out["reference"]
