"""Self-speculative decoding (MTP drafts, main-model verify): greedy output identical to plain
greedy decoding for a hybrid A/E/M/R model, with the MTP module's own drafts and with drafts
of controlled quality (rows accepting different numbers of tokens), k = 1..3, eager and through
the speculative graphs' buffers (``SpecGraphs`` with ``capture=False``: padded buckets, static
inputs, eager replays); bucket choice, buffer sizes, fallbacks and refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megacpp.errors import ConfigError
from megacpp.infer.engine import Engine, EngineConfig
from megacpp.infer.graphs import batch_buckets, width_buckets
from megacpp.infer.sampling import SamplingParams
from megacpp.infer.scheduler import ScheduledRequest
from megacpp.infer.spec_graphs import SpecGraphs
from megacpp.infer.speculative import Draft, SpeculativeDecoder
from megacpp.model.config import ModelConfig, MtpConfig, NgramConfig
from megacpp.model.model import HybridLM

LENGTHS = (1, 5, 17, 9)  # mixed prompt lengths, prefilled in chunks of 8
NEW = 10
GREEDY = SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tokenizer) -> HybridLM:
    # A, E, M, R sublayers; init_std 0.3 so greedy tokens vary; one MTP module ("AE")
    cfg = _small(tokenizer.vocab_size, mtp=MtpConfig(depth=1))
    torch.manual_seed(0)
    return HybridLM(cfg).double().eval()


def _small(vocab: int, **changes) -> ModelConfig:
    return dataclasses.replace(ModelConfig.from_dict({
        "model": {"pattern": "A E M R", "vocab_size": vocab, "d_model": 64, "init_std": 0.3},
        "attention": {"n_heads": 4, "n_kv_heads": 2, "head_dim": 16},
        "mamba": {"d_state": 16, "headdim": 16, "expand": 2, "chunk_size": 8},
        "rnn": {"n_heads": 2, "head_k_dim": 16, "head_v_dim": 16, "chunk_size": 8},
        "moe": {"n_experts": 4, "top_k": 2, "expert_ffn": 32},
    }), **changes)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [[1, *torch.randint(3, vocab, (n - 1,), generator=g).tolist()] for n in LENGTHS]


def _engine(model, tokenizer, k: int, device: str = "cpu", graphed: bool = False,
            **config) -> Engine:
    """An engine; ``graphed`` on the CPU: the speculative step through SpecGraphs' padded
    static buffers with eager replays (``capture=False``)."""
    defaults = {"max_num_seqs": 8, "block_size": 4, "max_model_len": 96, "prefill_chunk": 8}
    cfg = EngineConfig(**{**defaults, **config}, speculative_tokens=k)
    engine = Engine(model, tokenizer, cfg, device=device)
    if graphed and engine.speculative.graphs is None:
        width = -(-cfg.max_model_len // cfg.block_size)
        engine.speculative.graphs = SpecGraphs(engine.speculative, cfg.max_num_seqs, width,
                                               capture=False)
    return engine


def _run(engine: Engine, prompts, params=GREEDY) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return out


@pytest.fixture(scope="module")
def plain(model, tokenizer) -> dict[str, list[int]]:
    return _run(_engine(model, tokenizer, 0), _prompts(tokenizer.vocab_size))


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_mtp_drafts_give_plain_greedy_output(model, tokenizer, plain, k, graphed):
    engine = _engine(model, tokenizer, k, graphed=graphed)
    assert _run(engine, _prompts(tokenizer.vocab_size)) == plain
    stats = engine.stats()
    assert stats.spec_draft_tokens > 0  # it speculated (a random MTP head is rarely right)
    assert stats.generated_tokens == NEW * len(LENGTHS)


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_rows_accepting_different_prefixes(model, tokenizer, plain, k, graphed, monkeypatch):
    """Drafts that are the true greedy continuation up to a row-dependent point (row i is
    wrong at draft i % (k + 1): row 0 rejects at once, row k accepts everything) exercise
    accept-all, accept-some and reject-all in one batch, and the M/R rollback after each."""
    prompts = _prompts(tokenizer.vocab_size)
    accepted_by_row = controlled_drafts(monkeypatch, prompts, plain, k, tokenizer.vocab_size)
    engine = _engine(model, tokenizer, k, graphed=graphed)
    assert _run(engine, prompts) == plain
    for rid, accepted in accepted_by_row.items():
        wrong_at = int(rid) % (k + 1)
        # a row accepts its drafts up to the wrong one (fewer only where drafts were capped)
        assert max(accepted) == min(wrong_at, k)
    assert engine.stats().spec_accepted_tokens > 0
    assert len({max(a) for a in accepted_by_row.values()}) == min(k + 1, len(LENGTHS))


def controlled_drafts(monkeypatch, prompts: list[list[int]], plain: dict[str, list[int]], k: int,
                      vocab: int) -> dict[str, list[int]]:
    """Make every speculative step verify the true greedy continuation with one wrong draft
    at index ``int(request_id) % (k + 1)`` (none when that is k); -> request id -> drafts
    accepted per step (filled as the engine runs)."""
    truth = {rid: prompts[int(rid)] + tokens for rid, tokens in plain.items()}
    real_draft, real_step = SpeculativeDecoder._draft, SpeculativeDecoder._step
    accepted_by_row: dict[str, list[int]] = {}

    def controlled_draft(self, rows, n, inputs):
        real_draft(self, rows, n, inputs)  # the MTP module still runs (its cache, its draft)
        drafts = []
        for r in rows:
            row = [truth[r.request_id][r.start + j] if r.start + j < len(truth[r.request_id])
                   else 0 for j in range(1, n + 1)]
            wrong_at = int(r.request_id) % (k + 1)
            if wrong_at < n:
                row[wrong_at] = (row[wrong_at] + 1) % vocab
            drafts.append(row)
        return torch.tensor(drafts, device=self.cache.device)

    def recording_step(self, rows, n):
        out = real_step(self, rows, n)
        for rid, step in out.items():
            accepted_by_row.setdefault(rid, []).append(step.accepted)
        return out

    monkeypatch.setattr(SpeculativeDecoder, "_draft", controlled_draft)
    monkeypatch.setattr(SpeculativeDecoder, "_step", recording_step)
    return accepted_by_row


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
def test_tight_blocks_and_max_model_len(model, tokenizer, plain, graphed):
    """Drafts near max_model_len are capped and preemption under block pressure recomputes
    the MTP cache: still the plain greedy tokens. Graphed, a capped group (fewer drafts) gets
    graphs of its own k."""
    prompts = _prompts(tokenizer.vocab_size)
    longest = max(LENGTHS) + NEW
    engine = _engine(model, tokenizer, 3, graphed=graphed, max_model_len=longest,
                     num_blocks=-(-longest // 4) + 8)
    assert _run(engine, prompts) == plain
    assert engine.stats().preemptions > 0
    if graphed:
        assert {k for _, _, k in engine.speculative.graphs.buckets_used} > {3}


def test_sampled_requests_do_not_speculate(model, tokenizer):
    prompts = _prompts(tokenizer.vocab_size)[:2]
    params = SamplingParams(temperature=0.8, max_new_tokens=5, seed=3, ignore_eos=True)
    spec = _engine(model, tokenizer, 2)
    assert _run(spec, prompts, params) == _run(_engine(model, tokenizer, 0), prompts, params)
    assert spec.stats().spec_draft_tokens == 0


def test_model_without_mtp_is_refused(tokenizer):
    cfg = _small(tokenizer.vocab_size)
    with pytest.raises(ConfigError, match=r"needs a model with multi-token-prediction heads"):
        _engine(HybridLM(cfg), tokenizer, 2)


def test_recurrent_mtp_module_is_refused(tokenizer):
    cfg = _small(tokenizer.vocab_size, mtp=MtpConfig(depth=1, pattern="ME"))
    with pytest.raises(ConfigError, match=r"must be attention, MoE or dense MLP .* has M"):
        _engine(HybridLM(cfg), tokenizer, 1)


@pytest.mark.parametrize("k", [-1, 17, True])
def test_bad_speculative_tokens(k):
    with pytest.raises(ConfigError, match="speculative_tokens must be an integer in 0..16"):
        EngineConfig(speculative_tokens=k)


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
def test_ngram_model_speculates_exactly(tokenizer, graphed):
    """A hashed n-gram branch reads the tokens before each verified draft (history, then the
    drafts themselves): still plain greedy output."""
    cfg = _small(tokenizer.vocab_size, mtp=MtpConfig(depth=1),
                 ngram=NgramConfig(orders=(2, 3), table_size=256))
    torch.manual_seed(0)
    model = HybridLM(cfg).double().eval()
    prompts = _prompts(tokenizer.vocab_size)[1:3]
    want = _run(_engine(model, tokenizer, 0), prompts)
    assert _run(_engine(model, tokenizer, 2, graphed=graphed), prompts) == want


def test_text_generator_speculates(model, tokenizer):
    """`megacpp generate --temperature 0 --speculative-tokens K`'s path: the same text."""
    from megacpp.infer.generate import TextGenerator

    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    prompt = "template <typename T>\nstruct box {"
    plain_text = TextGenerator(model, tokenizer).complete(prompt, 1, params)
    spec_text = TextGenerator(model, tokenizer, speculative_tokens=3).complete(prompt, 1, params)
    assert spec_text == plain_text
    with pytest.raises(ConfigError, match="speculative_tokens must be an integer"):
        TextGenerator(model, tokenizer, speculative_tokens=99)


