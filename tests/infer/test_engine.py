"""The serving engine: batched == alone, == generate_greedy, chunked prefill, preemption,
cancel frees blocks and slots, sampling / stop / eos / length, errors, bounded queue."""

from __future__ import annotations

import copy
import dataclasses
import types
from pathlib import Path

import pytest
import torch

from megacpp.errors import ConfigError, MegaCppError
from megacpp.infer.engine import Engine, EngineConfig, QueueFull
from megacpp.infer.graphs import DecodeGraphs, compiled_decode_fn
from megacpp.infer.sampling import SamplingParams
from megacpp.model.config import ModelConfig, load_config
from megacpp.model.model import HybridLM

HEADERS = sorted(Path("/usr/include/c++/12/bits").glob("stl_*.h"))[:6]
LENGTHS = (1, 5, 17, 33, 9, 23)  # mixed prompt lengths (1: BOS only; chunks of 8)
GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)


def _tiny(vocab: int) -> ModelConfig:
    # init_std 0.3: a random model whose greedy tokens vary (0.02 repeats one token)
    return dataclasses.replace(load_config("tiny"), vocab_size=vocab, init_std=0.3)


def _latent(vocab: int) -> ModelConfig:
    """MLA + DSA (top_k smaller than the prompts: the sparse path runs) with M, R, E, D."""
    return ModelConfig.from_dict(
        {
            "model": {"pattern": "A:mla E M A:dsa R D", "vocab_size": vocab, "d_model": 64,
                      "init_std": 0.3},
            "mla": {"n_heads": 4, "q_lora_rank": 24, "kv_lora_rank": 32,
                    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16},
            "dsa": {"index_n_heads": 2, "index_head_dim": 16, "top_k": 8, "query_chunk": 8},
            "mamba": {"d_state": 16, "headdim": 16, "expand": 2, "chunk_size": 8},
            "rnn": {"n_heads": 2, "head_k_dim": 16, "head_v_dim": 16, "chunk_size": 8},
            "moe": {"n_experts": 4, "top_k": 2, "expert_ffn": 32},
            "mlp": {"ffn": 96},
        }
    )


def _model(cfg: ModelConfig) -> HybridLM:
    torch.manual_seed(0)
    return HybridLM(cfg).double().eval()


@pytest.fixture(scope="module", params=["tiny", "latent"])
def model(request, tokenizer) -> HybridLM:
    build = _tiny if request.param == "tiny" else _latent
    return _model(build(tokenizer.vocab_size))


@pytest.fixture(scope="module")
def tiny_model(tokenizer) -> HybridLM:
    return _model(_tiny(tokenizer.vocab_size))


def _prompts(vocab: int, lengths=LENGTHS) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [[1, *torch.randint(3, vocab, (n - 1,), generator=g).tolist()] for n in lengths]


def _engine(model, tokenizer, **config) -> Engine:
    defaults = {"max_num_seqs": 8, "block_size": 4, "max_model_len": 96, "prefill_chunk": 8}
    return Engine(model, tokenizer, EngineConfig(**{**defaults, **config}))


