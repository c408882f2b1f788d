"""The engine with the paged decode attention (``paged_attention_decode``'s Triton row routed
into the A layers) decodes the same greedy tokens as with the gather path, inside the captured
decode graphs, across batch and width buckets (padding rows on the scratch block)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megacpp.infer.sampling import SamplingParams
from megacpp.model.config import load_config
from megacpp.model.model import HybridLM
from tests.infer.test_engine import _prompts, _run
from tests.infer.test_engine_gpu import LENGTHS, _engine, tokenizer  # noqa: F401 (fixture)


def _decode(model, tokenizer, max_new_tokens: int = 20):  # noqa: F811 (not the fixture)
    params = SamplingParams(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True)
    requests = {str(i): (p, params)
                for i, p in enumerate(_prompts(model.cfg.vocab_size, LENGTHS))}
    engine = _engine(model, tokenizer)
    tokens = _run(engine, requests)
    prompt = torch.tensor([requests["2"][0]], device="cuda")
    greedy = model.generate_greedy(prompt, max_new_tokens)  # the lockstep cache's path
    assert engine.graphs is not None and len(engine.graphs.graphs) > 1
    return tokens, greedy


@pytest.mark.gpu
def test_paged_decode_attention_decodes_the_reference_tokens(tokenizer, monkeypatch):  # noqa: F811
    """float32 (the kernel multiplies in full float32): the Triton row for the A layers' decode
    steps, every other surface on its reference."""
    import megacpp.model.attention as attention_module
    from megacpp.kernels.registry import default_catalog

    torch.manual_seed(0)
    cfg = dataclasses.replace(load_config("tiny"), vocab_size=tokenizer.vocab_size, init_std=0.3)
    model = HybridLM(cfg).float().cuda().eval()
    ref_tokens, ref_greedy = _decode(model, tokenizer)
    triton_row = default_catalog().backend("paged_attention_decode", "triton")
    real, calls = attention_module.resolve, []

    def resolve(surface, like):
        if surface != "paged_attention_decode":
            return real(surface, like)
        calls.append(like.shape[0])
        return triton_row

    monkeypatch.setattr(attention_module, "resolve", resolve)
    tokens, greedy = _decode(model, tokenizer)
    assert calls
    assert tokens == ref_tokens
    assert torch.equal(greedy, ref_greedy)