def test_mimo_layers_roll_back_like_siso_ones(tokenizer):
    """Mamba-3 MIMO layers in the main stack: per-position states from the verify forward
    (rank-R keys) roll back to the last accepted token; greedy output equals plain."""
    cfg = dataclasses.replace(_small(tokenizer.vocab_size, mtp=MtpConfig(depth=1)),
                              pattern="A E M:mimo R")
    torch.manual_seed(0)
    model = HybridLM(cfg).double().eval()
    prompts = _prompts(tokenizer.vocab_size)
    want = _run(_engine(model, tokenizer, 0), prompts)
    engine = _engine(model, tokenizer, 2)
    assert _run(engine, prompts) == want and engine.stats().spec_draft_tokens > 0


def test_graph_buckets_are_the_decode_buckets(model, tokenizer, plain):
    """Each step runs the smallest (batch, width) bucket of the decode graphs' sizes that
    holds its rows and positions N .. N + k, with the step's exact k."""
    engine = _engine(model, tokenizer, 3, graphed=True)
    graphs = engine.speculative.graphs
    seen = []
    real_stage = graphs.stage

    def recording_stage(rows, pending, k):
        seen.append((len(rows), max(r.start for r in rows) + k + 1, k))
        return real_stage(rows, pending, k)

    graphs.stage = recording_stage
    assert _run(engine, _prompts(tokenizer.vocab_size)) == plain
    batches, widths = batch_buckets(8), width_buckets(24)
    want = {(next(b for b in batches if b >= n), next(w for w in widths if w * 4 >= end), k)
            for n, end, k in seen}
    assert graphs.buckets_used == want == set(graphs.graphs)
    assert {b for b, _, _ in want} > {1} and {w for _, w, _ in want} > {8}  # several buckets


