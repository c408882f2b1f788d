"""The prefill graphs' padded path equals eager prefill: first chunks left-padded to
(batch, length) buckets (run eagerly on the CPU, float64; captured on CUDA) give the same
logits at every step and the same greedy tokens, with M/R states that never see padding."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megacpp.errors import MegaCppError
from megacpp.infer.engine import Engine
from megacpp.infer.prefill_graphs import PrefillGraphs, length_buckets
from megacpp.infer.scheduler import ScheduledRequest
from megacpp.model.model import HybridLM
from tests.infer.test_engine import GREEDY, _engine, _latent, _model, _prompts, _run, _tiny

LENGTHS = (1, 5, 17, 33, 9, 23, 40)  # prefill_chunk 24: 33 and 40 continue eagerly


def _mimo(vocab: int):
    """The tiny preset with Mamba-3 MIMO layers in place of its M layers."""
    return dataclasses.replace(_tiny(vocab), pattern="A M:mimo E R M:mimo D")


@pytest.fixture(scope="module", params=["tiny", "latent", "mimo"])
def model(request, tokenizer) -> HybridLM:
    build = {"tiny": _tiny, "latent": _latent, "mimo": _mimo}[request.param]
    return _model(build(tokenizer.vocab_size))


@pytest.fixture(scope="module")
def tiny_model(tokenizer) -> HybridLM:
    return _model(_tiny(tokenizer.vocab_size))


def _with_prefill_graphs(engine: Engine, max_tokens: int = 64) -> PrefillGraphs:
    graphs = PrefillGraphs(engine.model, engine.cache, engine.config.max_num_seqs,
                           engine.config.max_model_len, max_tokens, capture=False)
    engine.runner.prefill_graphs = graphs
    return graphs


def assert_same_steps(got: list[dict], want: list[dict], atol: float = 1e-9) -> None:
    """Step by step, the same requests got logits within ``atol`` (float64 engines)."""
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.keys() == b.keys()
        for rid in a:
            torch.testing.assert_close(a[rid], b[rid], rtol=0, atol=atol)


def _logits_by_step(engine: Engine, requests) -> tuple[dict, list[dict[str, torch.Tensor]]]:
    """_run, recording every sampled row's logits per engine step."""
    steps: list[dict[str, torch.Tensor]] = []
    sample = engine.runner._sample

    def spy(rows, logits, *args, **kwargs):
        steps[-1].update({r.request_id: logits[i].clone() for i, r in enumerate(rows)})
        return sample(rows, logits, *args, **kwargs)

    engine.runner._sample = spy
    step = engine.step

    def counted_step():
        steps.append({})
        return step()

    engine.step = counted_step
    return _run(engine, requests), steps


def test_length_buckets_and_groups(tiny_model, tokenizer):
    assert length_buckets(2048) == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert length_buckets(96) == [16, 32, 64, 96] and length_buckets(10) == [10]
    engine = _engine(tiny_model, tokenizer, max_model_len=96)
    graphs = _with_prefill_graphs(engine, max_tokens=64)
    assert graphs.lengths == [16, 32, 64]  # 96 > max_tokens
    chunk = lambda n, start=0: ScheduledRequest(
        "r", [1] * n, start, [0] * 24, 0, True, GREEDY, None)
    assert graphs.takes(chunk(64)) and not graphs.takes(chunk(65))
    assert not graphs.takes(chunk(8, start=8))  # continues a sequence: eager
    # shortest first: 2, 3, 5, 7 in a 4 x 16 bucket, 9 and 16 in 2 x 16, 40 alone (1 x 64)
    groups = graphs.groups([chunk(n) for n in (3, 16, 5, 9, 2, 40, 7)])
    assert [[len(c.token_ids) for c in g] for g in groups] == [[2, 3, 5, 7], [9, 16], [40]]
    with pytest.raises(ValueError, match="fit no bucket"):
        graphs.run([chunk(8, start=8)])
    graphs.capture_all()  # every bucket of at most 64 tokens
    assert sorted(graphs.graphs) == [(1, 16), (1, 32), (1, 64), (2, 16), (2, 32), (4, 16)]


def test_padded_prefill_equals_eager_logits_and_tokens(model, tokenizer):
    """Left padding to buckets, padding rows and mixed lengths in one replay: every step's
    logits equal the eager engine's (float64), and so do the greedy tokens."""
    prompts = _prompts(model.cfg.vocab_size, LENGTHS)
    requests = {str(i): (p, GREEDY) for i, p in enumerate(prompts)}
    config = {"prefill_chunk": 24}
    eager, eager_steps = _logits_by_step(_engine(model, tokenizer, **config), requests)
    engine = _engine(model, tokenizer, **config)
    graphs = _with_prefill_graphs(engine)
    padded, padded_steps = _logits_by_step(engine, requests)
    assert padded == eager
    assert_same_steps(padded_steps, eager_steps)
    used = graphs.buckets_used
    assert any(n == 16 for _, n in used) and any(n == 32 for _, n in used)  # padded lengths
    assert any(b > 1 for b, _ in used)  # several chunks in one replay