def _run(engine: Engine, requests: dict[str, tuple[list[int] | str, SamplingParams]]):
    """Add every request, step to the end; per request: (token ids, text, finish_reason)."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    ids = {rid: [] for rid in requests}
    text = {rid: "" for rid in requests}
    reason = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id not in reason, "output after finishing"
            ids[out.request_id] += out.new_token_ids
            text[out.request_id] += out.new_text
            if out.finished:
                reason[out.request_id] = out.finish_reason
                assert out.completion_tokens == len(ids[out.request_id])
    return {rid: (ids[rid], text[rid], reason.get(rid)) for rid in requests}


@pytest.fixture(scope="module")
def batched(model, tokenizer) -> dict:
    """Greedy completions of the LENGTHS prompts decoded together (shared by the tests)."""
    prompts = _prompts(model.cfg.vocab_size)
    return _run(_engine(model, tokenizer), {str(i): (p, GREEDY) for i, p in enumerate(prompts)})


def test_batched_greedy_equals_alone_and_generate_greedy(model, tokenizer, batched):
    prompts = _prompts(model.cfg.vocab_size)
    for i, prompt in enumerate(prompts):
        alone = _run(_engine(model, tokenizer, max_num_seqs=1), {"x": (prompt, GREEDY)})["x"]
        reference = model.generate_greedy(torch.tensor([prompt]), GREEDY.max_new_tokens)
        assert batched[str(i)][0] == alone[0] == reference[0, len(prompt):].tolist()
        assert batched[str(i)][2] == "length"
    assert len({tuple(b[0]) for b in batched.values()}) > 1  # the tokens really vary


def test_equal_length_prompts_prefill_in_one_forward_and_equal_alone(model, tokenizer):
    """A burst of same-size prompts is prefilled as one [B, L] forward (no padding: M/R
    states and paged KV of every row), and still decodes exactly as each prompt alone."""
    prompts = _prompts(model.cfg.vocab_size, lengths=(6, 6, 6, 6, 11, 11))
    engine = _engine(model, tokenizer, prefill_chunk=24)
    groups = []
    run_prefill = engine.runner._run_prefill

    def spy(chunks):  # records how many rows each prefill forward carried
        groups.append(len(chunks))
        return run_prefill(chunks)

    engine.runner._run_prefill = spy
    together = _run(engine, {str(i): (p, GREEDY) for i, p in enumerate(prompts)})
    assert max(groups) >= 2
    for i, prompt in enumerate(prompts):
        reference = model.generate_greedy(torch.tensor([prompt]), GREEDY.max_new_tokens)
        assert together[str(i)][0] == reference[0, len(prompt):].tolist()


def test_requests_join_between_decode_steps(tiny_model, tokenizer):
    """Continuous batching: a request added while others decode gets the same tokens."""
    engine = _engine(tiny_model, tokenizer)
    a, b = _prompts(tiny_model.cfg.vocab_size, (12, 30))
    engine.add_request("a", a, GREEDY)
    ids = {"a": [], "b": []}
    for _ in range(4):
        for out in engine.step():
            ids[out.request_id] += out.new_token_ids
    assert 0 < len(ids["a"]) < GREEDY.max_new_tokens
    engine.add_request("b", b, GREEDY)
    while engine.has_unfinished():
        for out in engine.step():
            ids[out.request_id] += out.new_token_ids
    for rid, prompt in (("a", a), ("b", b)):
        ref = tiny_model.generate_greedy(torch.tensor([prompt]), GREEDY.max_new_tokens)
        assert ids[rid] == ref[0, len(prompt):].tolist()


def test_preemption_under_a_tiny_block_budget_keeps_greedy_tokens(model, tokenizer, batched):
    requests = {str(i): (p, GREEDY) for i, p in enumerate(_prompts(model.cfg.vocab_size))}
    # 44 tokens of KV for 6 sequences of 9..41 tokens (136 in all): must preempt, recompute
    tight = _engine(model, tokenizer, num_blocks=11, max_model_len=44)
    assert _run(tight, requests) == batched
    stats = tight.stats()
    assert stats.preemptions > 0
    assert (stats.free_blocks, stats.free_slots) == (11, 8)
    assert (stats.running, stats.waiting) == (0, 0)


def test_sampling_is_seeded_and_independent_of_batching_and_preemption(tiny_model, tokenizer):
    prompts = _prompts(tiny_model.cfg.vocab_size, (9, 30, 3, 17))
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_new_tokens=8, seed=5,
                            ignore_eos=True)
    requests = {str(i): (p, params) for i, p in enumerate(prompts)}
    first = _run(_engine(tiny_model, tokenizer), requests)
    again = _run(_engine(tiny_model, tokenizer, num_blocks=12, max_model_len=48), requests)
    assert again["3"] == first["3"]
    alone = _run(_engine(tiny_model, tokenizer, max_num_seqs=1), {"3": requests["3"]})
    assert first == again
    assert first["3"] == alone["3"]
    other_seed = dataclasses.replace(params, seed=6)
    assert _run(_engine(tiny_model, tokenizer), {"3": (prompts[3], other_seed)}) != alone


def test_abort_mid_generation_frees_blocks_and_slots(tiny_model, tokenizer):
    engine = _engine(tiny_model, tokenizer, num_blocks=64)
    prompts = _prompts(tiny_model.cfg.vocab_size, (20, 9))
    params = dataclasses.replace(GREEDY, max_new_tokens=50)
    engine.add_request("a", prompts[0], params)
    engine.add_request("b", prompts[1], params)
    for _ in range(6):
        engine.step()
    before = engine.stats()
    assert before.running == 2 and before.free_slots == 6
    held_a = len(engine.cache.tables["a"])
    engine.abort("a")
    after = engine.stats()
    assert after.free_blocks == before.free_blocks + held_a and after.free_slots == 7
    assert after.running == 1
    outs = engine.step()
    aborted = [o for o in outs if o.request_id == "a"]
    assert len(aborted) == 1 and aborted[0].finished and aborted[0].finish_reason == "abort"
    engine.abort("b")
    engine.abort("b")  # twice, and unknown ids: no-ops
    engine.abort("nope")
    engine.step()
    assert not engine.has_unfinished()
    final = engine.stats()
    assert (final.free_blocks, final.free_slots, final.running) == (64, 8, 0)


def test_abort_of_a_waiting_request(tiny_model, tokenizer):
    engine = _engine(tiny_model, tokenizer, max_num_seqs=1)
    engine.add_request("a", [1, 5, 6], GREEDY)
    engine.add_request("b", [1, 7, 8], GREEDY)
    engine.step()
    assert engine.stats().waiting == 1
    engine.abort("b")
    assert engine.stats().waiting == 0
    finished = {}
    while engine.has_unfinished():
        finished.update({o.request_id: o.finish_reason for o in engine.step() if o.finished})
    assert finished == {"a": "length", "b": "abort"}
    assert engine.stats().free_slots == 1


def test_stop_sequences_cut_text_and_hold_back_partial_matches(tiny_model, tokenizer):
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    ids, free, reason = _run(_engine(tiny_model, tokenizer), {"x": ("int main() {", params)})["x"]
    assert reason == "length" and free == tokenizer.decode(ids)
    stop = free[5:8]
    assert len(stop) == 3 and free.find(stop) == 5
    stopped = dataclasses.replace(params, stop=(stop, "never appears \x00"))
    engine = _engine(tiny_model, tokenizer)
    engine.add_request("x", "int main() {", stopped)
    deltas, last = [], None
    while engine.has_unfinished():
        for out in engine.step():
            deltas.append(out.new_text)
            last = out
    assert last.finish_reason == "stop" and "".join(deltas) == free[:5]
    assert all(stop not in d for d in deltas)
    assert last.completion_tokens < len(ids)


def test_max_tokens_and_max_model_len_end_with_length(tiny_model, tokenizer):
    params = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
    ids, _, reason = _run(_engine(tiny_model, tokenizer), {"x": ([1, 5, 9], params)})["x"]
    assert len(ids) == 3 and reason == "length"
    one = dataclasses.replace(params, max_new_tokens=1)  # ends at the prefill's token
    engine = _engine(tiny_model, tokenizer)
    assert _run(engine, {"x": ([1, 5, 9], one)})["x"][0] == ids[:1]
    assert engine.stats().free_slots == 8
    long = dataclasses.replace(params, max_new_tokens=500)
    ids, _, reason = _run(_engine(tiny_model, tokenizer, max_model_len=20),
                          {"x": ([1] * 15, long)})["x"]
    assert len(ids) == 5 and reason == "length"


def test_eos_ends_the_completion_unless_ignored(tiny_model, tokenizer):
    prompt = _prompts(tiny_model.cfg.vocab_size, (7,))[0]
    free_ids, _, _ = _run(_engine(tiny_model, tokenizer), {"x": (prompt, GREEDY)})["x"]
    eos = free_ids[3]
    first = free_ids.index(eos)
    tok = copy.copy(tokenizer)
    tok.eos_id = eos  # let the 4th greedy token play EOS
    params = dataclasses.replace(GREEDY, ignore_eos=False)
    ids, text, reason = _run(_engine(tiny_model, tok), {"x": (prompt, params)})["x"]
    assert reason == "eos" and ids == free_ids[: first + 1]
    assert text == tokenizer.decode(free_ids[:first])  # EOS itself is not text
    ignored = _run(_engine(tiny_model, tok), {"x": (prompt, GREEDY)})["x"]
    assert ignored[0] == free_ids and ignored[2] == "length"


def test_invalid_requests_are_clear_errors(tiny_model, tokenizer):
    engine = _engine(tiny_model, tokenizer, max_model_len=16)
    bad = [
        ("a", "", None),  # BOS only would be fine; an empty token list is not
        ("a", [], "empty"),
        ("a", [1] * 16, "max_model_len"),
        ("a", [1, 10**6], "token ids"),
        ("a", [1, "x"], "token ids"),
        ("a", 42, "prompt must be"),
        ("", [1, 2], "request_id"),
    ]
    for rid, prompt, message in bad:
        if message is None:
            continue
        with pytest.raises(MegaCppError, match=message):
            engine.add_request(rid, prompt, GREEDY)
    with pytest.raises(MegaCppError, match="SamplingParams"):
        engine.add_request("a", [1, 2], {"temperature": 0})
    engine.add_request("a", "", GREEDY)  # "" encodes to [BOS]: a valid one-token prompt
    with pytest.raises(MegaCppError, match="already in use"):
        engine.add_request("a", [1, 2], GREEDY)
    assert engine.stats().waiting == 1


@pytest.mark.parametrize("bad", [{"max_num_seqs": 0}, {"block_size": -1},
                                 {"num_blocks": 3, "block_size": 4, "max_model_len": 16},
                                 {"prefill_chunk": 0}, {"max_waiting": True}])
def test_bad_engine_config_is_a_config_error(bad):
    with pytest.raises(ConfigError):
        EngineConfig(**bad)


def test_queue_full_at_max_waiting(tiny_model, tokenizer):
    engine = _engine(tiny_model, tokenizer, max_waiting=2)
    engine.add_request("a", [1, 2], GREEDY)
    engine.add_request("b", [1, 2], GREEDY)
    with pytest.raises(QueueFull):
        engine.add_request("c", [1, 2], GREEDY)
    assert isinstance(QueueFull("x"), MegaCppError)
    engine.step()  # admits both: the queue has room again
    engine.add_request("c", [1, 2], GREEDY)


def test_stats_count_tokens(tiny_model, tokenizer):
    engine = _engine(tiny_model, tokenizer)
    out = _run(engine, {"a": ([1, 2, 3], GREEDY), "b": ([1, 4], GREEDY)})
    stats = engine.stats()
    assert stats.prompt_tokens == 5
    generated = sum(len(ids) for ids, _, _ in out.values())
    assert stats.generated_tokens == generated == 2 * GREEDY.max_new_tokens
    assert stats.total_slots == 8 and stats.total_blocks == 8 * 24


def test_padded_decode_buckets_do_not_change_tokens(model, tokenizer, batched):
    """The CUDA-graph runner's padding, run eagerly on the CPU: rows padded up to a batch
    bucket (token 0 at position 0, scratch block and slot) and block tables padded up to a
    width bucket leave every real row's greedy tokens unchanged."""
    prompts = _prompts(model.cfg.vocab_size)
    requests = {str(i): (p, GREEDY) for i, p in enumerate(prompts)}
    engine = _engine(model, tokenizer, max_num_seqs=7, prefill_chunk=128)  # buckets 1,2,4,7
    engine.graphs = DecodeGraphs(engine.model, engine.cache, 7, 24, capture=False)
    assert _run(engine, requests) == batched
    assert 7 in {b for b, _ in engine.graphs.buckets_used}  # 6 rows padded to 7
    longest = max(LENGTHS) + GREEDY.max_new_tokens  # 41 tokens: 11 blocks of 4 -> width 16
    assert max(w for _, w in engine.graphs.buckets_used) > -(-longest // 4)


def test_paged_attention_decode_backend_gives_the_same_tokens(tiny_model, tokenizer,
                                                              monkeypatch):
    """Where the catalog chooses a ``paged_attention_decode`` backend (the Triton kernel on
    CUDA), the A layers' decode steps attend through it, in padded decode buckets too, and the
    greedy tokens are unchanged (here the backend is the surface's reference, marked chosen,
    so the CPU runs the same plumbing: the pool write, the block table, the positions)."""
    import megacpp.model.attention as attention_module
    from megacpp.kernels.ops.paged_attention_decode.reference import (
        paged_attention_decode_reference,
    )

    params = dataclasses.replace(GREEDY, max_new_tokens=4)
    prompts = _prompts(tiny_model.cfg.vocab_size, (1, 5, 9))
    requests = {str(i): (p, params) for i, p in enumerate(prompts)}
    config = {"max_num_seqs": 4, "prefill_chunk": 128}  # every prompt in one prefill step
    plain = _run(_engine(tiny_model, tokenizer, **config), requests)
    real_resolve, rows_seen = attention_module.resolve, []

    def counted(q, *args):
        rows_seen.append(q.shape[0])
        return paged_attention_decode_reference(q, *args)

    chosen = types.SimpleNamespace(role="chosen", fn=counted)
    monkeypatch.setattr(attention_module, "resolve", lambda surface, like: (
        chosen if surface == "paged_attention_decode" else real_resolve(surface, like)))
    assert _run(_engine(tiny_model, tokenizer, **config), requests) == plain
    assert 3 in rows_seen
    rows_seen.clear()
    engine = _engine(tiny_model, tokenizer, **config)
    engine.graphs = DecodeGraphs(engine.model, engine.cache, 4, 24, capture=False)
    assert _run(engine, requests) == plain
    assert 4 in rows_seen  # three rows padded to the bucket of 4 (a scratch-block row)


def test_compiled_decode_layers_give_the_same_tokens(tiny_model, tokenizer):
    """``compile_decode``'s plumbing: one compiled paged_layer shared by the blocks of a
    family (dynamo alone here; inductor in test_engine_gpu.py) decodes the same tokens."""
    prompts = _prompts(tiny_model.cfg.vocab_size, (9, 12))
    params = dataclasses.replace(GREEDY, max_new_tokens=6)
    requests = {str(i): (p, params) for i, p in enumerate(prompts)}
    plain = _run(_engine(tiny_model, tokenizer), requests)
    engine = _engine(tiny_model, tokenizer, max_num_seqs=2)
    decode_fn = compiled_decode_fn(engine.model, backend="eager")
    engine.graphs = DecodeGraphs(engine.model, engine.cache, 2, 24, decode_fn, capture=False)
    assert _run(engine, requests) == plain


def test_compiled_decode_compiles_around_an_opaque_kernel(tiny_model, tokenizer, monkeypatch):
    """A block calling one of our fast kernels, which dynamo does not trace (``declare.lazy``;
    the Triton RMSNorm under ``--kernels auto``), compiles in pieces around it and decodes the
    same tokens (``fullgraph=True`` refuses it: "Attempted to call function marked as
    skipped")."""
    import megacpp.model.norm as norm_module
    from megacpp._compile import disable
    from megacpp.kernels.ops.rmsnorm.reference import rmsnorm_reference

    prompts = _prompts(tiny_model.cfg.vocab_size, (9, 12))
    params = dataclasses.replace(GREEDY, max_new_tokens=6)
    requests = {str(i): (p, params) for i, p in enumerate(prompts)}
    plain = _run(_engine(tiny_model, tokenizer), requests)
    calls = []

    def opaque_norm(*args):
        calls.append(args[0].shape)
        return rmsnorm_reference(*args)

    backend = types.SimpleNamespace(role="chosen", fn=disable(opaque_norm))
    monkeypatch.setattr(norm_module, "resolve", lambda surface, like: backend)
    torch._dynamo.reset()
    engine = _engine(tiny_model, tokenizer, max_num_seqs=2)
    decode_fn = compiled_decode_fn(engine.model, backend="eager")
    engine.graphs = DecodeGraphs(engine.model, engine.cache, 2, 24, decode_fn, capture=False)
    assert _run(engine, requests) == plain
    assert any(shape[-2] == 1 for shape in calls)  # decode steps ran the opaque kernel


def test_admitted_slots_reset_together_before_the_forward(tiny_model, tokenizer, monkeypatch):
    """The requests one step admits get their state slots reset in one fill per state tensor
    (not one per request and tensor), before that step's forward: a slot left dirty by an
    earlier request still gives the same tokens."""
    from megacpp.infer import cache_manager

    prompts = _prompts(tiny_model.cfg.vocab_size, (9, 12, 7))
    params = dataclasses.replace(GREEDY, max_new_tokens=4)
    requests = {str(i): (p, params) for i, p in enumerate(prompts)}
    expected = _run(_engine(tiny_model, tokenizer), requests)
    engine = _engine(tiny_model, tokenizer, prefill_chunk=32)  # one step admits all three
    for pool in engine.cache.state_pools:  # as if earlier requests had used every slot
        for name in vars(pool):
            getattr(pool, name).normal_()
    fills = []
    real = cache_manager.zero_state_slots
    monkeypatch.setattr(cache_manager, "zero_state_slots",
                        lambda pool, slots: (fills.append(slots.tolist()), real(pool, slots)))
    assert _run(engine, requests) == expected
    assert len(engine.cache.state_pools) > 0
    assert fills == [[0, 1, 2]] * len(engine.cache.state_pools)
