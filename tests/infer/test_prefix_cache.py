"""Prefix caching: the block pool's reference counts and eviction order, chained hashes, and
the engine's greedy tokens identical with caching on and off on hybrid models (A, M, R; MLA,
DSA) for shared prefixes, partial matches, block-multiple and sub-block prompts, under memory
pressure and after aborts."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from megacpp.data.tokenizer import CppTokenizer, train_tokenizer
from megacpp.errors import ConfigError
from megacpp.infer.engine import Engine, EngineConfig
from megacpp.infer.prefix_cache import BlockPool, prompt_hashes
from megacpp.infer.sampling import SamplingParams
from megacpp.model.config import ModelConfig
from megacpp.model.model import HybridLM
from tests.model.conftest import small_config

HEADERS = sorted(Path("/usr/include/c++/12/bits").glob("stl_*.h"))[:4]
GREEDY = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
BS = 4  # tokens per block in these engines


@pytest.fixture(scope="module")
def tokenizer() -> CppTokenizer:
    texts = [p.read_text(encoding="utf-8") for p in HEADERS]
    return CppTokenizer.from_hf(train_tokenizer(texts, vocab_size=400))


def _model(cfg: ModelConfig) -> HybridLM:
    torch.manual_seed(0)
    return HybridLM(cfg).double().eval()


def latent_config(vocab: int) -> ModelConfig:
    """MLA and DSA pages beside M and R states, small."""
    return ModelConfig.from_dict({
        "model": {"pattern": "A:mla M R A:dsa D", "vocab_size": vocab, "d_model": 32,
                  "init_std": 0.3},
        "mla": {"n_heads": 2, "q_lora_rank": 16, "kv_lora_rank": 16,
                "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8},
        "dsa": {"index_n_heads": 2, "index_head_dim": 8, "top_k": 6, "query_chunk": 8},
        "mamba": {"d_state": 8, "headdim": 8, "expand": 2, "chunk_size": 4},
        "rnn": {"n_heads": 2, "head_k_dim": 8, "head_v_dim": 8, "chunk_size": 4},
        "mlp": {"ffn": 48},
    })


@pytest.fixture(scope="module", params=["hybrid", "mimo", "latent", "attention"])
def model(request, tokenizer) -> HybridLM:
    vocab = tokenizer.vocab_size
    if request.param == "hybrid":  # A, E, M, R
        return _model(small_config("AMEAR", vocab_size=vocab, init_std=0.3))
    if request.param == "mimo":  # Mamba-3 MIMO states (rank-R keys) in the snapshots
        return _model(small_config("A M:mimo E A R", vocab_size=vocab, init_std=0.3))
    if request.param == "latent":  # MLA and DSA pages with M and R states
        return _model(latent_config(vocab))
    return _model(small_config("ADA", vocab_size=vocab, init_std=0.3))  # no M/R: no snapshots


def _engine(model, tokenizer, prefix_cache: bool, **config) -> Engine:
    defaults = {"max_num_seqs": 4, "block_size": BS, "max_model_len": 64, "prefill_chunk": 16,
                "snapshot_interval": 8, "prefix_cache": prefix_cache}
    return Engine(model, tokenizer, EngineConfig(**{**defaults, **config}))


def _run(engine: Engine, prompts: dict[str, list[int]], together: bool) -> dict[str, list[int]]:
    """Greedy tokens per request: all added at once (``together``) or one after another."""
    out = {rid: [] for rid in prompts}

    def drain():
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id] += o.new_token_ids

    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, GREEDY)
        if not together:
            drain()
    drain()
    return out


def _prompts(vocab: int) -> dict[str, list[int]]:
    """Requests sharing prefixes: a 19-token base, extensions, a divergence inside a block, an
    exact block multiple, one shorter than a block, a repeat, and an unrelated prompt."""
    g = torch.Generator().manual_seed(3)

    def rand(n):
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    base = [1, *rand(18)]  # 19 tokens
    return {
        "base": base,
        "extend": base + rand(7),  # shares all of base
        "diverge": base[:10] + rand(9),  # shares 2.5 blocks
        "multiple": base[:16],  # 4 full blocks
        "short": base[:3],  # shorter than a block
        "repeat": list(base),
        "long": base + rand(21),  # crosses a few snapshot boundaries past the base
        "other": [1, *rand(12)],
    }


@pytest.mark.parametrize("together", [False, True], ids=["one-by-one", "together"])
def test_greedy_tokens_identical_with_and_without_prefix_cache(model, tokenizer, together):
    prompts = _prompts(model.cfg.vocab_size)
    engine_off = _engine(model, tokenizer, False)
    off = _run(engine_off, prompts, together)
    assert engine_off.cache.prefix is None and engine_off.stats().prefix_queried_tokens == 0
    engine = _engine(model, tokenizer, True)
    on = _run(engine, prompts, together)
    assert on == off
    assert len({tuple(t) for t in off.values()}) > 1  # the tokens really vary
    stats = engine.stats()
    assert stats.prefix_queried_tokens == sum(len(p) for p in prompts.values())
    if not together:  # each request finds the earlier ones' blocks
        # extend 16, diverge 0 (8 without M/R: base left no snapshot at 8), multiple 8
        # (diverge's grid snapshot; 12 without M/R), repeat 16, long 16
        assert stats.prefix_hit_tokens >= 16 + 0 + 8 + 16 + 16
        has_state = any(b.family in "MR" for b in model.blocks)
        assert (stats.prefix_snapshots > 0) == has_state
    cache = engine.cache
    assert stats.free_blocks == stats.total_blocks  # every reference was dropped
    assert all(r == 0 for r in cache.prefix.blocks.refs) and not cache.prefix.seq_hashes


def test_hits_reuse_blocks_and_skip_prefill(tokenizer):
    model = _model(small_config("AMRA", vocab_size=tokenizer.vocab_size, init_std=0.3))
    engine = _engine(model, tokenizer, True)
    base = _prompts(model.cfg.vocab_size)["base"]  # 19 tokens: blocks 0..3 full
    _run(engine, {"a": base}, together=False)
    fed = []
    run_prefill = engine.runner._run_prefill

    def spy(chunks):
        fed.extend((c.request_id, c.start, c.end) for c in chunks)
        return run_prefill(chunks)

    engine.runner._run_prefill = spy
    engine.add_request("b", base + [5, 6], GREEDY)
    engine.add_request("c", base[:17], GREEDY)
    engine.step()
    # b: the snapshot at 16 (a's last block boundary before its last token) -> feeds 16..20
    # (cut at its own last boundary); c (17 tokens) reuses 16 tokens too; both share a's
    # first four blocks
    assert ("b", 16, 20) in fed and ("c", 16, 17) in fed
    tables = engine.cache.tables
    assert tables["b"][:4] == tables["c"][:4]
    assert all(engine.cache.prefix.blocks.refs[blk] == 2 for blk in tables["b"][:4])
    engine.abort("b")
    assert all(engine.cache.prefix.blocks.refs[blk] == 1 for blk in tables["c"][:4])
    engine.abort("c")
    engine.step()
    assert all(r == 0 for r in engine.cache.prefix.blocks.refs)
    assert engine.stats().free_blocks == engine.stats().total_blocks


def test_a_request_for_prompt_logprobs_scores_every_prompt_token(tokenizer):
    """Prompt logprobs need every prompt position computed: such a request does not start
    from the cache, and its logprobs equal those of an engine without it."""
    model = _model(small_config("AMRA", vocab_size=tokenizer.vocab_size, init_std=0.3))
    base = _prompts(model.cfg.vocab_size)["base"]
    scored = dataclasses.replace(GREEDY, prompt_logprobs=1)
    got = {}
    for cache in (False, True):
        engine = _engine(model, tokenizer, cache)
        _run(engine, {"warm": base}, together=False)  # leaves base's blocks and snapshot
        engine.add_request("scored", base, scored)
        while engine.has_unfinished():
            for out in engine.step():
                if out.prompt_logprobs is not None:
                    got[cache] = out.prompt_logprobs
        if cache:
            assert engine.stats().prefix_queried_tokens == 2 * len(base)
            assert engine.stats().prefix_hit_tokens == 0
    assert len(got[True]) == len(base) and got[True] == got[False]


def test_a_burst_waits_for_the_shared_prefix_instead_of_computing_it_twice(tokenizer):
    model = _model(small_config("AMRA", vocab_size=tokenizer.vocab_size, init_std=0.3))
    base = _prompts(model.cfg.vocab_size)["base"]
    prompts = {"a": base + [5, 6], "b": base + [7, 8, 9], "c": [1, 2, 3, 4, 5, 6]}
    off = _run(_engine(model, tokenizer, False), prompts, together=True)
    engine = _engine(model, tokenizer, True)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, GREEDY)
    on = {rid: [] for rid in prompts}
    first_chunk = {}
    while engine.has_unfinished():
        scheduled = engine.scheduler.schedule()
        for work in scheduled.prefills:
            first_chunk.setdefault(work.request_id, (work.start, work.end))
        for out in engine.update_from_output(scheduled, engine.runner.execute(scheduled)):
            on[out.request_id] += out.new_token_ids
    assert on == off
    # a shares its first block with waiting b, so its chunks are cut at the snapshot grid (8);
    # b waited while a computed their common blocks (c behind it: first come, first served),
    # then started from a's snapshot at 16
    assert first_chunk["a"] == (0, 8) and first_chunk["b"][0] == 16
    assert engine.stats().prefix_hit_tokens == 16


def test_cached_blocks_and_snapshots_are_evicted_under_pressure(tokenizer):
    """16 blocks (64 tokens), 1 snapshot row: distinct 30-token prompts (8 blocks with their
    completion) one after another
    must evict cached blocks and snapshots; tokens stay those of an engine without caching,
    and a prompt whose prefix was evicted misses."""
    model = _model(small_config("AMRA", vocab_size=tokenizer.vocab_size, init_std=0.3))
    g = torch.Generator().manual_seed(4)
    prompts = {f"p{i}": [1, *torch.randint(3, model.cfg.vocab_size, (29,), generator=g).tolist()]
               for i in range(4)}
    prompts["again3"] = list(prompts["p3"])  # p3's blocks and snapshot are cached
    prompts["again0"] = list(prompts["p0"])  # p0's blocks are gone by now
    tight = {"num_blocks": 16, "max_model_len": 40, "prefix_snapshots": 1}
    off = _run(_engine(model, tokenizer, False, **tight), prompts, together=False)
    engine = _engine(model, tokenizer, True, **tight)
    hits = []
    for rid, prompt in prompts.items():
        before = engine.stats().prefix_hit_tokens
        on = _run(engine, {rid: prompt}, together=False)
        assert on[rid] == off[rid], rid
        hits.append(engine.stats().prefix_hit_tokens - before)
        stats = engine.stats()
        assert stats.prefix_cached_blocks <= stats.total_blocks and stats.prefix_snapshots <= 1
    stats = engine.stats()
    assert stats.prefix_evicted_blocks > 0 and engine.cache.prefix.snapshot_evictions > 0
    assert hits[:4] == [0, 0, 0, 0]
    assert hits[4] == 16  # p3: the snapshot where its first chunk (16 tokens) ended
    assert hits[5] == 0  # p0 was evicted
    assert stats.free_blocks == stats.total_blocks
    prefix = engine.cache.prefix
    assert set(prefix.block_of.values()) == set(prefix.hash_of) and len(prefix.block_of) <= 16


def test_a_request_needing_blocks_evicts_the_least_recently_freed():
    evicted = []
    pool = BlockPool(6, evicted.append)
    a = pool.allocate(3)  # [0, 1, 2]
    b = pool.allocate(2)  # [3, 4]
    pool.cached.update(a + b)  # as if their hashes were indexed
    pool.free(a)
    pool.free(b)
    assert pool.num_free == 6
    pool.touch([3])  # a hit on b's first block takes it out of the free queue
    assert pool.num_free == 5 and pool.refs[3] == 1
    # block 5 (never cached) goes first, then a's tail before its head, then b's
    assert pool.allocate(3) == [5, 2, 1] and evicted == [2, 1]
    assert pool.num_free_after([0, 3]) == pool.num_free - 1
    pool.free([3])
    with pytest.raises(AssertionError, match="freed more often"):
        pool.free([3])


def test_block_hashes_chain_over_the_prefix():
    first = prompt_hashes([1, 2, 3, 4, 5, 6, 7, 8], None, 4, 2)
    other = prompt_hashes([9, 2, 3, 4, 5, 6, 7, 8], None, 4, 2)
    assert first[0] != other[0] and first[1] != other[1]  # same tokens, other parent
    assert prompt_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], None, 4, 2) == first
    assert prompt_hashes([1, 2, 3, 4, 5, 6, 7, 8], None, 4, 2, first[:1]) == first
    assert prompt_hashes([1, 2, 3, 4], [0, 0, 0, 1], 4, 1) != first[:1]  # structure ids count


def test_prefix_cache_options_are_checked():
    with pytest.raises(ConfigError, match="prefix_snapshots"):
        EngineConfig(prefix_snapshots=0)
    with pytest.raises(ConfigError, match="snapshot_interval"):
        EngineConfig(snapshot_interval=0)
    assert EngineConfig(max_num_seqs=5).snapshot_rows == 10
    assert EngineConfig(prefix_cache=False).snapshot_rows == 0


@pytest.mark.parametrize("features", ["structure", "ngram"])
def test_input_features_give_the_same_tokens_with_the_cache(tokenizer, features):
    """A structure-id model hashes each block's structure ids with its tokens; a hashed
    n-gram branch reads the tokens before a chunk (the chain covers them)."""
    from tests.infer.test_features_engine import _model as features_model

    model = features_model(tokenizer.vocab_size, structure=features == "structure",
                           orders=(2, 3) if features == "ngram" else ())
    base = "// add two numbers\nint add(int a, int b) {\n    int sum = a + b;\n    return"
    prompts = {"base": base, "again": base, "more": base + " sum; }\n// next:",
               "other": "#define GREETING"}
    out = {}
    for cache in (False, True):
        engine = _engine(model, tokenizer, cache, max_model_len=96)
        out[cache] = {}
        for rid, prompt in prompts.items():
            engine.add_request(rid, prompt, GREEDY)
            out[cache][rid] = []
            while engine.has_unfinished():
                for o in engine.step():
                    out[cache][o.request_id] += o.new_token_ids
    assert out[True] == out[False]
    assert engine.stats().prefix_hit_tokens > 0  # "again" reuses base's blocks at least


def test_a_waiting_request_is_hashed_once(tokenizer, monkeypatch):
    from megacpp.infer import prefix_cache

    model = _model(small_config("AMRA", vocab_size=tokenizer.vocab_size, init_std=0.3))
    base = _prompts(model.cfg.vocab_size)["base"]
    prompts = {"a": base + [5, 6], "b": base + [7, 8, 9]}
    engine = _engine(model, tokenizer, True)
    hashed = []
    real = prefix_cache.block_hash
    monkeypatch.setattr(prefix_cache, "block_hash",
                        lambda parent, tokens, extra=None: hashed.append(tuple(tokens))
                        or real(parent, tokens, extra))
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, GREEDY)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    # b waits several steps for a's shared blocks; each full block of each prompt is hashed
    # exactly once (the lookups; a computed block is registered under its known hash)
    assert steps > 3
    assert len(hashed) == (len(prompts["a"]) - 1) // BS + (len(prompts["b"]) - 1) // BS


def test_the_hits_one_step_admits_get_their_snapshots_together(tokenizer, monkeypatch):
    """Requests admitted in one step that start from prefix-cache snapshots get them in one
    gather and scatter per state tensor (not one per request and tensor), and the tokens are
    those without the cache."""
    from megacpp.infer import prefix_cache

    model = _model(small_config("AMRA", vocab_size=tokenizer.vocab_size, init_std=0.3))
    base = _prompts(model.cfg.vocab_size)["multiple"]  # 16 tokens: 4 whole blocks
    later = {"a": base + [5, 6], "b": base + [7, 8, 9], "c": base + [4]}
    off = _run(_engine(model, tokenizer, False), later, together=True)
    engine = _engine(model, tokenizer, True, prefill_chunk=64)
    _run(engine, {"base": base}, together=True)  # its prompt ends on a block: a snapshot
    restores = []
    real = prefix_cache.scatter_state
    monkeypatch.setattr(prefix_cache, "scatter_state", lambda pool, slots, state: (
        restores.append(slots.tolist()) if any(pool is p for p in engine.cache.state_pools)
        else None,
        real(pool, slots, state)))
    assert _run(engine, later, together=True) == off
    n_pools = len(engine.cache.state_pools)
    assert n_pools > 0 and len(restores) == n_pools  # one scatter per state pool, all three
    assert all(sorted(r) == sorted(restores[0]) and len(r) == 3 for r in restores)