def test_graph_buffers_are_sized_for_the_largest_step(model, tokenizer):
    engine = _engine(model, tokenizer, 3, graphed=True)
    graphs = engine.speculative.graphs
    n, width, L = 8, 24, 4
    assert graphs.h_prev.shape == (n, 1, model.cfg.d_model)
    assert graphs.h_prev.dtype == torch.float64
    assert graphs.drafts_in.numel() == n * 3
    assert {name: b - a for name, (a, b) in graphs.inputs.offsets.items()} == {
        "newest": n, "first": n, "positions": n * L, "slot_mapping": n * L,
        "tables": n * width, "state_slots": n, "ngram": 0}


def _row(rid: str, start: int, blocks: int) -> ScheduledRequest:
    params = SamplingParams(temperature=0, max_new_tokens=4)
    return ScheduledRequest(rid, [5], start, list(range(blocks)), 0, True, params, None)


def test_graph_refuses_steps_past_its_buffers(model, tokenizer):
    engine = _engine(model, tokenizer, 2, graphed=True, max_num_seqs=2, max_model_len=16)
    graphs = engine.speculative.graphs
    draft = Draft(3, 7, torch.zeros(model.cfg.d_model, dtype=torch.float64))
    with pytest.raises(ValueError, match="3 rows x 2 blocks x 2 drafts exceeds the captured "
                                         r"maximum 2 x 4 x 2"):
        graphs.stage([_row(str(i), 3, 2) for i in range(3)], [draft] * 3, 2)
    with pytest.raises(ValueError, match="1 rows x 2 blocks x 3 drafts exceeds"):
        graphs.stage([_row("0", 3, 2)], [draft], 3)
    with pytest.raises(ValueError, match="1 rows x 5 blocks x 2 drafts exceeds"):
        graphs.stage([_row("0", 17, 5)], [draft], 2)
    with pytest.raises(RuntimeError, match="without a staged step"):
        graphs.verify(torch.zeros(1, 2, dtype=torch.int64))


