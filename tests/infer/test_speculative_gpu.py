"""Self-speculative decoding on a GPU: the speculative step replayed as captured CUDA graphs
(``infer/spec_graphs.py``) gives the tokens of plain graphed decode and of plain eager decode
(float64; mixed-length prompts; the MTP module's own drafts and controlled drafts that rows
accept in different numbers), falls back to the eager step without ``cuda_graphs``, and runs
in bf16."""

from __future__ import annotations

import pytest
import torch

from megacpp.infer.engine import Engine, EngineConfig
from megacpp.infer.sampling import SamplingParams
from megacpp.model.config import MtpConfig
from megacpp.model.model import HybridLM
from tests.infer.test_speculative import (
    LENGTHS,
    _engine,
    _prompts,
    _run,
    _small,
    controlled_drafts,
)


@pytest.fixture(scope="module")
def model(tokenizer) -> HybridLM:
    torch.manual_seed(0)
    return HybridLM(_small(tokenizer.vocab_size, mtp=MtpConfig(depth=1))).double().cuda().eval()


@pytest.fixture(scope="module")
def plain(model, tokenizer) -> dict[str, list[int]]:
    """Plain graphed decode's tokens, checked against plain eager decode's."""
    prompts = _prompts(tokenizer.vocab_size)
    graphed = _engine(model, tokenizer, 0, device="cuda")
    assert graphed.graphs is not None
    tokens = _run(graphed, prompts)
    assert _run(_engine(model, tokenizer, 0, device="cuda", cuda_graphs=False), prompts) == tokens
    return tokens


def _captured(engine: Engine) -> None:
    """The engine's speculative steps ran through real CUDA graphs."""
    graphs = engine.speculative.graphs
    assert graphs is not None and graphs.capture and graphs.buckets_used
    for draft, (verify, _) in graphs.graphs.values():
        assert isinstance(verify, torch.cuda.CUDAGraph)
        assert draft[0] is None or isinstance(draft[0], torch.cuda.CUDAGraph)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 3])
def test_graphed_speculation_equals_plain_decode(model, tokenizer, plain, k):
    spec = _engine(model, tokenizer, k, device="cuda")
    assert _run(spec, _prompts(tokenizer.vocab_size)) == plain
    assert spec.stats().spec_draft_tokens > 0
    _captured(spec)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 3])
def test_graphed_rows_accepting_different_prefixes(model, tokenizer, plain, k, monkeypatch):
    """Row i's drafts are wrong at index i % (k + 1): in one replay rows accept 0 .. k drafts
    and roll back their M/R states to different positions."""
    prompts = _prompts(tokenizer.vocab_size)
    accepted_by_row = controlled_drafts(monkeypatch, prompts, plain, k, tokenizer.vocab_size)
    spec = _engine(model, tokenizer, k, device="cuda")
    assert _run(spec, prompts) == plain
    _captured(spec)
    for rid, accepted in accepted_by_row.items():
        assert max(accepted) == min(int(rid) % (k + 1), k)
    assert len({max(a) for a in accepted_by_row.values()}) == min(k + 1, len(LENGTHS))


@pytest.mark.gpu
def test_capped_drafts_near_max_model_len_get_their_own_graphs(model, tokenizer, plain):
    longest = max(LENGTHS) + len(next(iter(plain.values())))
    spec = _engine(model, tokenizer, 3, device="cuda", max_model_len=longest)
    assert _run(spec, _prompts(tokenizer.vocab_size)) == plain
    assert {k for _, _, k in spec.speculative.graphs.buckets_used} > {3}


@pytest.mark.gpu
def test_without_cuda_graphs_the_step_is_eager(model, tokenizer, plain):
    spec = _engine(model, tokenizer, 2, device="cuda", cuda_graphs=False)
    assert spec.graphs is None and spec.speculative.graphs is None
    assert _run(spec, _prompts(tokenizer.vocab_size)) == plain


@pytest.mark.gpu
def test_graphed_speculation_runs_in_bf16(tokenizer):
    torch.manual_seed(0)
    model = HybridLM(_small(tokenizer.vocab_size, mtp=MtpConfig(depth=1))).eval()
    config = EngineConfig(max_num_seqs=8, block_size=4, max_model_len=96, prefill_chunk=8,
                          speculative_tokens=2)
    engine = Engine(model, tokenizer, config, device="cuda", dtype=torch.bfloat16)
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    out = _run(engine, _prompts(tokenizer.vocab_size), params)
    assert all(len(tokens) == 8 for tokens in out.values()) and len(out) == len(LENGTHS)
    assert engine.stats().spec_draft_tokens > 0
    _captured(engine)
    assert engine.speculative.graphs.h_prev.dtype == torch.bfloat16
