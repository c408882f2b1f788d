"""The continuation graphs' padded path equals eager prefill: chunks that start after position
0 (after a prefix-cache hit, after a snapshot cut, a later chunk of a long prompt),
right-padded to (batch, length, width) buckets and run eagerly on the CPU (float64), give the
eager engine's logits at every step and its greedy tokens, with M/R states that never see the
padding."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megacpp.infer.engine import Engine
from megacpp.infer.prefill_graphs import (
    ContinuationGraphs,
    PrefillGraphs,
    supports_prefill_graphs,
)
from megacpp.infer.scheduler import ScheduledRequest
from tests.infer import test_prefix_cache as pc
from tests.infer.test_prefill_graphs import _logits_by_step, assert_same_steps
from tests.model.conftest import small_config

tokenizer = pc.tokenizer  # the module fixture


def _with_graphs(engine: Engine, max_tokens: int = 64) -> ContinuationGraphs:
    """Both graph families as eager stand-ins (``capture=False``): the padded static-buffer
    paths run on the CPU."""
    cfg, runner = engine.config, engine.runner
    if supports_prefill_graphs(engine.model):  # not an n-gram model: its first chunks are eager
        runner.prefill_graphs = PrefillGraphs(engine.model, engine.cache, cfg.max_num_seqs,
                                              cfg.max_model_len, max_tokens, capture=False)
    graphs = ContinuationGraphs(engine.model, engine.cache, cfg.max_num_seqs,
                                cfg.max_model_len, max_tokens, capture=False)
    runner.continuation_graphs = graphs
    return graphs


@pytest.fixture(scope="module", params=["hybrid", "mimo", "latent"])
def model(request, tokenizer):
    vocab = tokenizer.vocab_size
    if request.param == "hybrid":  # A, E, M, R
        return pc._model(small_config("AMEAR", vocab_size=vocab, init_std=0.3))
    if request.param == "mimo":
        return pc._model(small_config("A M:mimo E A R", vocab_size=vocab, init_std=0.3))
    return pc._model(pc.latent_config(vocab))  # MLA and DSA pages with M and R states


def _chunk(n: int, start: int, blocks: int = 24) -> ScheduledRequest:
    return ScheduledRequest("r", [1] * n, start, list(range(blocks)), 0, True, pc.GREEDY, None)


def test_buckets_and_which_chunks_take_the_continuation_graphs(tokenizer):
    model = pc._model(small_config("AMEAR", vocab_size=tokenizer.vocab_size, init_std=0.3))
    engine = pc._engine(model, tokenizer, True, max_model_len=96)
    graphs = _with_graphs(engine, max_tokens=64)
    assert graphs.lengths == [16, 32, 64] and graphs.widths == [1, 2, 4, 8, 16, 24]
    assert graphs.takes(_chunk(8, start=8)) and graphs.takes(_chunk(64, start=4))
    assert not graphs.takes(_chunk(8, start=0))  # starts its sequence: the first-chunk graphs
    assert not graphs.takes(_chunk(65, start=4))  # longer than every bucket: eager
    # shortest first: 2, 3, 5, 7 in a 4 x 16 bucket, 9 and 16 in 2 x 16, 40 alone (1 x 64)
    groups = graphs.groups([_chunk(n, start=4) for n in (3, 16, 5, 9, 2, 40, 7)])
    assert [[len(c.token_ids) for c in g] for g in groups] == [[2, 3, 5, 7], [9, 16], [40]]
    with pytest.raises(ValueError, match="fit no bucket"):
        graphs.run([_chunk(8, start=0)])
    # a row of 5 tokens at 40..44 (12 blocks) runs the (1, 16, 16) bucket, right-padded
    graphs.run([_chunk(5, start=40)])
    assert graphs.buckets_used == {(1, 16, 16)}
    inputs = graphs.inputs
    assert list(inputs.host("positions")[:16]) == [*range(40, 45)] + [44] * 11
    scratch = engine.cache.null_block * engine.cache.block_size
    assert list(inputs.host("slot_mapping")[5:16]) == [scratch] * 11
    assert inputs.host("last_index")[0] == 4
    # the runner: first chunks to the first-chunk graphs, continuations to these, prompt
    # logprobs and over-long chunks eagerly
    scored = dataclasses.replace(_chunk(8, start=8), params=dataclasses.replace(
        pc.GREEDY, prompt_logprobs=1))
    chunks = [_chunk(8, 0), _chunk(8, 8), _chunk(65, 4), scored]
    runners = {id(c): run for group, run in engine.runner._prefill_groups(chunks)
               for c in group}
    assert runners[id(chunks[0])] == engine.runner.prefill_graphs.run
    assert runners[id(chunks[1])] == graphs.run
    assert runners[id(chunks[2])] == runners[id(scored)] == engine.runner._run_prefill


@pytest.mark.parametrize("together", [False, True], ids=["one-by-one", "together"])
def test_continuation_graphs_equal_eager_with_the_prefix_cache(model, tokenizer, together):
    """Hits (whole prefix, a divergence inside a block, block multiples, repeats) and
    snapshot cuts: every step's logits equal the eager engine's, and the greedy tokens."""
    prompts = pc._prompts(model.cfg.vocab_size)
    requests = {rid: (p, pc.GREEDY) for rid, p in prompts.items()}
    want_tokens = pc._run(pc._engine(model, tokenizer, False), prompts, together)

    def run(engine):
        if together:
            return _logits_by_step(engine, requests)
        steps: list[dict[str, torch.Tensor]] = []
        tokens = {}
        for rid, request in requests.items():  # one after another: each finds the earlier
            got, more = _logits_by_step(engine, {rid: request})
            tokens.update(got)
            steps += more
        return tokens, steps

    eager, eager_steps = run(pc._engine(model, tokenizer, True))
    engine = pc._engine(model, tokenizer, True)
    graphs = _with_graphs(engine)
    eager_chunks = []
    run_prefill = engine.runner._run_prefill
    engine.runner._run_prefill = lambda chunks, **kw: (eager_chunks.extend(chunks),
                                                       run_prefill(chunks, **kw))[1]
    padded, padded_steps = run(engine)
    assert {rid: t[0] for rid, t in padded.items()} == want_tokens
    assert padded == eager
    assert_same_steps(padded_steps, eager_steps)
    assert not eager_chunks  # every chunk fits a bucket: none ran eagerly
    assert engine.stats().prefix_hit_tokens > 0
    assert any(b > 1 for b, _, _ in graphs.buckets_used) == together
    assert len({w for _, _, w in graphs.buckets_used}) > 1  # several context widths


def test_right_padding_never_reaches_the_recurrent_states(tokenizer):
    """After a right-padded continuation chunk the M/R states (recurrent, conv tail, Mamba-3's
    angle and previous k, v) and the KV pages equal the eager engine's."""
    model = pc._model(small_config("AMEAR", vocab_size=tokenizer.vocab_size, init_std=0.3))
    prompt = pc._prompts(model.cfg.vocab_size)["long"]  # 40 tokens: chunks of 16 continue
    engines = [pc._engine(model, tokenizer, False) for _ in range(2)]
    graphs = _with_graphs(engines[1])
    for engine in engines:
        engine.add_request("r", prompt, pc.GREEDY)
        for _ in range(3):  # 16 + 16 + 8 tokens: the last chunk (8 of 16) is padded
            engine.step()
    assert (1, 16, 16) in graphs.buckets_used
    families = [b.family for b in model.blocks]
    slot = engines[0].cache.slot_of["r"]
    assert engines[1].cache.slot_of["r"] == slot
    for family, eager, padded in zip(families, engines[0].cache.layers,
                                     engines[1].cache.layers, strict=True):
        if family in "MR":
            for name, tensor in vars(eager).items():
                torch.testing.assert_close(getattr(padded, name)[slot], tensor[slot],
                                           rtol=0, atol=1e-10)
        elif family == "A":
            for name, tensor in eager.tensors.items():  # the real blocks (scratch excluded)
                torch.testing.assert_close(padded.tensors[name][:-1], tensor[:-1],
                                           rtol=0, atol=1e-10)