def test_padded_prefill_with_preemption_and_joining_requests(tiny_model, tokenizer):
    """Recomputed (preempted) sequences prefill from position 0 again through the graphs;
    requests join while others decode (their slots and blocks are never touched by
    padding)."""
    prompts = _prompts(tiny_model.cfg.vocab_size, (5, 17, 33, 9, 23))
    params = dataclasses.replace(GREEDY, max_new_tokens=10)
    requests = {str(i): (p, params) for i, p in enumerate(prompts)}
    reference = _run(_engine(tiny_model, tokenizer, prefill_chunk=24), requests)
    tight = _engine(tiny_model, tokenizer, prefill_chunk=24, num_blocks=24)
    _with_prefill_graphs(tight)
    assert _run(tight, requests) == reference
    assert tight.stats().preemptions > 0
    stats = tight.stats()
    assert (stats.free_blocks, stats.free_slots) == (stats.total_blocks, stats.total_slots)
    staggered = _engine(tiny_model, tokenizer, prefill_chunk=24)
    _with_prefill_graphs(staggered)
    staggered.add_request("2", prompts[2], params)
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    for _ in range(4):  # "2" (33 tokens: two chunks) is decoding after these
        for out in staggered.step():
            tokens[out.request_id] += out.new_token_ids
    assert tokens["2"]
    for rid, (prompt, p) in requests.items():
        if rid != "2":
            staggered.add_request(rid, prompt, p)
    while staggered.has_unfinished():
        for out in staggered.step():
            tokens[out.request_id] += out.new_token_ids
    assert tokens == {rid: reference[rid][0] for rid in requests}


def test_padding_never_reaches_the_recurrent_states(tiny_model, tokenizer):
    """After a padded prefill the R layers' states (recurrent and conv) equal the eager
    prefill's, and M's equal it up to a common rotation; attention KV entries equal too."""
    prompts = _prompts(tiny_model.cfg.vocab_size, (3, 11))
    engines = [_engine(tiny_model, tokenizer, prefill_chunk=24) for _ in range(2)]
    _with_prefill_graphs(engines[1])
    for engine in engines:
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, GREEDY)
        engine.step()  # both prompts prefilled (and their first token sampled)
    families = [b.family for b in tiny_model.blocks]
    for family, eager, padded in zip(families, engines[0].cache.layers,
                                     engines[1].cache.layers, strict=True):
        if family == "R":
            for name in ("state", "conv_state"):
                torch.testing.assert_close(getattr(padded, name)[:2], getattr(eager, name)[:2],
                                           rtol=0, atol=1e-10)
        elif family == "M":  # the ssm state's norm is rotation-invariant
            torch.testing.assert_close(padded.ssm[:2].norm(dim=-1), eager.ssm[:2].norm(dim=-1),
                                       rtol=0, atol=1e-10)
            torch.testing.assert_close(padded.v[:2], eager.v[:2], rtol=0, atol=1e-10)
        elif family == "A":
            for name, tensor in eager.tensors.items():  # the real blocks (scratch excluded)
                torch.testing.assert_close(padded.tensors[name][:-1], tensor[:-1],
                                           rtol=0, atol=1e-10)


def test_structure_model_pads_its_ids_and_ngram_model_is_refused(tokenizer):
    """A structure-id model's ids are left-padded with the tokens (same greedy tokens as the
    full forward); an n-gram model is refused (it prefills eagerly: its windows would span
    the padding)."""
    from megacpp.infer.structure import StructureIds
    from tests.infer import test_features_engine as features

    model = features._model(tokenizer.vocab_size, structure=True)
    labeler = StructureIds(tokenizer)
    prompts, params = features.PROMPTS[:2], dataclasses.replace(GREEDY, max_new_tokens=4)
    want = {str(i): features._reference(model, tokenizer, p, 4, labeler)
            for i, p in enumerate(prompts)}
    engine = features._engine(model, tokenizer, prefill_chunk=64)
    graphs = _with_prefill_graphs(engine)
    assert features._run(engine, prompts, params) == want
    assert graphs.buckets_used
    ngram = features._model(tokenizer.vocab_size, orders=(2, 3))
    with pytest.raises(MegaCppError, match="n-gram"):
        _with_prefill_graphs(features._engine(ngram, tokenizer))


def test_prompt_logprobs_prefill_eagerly_beside_the_graphs(tiny_model, tokenizer):
    """A chunk that asks for prompt logprobs (every position's logits) prefills eagerly; the
    others go through the graphs; tokens and logprobs equal the eager engine's."""
    prompts = _prompts(tiny_model.cfg.vocab_size, (5, 17, 9, 23))
    scored = dataclasses.replace(GREEDY, logprobs=2, prompt_logprobs=2)
    requests = {str(i): (p, scored if i % 2 else GREEDY) for i, p in enumerate(prompts)}

    def outputs(engine):
        for rid, (prompt, params) in requests.items():
            engine.add_request(rid, prompt, params)
        got = {rid: [] for rid in requests}
        while engine.has_unfinished():
            for o in engine.step():
                got[o.request_id].append(o)
        return got

    want = outputs(_engine(tiny_model, tokenizer, prefill_chunk=24))
    engine = _engine(tiny_model, tokenizer, prefill_chunk=24)
    graphs = _with_prefill_graphs(engine)
    got = outputs(engine)
    assert graphs.buckets_used
    for rid in requests:
        assert [o.new_token_ids for o in got[rid]] == [o.new_token_ids for o in want[rid]]
        for a, b in zip(got[rid], want[rid], strict=True):
            for name in ("logprobs", "prompt_logprobs"):
                xs, ys = getattr(a, name) or [], getattr(b, name) or []
                assert len(xs) == len(ys)
                for x, y in zip(xs, ys, strict=True):
                    assert (x is None) == (y is None)
                    if x is not None:
                        assert x.token == y.token and abs(x.logprob - y.logprob) < 1e-9
