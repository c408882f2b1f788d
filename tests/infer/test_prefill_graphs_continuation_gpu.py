"""The captured continuation graphs on a GPU equal eager prefill with the prefix cache on:
float64 with the reference kernels (exact greedy tokens, logits to 1e-9 at every step), and
a bf16 smoke run with the serving kernels (``--kernels auto``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megacpp.infer.prefill_graphs import ContinuationGraphs
from megacpp.infer.sampling import SamplingParams
from megacpp.model.config import load_config
from megacpp.model.model import HybridLM
from tests.infer.test_engine import _latent
from tests.infer.test_engine_gpu import _engine, tokenizer  # noqa: F401 - fixture
from tests.infer.test_prefill_graphs import _logits_by_step

CACHED = {"prefix_cache": True, "block_size": 4, "max_model_len": 64, "prefill_chunk": 16,
          "snapshot_interval": 8, "prefill_graph_tokens": 64}


def _model(family: str, vocab: int, dtype: torch.dtype) -> HybridLM:
    torch.manual_seed(0)
    cfg = (dataclasses.replace(load_config("tiny"), vocab_size=vocab, init_std=0.3)
           if family == "tiny" else _latent(vocab))
    return HybridLM(cfg).to(device="cuda", dtype=dtype).eval()


def _shared_prefix_prompts(vocab: int) -> dict[str, list[int]]:
    """A 19-token base, extensions, a divergence inside a block, a block multiple, a repeat
    and a long one crossing snapshot boundaries (the prefix-cache tests' prompts)."""
    g = torch.Generator().manual_seed(3)

    def rand(n):
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    base = [1, *rand(18)]
    return {"base": base, "extend": base + rand(7), "diverge": base[:10] + rand(9),
            "multiple": base[:16], "repeat": list(base), "long": base + rand(21)}


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["tiny", "latent"])
def test_captured_continuations_equal_eager_float64(family, tokenizer):  # noqa: F811
    model = _model(family, tokenizer.vocab_size, torch.float64)
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    requests = {rid: (p, params)
                for rid, p in _shared_prefix_prompts(model.cfg.vocab_size).items()}
    graphed = _engine(model, tokenizer, **CACHED)
    assert graphed.runner.continuation_graphs is not None
    out, steps = _logits_by_step(graphed, requests)
    captured = graphed.runner.continuation_graphs.graphs
    assert len(captured) > 1
    assert all(isinstance(g, torch.cuda.CUDAGraph) for g, _ in captured.values())
    assert graphed.stats().prefix_hit_tokens > 0
    eager = _engine(model, tokenizer, **{**CACHED, "prefill_graphs": False})
    assert eager.runner.continuation_graphs is None
    want, want_steps = _logits_by_step(eager, requests)
    assert out == want
    assert len(steps) == len(want_steps)
    for a, b in zip(steps, want_steps, strict=True):
        assert a.keys() == b.keys()
        for rid in a:
            torch.testing.assert_close(a[rid], b[rid], rtol=0, atol=1e-9)


@pytest.mark.gpu
def test_captured_continuations_bf16_serving_kernels(tokenizer):  # noqa: F811
    """bf16 under ``--kernels auto``: the captured replay equals the same right-padded
    forward run eagerly (same kernels and shapes: tight), and the unpadded eager prefill
    within bf16 noise (the padding moves the scans' chunk boundaries)."""
    from megacpp.kernels.runtime import clear_resolutions, kernel_mode_override

    model = _model("tiny", tokenizer.vocab_size, torch.bfloat16)
    params = SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True)
    requests = {rid: (p, params)
                for rid, p in _shared_prefix_prompts(model.cfg.vocab_size).items()}
    clear_resolutions()
    with kernel_mode_override("auto"):
        captured = _engine(model, tokenizer, **CACHED)
        first = _logits_by_step(captured, requests)[1]
        replayed = _engine(model, tokenizer, **CACHED)
        replayed.runner.continuation_graphs = ContinuationGraphs(  # the padded path, eagerly
            model, replayed.cache, 12, 64, 64, capture=False)
        padded_eager = _logits_by_step(replayed, requests)[1]
        plain = _logits_by_step(_engine(model, tokenizer, **{**CACHED, "prefill_graphs": False}),
                                requests)[1]
    clear_resolutions()
    graphs = captured.runner.continuation_graphs.graphs
    assert graphs and all(isinstance(g, torch.cuda.CUDAGraph) for g, _ in graphs.values())
    got, same_path, unpadded = (_first_logits(steps) for steps in (first, padded_eager, plain))
    assert got.keys() == same_path.keys() == unpadded.keys() == requests.keys()
    for rid in got:  # each prompt's first token (later ones may follow a flipped token)
        scale = same_path[rid].abs().max().item()
        torch.testing.assert_close(got[rid], same_path[rid], rtol=0, atol=0.01 * scale)
    errors = sorted((got[r] - unpadded[r]).abs().max().item() / unpadded[r].abs().max().item()
                    for r in got)
    assert errors[len(errors) // 2] < 0.03, errors


def _first_logits(steps: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Each request's logits at its first sampled token (float32)."""
    out: dict[str, torch.Tensor] = {}
    for step in steps:
        for rid, logits in step.items():
            out.setdefault(rid, logits.float())
    return out