@pytest.mark.parametrize("features", ["structure", "ngram"])
def test_input_features_ride_along_in_the_continuation_graphs(tokenizer, features):
    """A structure-id model's ids are right-padded with the tokens; a hashed n-gram model's
    context (the tokens before each chunk) is a static input -- right padding never enters a
    real token's n-gram window, so n-gram models take these graphs (not the first-chunk ones)."""
    from tests.infer.test_features_engine import _model as features_model

    model = features_model(tokenizer.vocab_size, structure=features == "structure",
                           orders=(2, 3) if features == "ngram" else ())
    base = "// add two numbers\nint add(int a, int b) {\n    int sum = a + b;\n    return"
    prompts = {"base": base, "again": base, "more": base + " sum; }\n// next:",
               "other": "#define GREETING"}
    out, used = {}, None
    for graphed in (False, True):
        engine = pc._engine(model, tokenizer, True, max_model_len=96)
        if graphed:
            used = _with_graphs(engine).buckets_used
        out[graphed] = {}
        for rid, prompt in prompts.items():
            engine.add_request(rid, prompt, pc.GREEDY)
            out[graphed][rid] = []
            while engine.has_unfinished():
                for o in engine.step():
                    out[graphed][o.request_id] += o.new_token_ids
    assert out[True] == out[False]
    assert used and engine.stats().prefix_hit_tokens > 0
    assert (engine.runner.prefill_graphs is None) == (features == "ngram")


@pytest.mark.parametrize("letter", ["M", "M:mimo", "R"])
def test_a_recurrent_mixer_holds_its_state_over_right_padding(letter):
    """A mixer's chunked forward from a non-zero state over rows right-padded to 12 tokens
    (garbage, even non-finite, after each row's last_index) gives the unpadded rows' outputs
    and final states, row by row."""
    from dataclasses import fields

    model = pc._model(small_config(f"{letter} A", init_std=0.3))
    mixer = model.blocks[0].mixer
    torch.manual_seed(1)
    lengths, L, B = [5, 12, 1], 12, 3
    x = torch.randn(B, L, 32, dtype=torch.float64)
    x[0, 5:], x[2, 1:] = float("nan"), 1e6  # padding: nothing of it may reach a state
    start = mixer.init_cache(B, dtype=torch.float64)
    mixer.forward(torch.randn(B, 7, 32, dtype=torch.float64), cache=start)  # a history
    padded = type(start)(**{f.name: getattr(start, f.name).clone() for f in fields(start)})
    out = mixer.forward(x, cache=padded, last_index=torch.tensor(lengths) - 1, continues=True)
    for row, n in enumerate(lengths):
        alone = type(start)(**{f.name: getattr(start, f.name)[row : row + 1].clone()
                               for f in fields(start)})
        want = mixer.forward(x[row : row + 1, :n], cache=alone)
        torch.testing.assert_close(out[row, :n], want[0], rtol=0, atol=1e-10)
        for f in fields(start):
            torch.testing.assert_close(getattr(padded, f.name)[row],
                                       getattr(alone, f.name)[0], rtol=0, atol=1e-10)
