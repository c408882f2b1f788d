"""The captured prefill graphs on a GPU equal eager prefill: float64 with the reference
kernels (exact greedy tokens, logits to 1e-9 at every step), and bf16 with the serving
kernels (``--kernels auto``: Triton scans, grouped-GEMM experts) within bf16 tolerances."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megacpp.infer.prefill_graphs import PrefillGraphs
from megacpp.infer.sampling import SamplingParams
from megacpp.model.config import load_config
from megacpp.model.model import HybridLM
from tests.infer.test_engine import _latent, _prompts
from tests.infer.test_engine_gpu import _engine, tokenizer  # noqa: F401 - fixture
from tests.infer.test_prefill_graphs import _logits_by_step

LENGTHS = (1, 5, 17, 40, 9, 23, 70, 3, 33)  # prefill_chunk 64: 70 continues (a 2nd chunk)


def _model(family: str, vocab: int, dtype: torch.dtype) -> HybridLM:
    torch.manual_seed(0)
    cfg = (dataclasses.replace(load_config("tiny"), vocab_size=vocab, init_std=0.3)
           if family == "tiny" else _latent(vocab))
    return HybridLM(cfg).to(device="cuda", dtype=dtype).eval()


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["tiny", "latent"])
def test_captured_prefill_equals_eager_prefill_float64(family, tokenizer):  # noqa: F811
    model = _model(family, tokenizer.vocab_size, torch.float64)
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    requests = {str(i): (p, params) for i, p in enumerate(_prompts(model.cfg.vocab_size, LENGTHS))}
    config = {"prefill_chunk": 64, "prefill_graph_tokens": 256}
    graphed = _engine(model, tokenizer, **config)
    assert graphed.runner.prefill_graphs is not None
    out, steps = _logits_by_step(graphed, requests)
    captured = graphed.runner.prefill_graphs.graphs
    assert len(captured) > 1
    assert all(isinstance(g, torch.cuda.CUDAGraph) for g, _ in captured.values())
    eager = _engine(model, tokenizer, prefill_graphs=False, **config)
    assert eager.runner.prefill_graphs is None
    want, want_steps = _logits_by_step(eager, requests)
    assert out == want
    for a, b in zip(steps, want_steps, strict=True):
        assert a.keys() == b.keys()
        for rid in a:
            torch.testing.assert_close(a[rid], b[rid], rtol=0, atol=1e-9)


@pytest.mark.gpu
def test_captured_prefill_bf16_serving_kernels(tokenizer):  # noqa: F811
    """bf16 under ``--kernels auto``: the captured replay equals the same padded forward run
    eagerly (same kernels and shapes: tight), and the unpadded eager prefill within bf16
    noise (left padding moves the scans' chunk boundaries; a near-tied MoE routing choice
    may flip for a token, so the bound is on the median row and on most first tokens)."""
    from megacpp.kernels.runtime import chosen_kernels, clear_resolutions, kernel_mode_override

    model = _model("tiny", tokenizer.vocab_size, torch.bfloat16)
    params = SamplingParams(temperature=0, max_new_tokens=1, ignore_eos=True)
    requests = {str(i): (p, params) for i, p in enumerate(_prompts(model.cfg.vocab_size, LENGTHS))}
    config = {"prefill_chunk": 256, "prefill_graph_tokens": 512}  # one step prefills all
    clear_resolutions()
    with kernel_mode_override("auto"):
        captured = _engine(model, tokenizer, **config)
        first = _logits_by_step(captured, requests)[1][0]
        chosen = chosen_kernels()
        replayed = _engine(model, tokenizer, **config)
        replayed.runner.prefill_graphs = PrefillGraphs(
            model, replayed.cache, 12, 128, 512, capture=False)  # the padded path, eagerly
        padded_eager = _logits_by_step(replayed, requests)[1][0]
        unpadded = _engine(model, tokenizer, prefill_graphs=False, **config)
        plain = _logits_by_step(unpadded, requests)[1][0]
    clear_resolutions()
    assert chosen["mamba3_scan"] == "triton_chunked" and chosen["gated_delta"] == "triton_chunked"
    if torch.cuda.get_device_capability() >= (9, 0):
        assert chosen["moe_experts"] == "grouped_mm"  # the captured experts are the grouped ones
    graphs = captured.runner.prefill_graphs.graphs
    assert graphs and all(isinstance(g, torch.cuda.CUDAGraph) for g, _ in graphs.values())
    assert first.keys() == padded_eager.keys() == plain.keys() == requests.keys()
    for rid in first:
        scale = padded_eager[rid].float().abs().max().item()
        torch.testing.assert_close(first[rid].float(), padded_eager[rid].float(), rtol=0,
                                   atol=0.01 * scale)
    errors = sorted((first[rid].float() - plain[rid].float()).abs().max().item()
                    / plain[rid].float().abs().max().item() for rid in first)
    assert errors[len(errors) // 2] < 0.03, errors
    same_token = sum(int(first[r].argmax() == plain[r].argmax()) for r in first)
    assert same_token >= len(first) - 1, same_token