def test_cpu_engines_speculate_eagerly(model, tokenizer):
    """The speculative graphs come with the decode graphs (CUDA with cuda_graphs): a CPU
    engine keeps the eager step."""
    engine = _engine(model, tokenizer, 2)
    assert engine.graphs is None and engine.speculative.graphs is None


def _chosen_backend_calls(monkeypatch, module, surface: str, reference) -> list[bool]:
    """Make ``module``'s catalog lookups choose ``surface``'s plain-PyTorch reference (marked
    chosen, so the CPU runs the plumbing a CUDA kernel would) -> per call of it, whether it
    ran inside the speculative verify."""
    import types

    real_resolve, real_verify = module.resolve, SpeculativeDecoder.verify
    in_verify, calls = [], []

    def counted(*args, **kwargs):
        calls.append(bool(in_verify))
        return reference(*args, **kwargs)

    def verify(self, x, drafts):
        in_verify.append(True)
        try:
            return real_verify(self, x, drafts)
        finally:
            in_verify.pop()

    monkeypatch.setattr(SpeculativeDecoder, "verify", verify)
    chosen = types.SimpleNamespace(role="chosen", fn=counted)
    monkeypatch.setattr(module, "resolve", lambda name, like: (
        chosen if name == surface else real_resolve(name, like)))
    return calls


def _step_surface(name: str):
    """(the model module that resolves it, the surface, its reference)."""
    from megacpp.kernels.ops.gated_delta_step.reference import gated_delta_step_reference
    from megacpp.kernels.ops.mamba3_step.reference import mamba3_step_reference
    from megacpp.kernels.ops.paged_attention_decode.reference import (
        paged_attention_decode_reference,
    )
    from megacpp.model import attention, mixer

    return {"mamba3_step": (mixer, mamba3_step_reference),
            "gated_delta_step": (mixer, gated_delta_step_reference),
            "paged_attention_decode": (attention, paged_attention_decode_reference)}[name]


@pytest.mark.parametrize(("surface", "in_verify"), [("mamba3_step", True),
                                                    ("gated_delta_step", True),
                                                    ("paged_attention_decode", False)])
@pytest.mark.parametrize(("k", "graphed"), [(0, False), (2, False), (2, True)],
                         ids=["plain", "eager", "graphed"])
def test_decode_kernels_chosen_in_plain_and_speculative_steps(
        model, tokenizer, plain, surface, in_verify, k, graphed, monkeypatch):
    """Where the catalog chooses a fused decode kernel (on CUDA), plain decode steps run it,
    and the verify runs the recurrent ones (``mamba3_step``, ``gated_delta_step``) on its
    gathered states one position at a time, while its attention over k + 1 positions keeps
    the gather path (``paged_attention_decode`` takes one token per row); the output is
    still plain greedy."""
    module, reference = _step_surface(surface)
    calls = _chosen_backend_calls(monkeypatch, module, surface, reference)
    engine = _engine(model, tokenizer, k, graphed=graphed)
    assert _run(engine, _prompts(tokenizer.vocab_size)) == plain
    assert calls and any(not c for c in calls)  # one-token steps take it
    if k:
        assert engine.speculative.steps > 0 and any(calls) == in_verify
    else:
        assert not any(calls)
