"""The engine's step-by-step outputs, pinned: for two patterns (``tiny``; MLA + DSA with M, R,
E, D) and five scenarios -- greedy and seeded sampled requests with stop strings in one batch,
the same under a tight block budget (preemption), through the padded decode-graph runner
(eager replay on the CPU), with an abort and a late request, and with EOS -- every
``RequestOutput`` of every ``step()`` (tokens, text deltas, finish reasons, counts) and the
final stats must equal the recorded ones in ``data/engine_golden.json``.

Any change to scheduling, input preparation, graph dispatch, sampling or output handling that
moves a token, a text delta or the step it arrives in fails here. Recorded in float64 on the
CPU with torch 2.13; after a deliberate behaviour change (or a torch upgrade that changes
random init), re-record from a tree whose behaviour is known good with
``PYTHONPATH=src python -m tests.infer.test_engine_golden``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

from megacpp.data.tokenizer import CppTokenizer, train_tokenizer
from megacpp.infer.engine import Engine, EngineConfig
from megacpp.infer.graphs import DecodeGraphs
from megacpp.infer.sampling import SamplingParams
from tests.infer.test_engine import HEADERS, _latent, _model, _prompts, _tiny

GOLDEN = Path(__file__).parent / "data" / "engine_golden.json"
LENGTHS = (1, 5, 17, 33, 9, 23)
PARAMS = [
    SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True),
    SamplingParams(temperature=1.0, max_new_tokens=10, seed=11, ignore_eos=True),
    SamplingParams(temperature=0.7, top_k=20, max_new_tokens=9, seed=2**63 + 5, ignore_eos=True),
    SamplingParams(temperature=1.3, top_p=0.8, max_new_tokens=10, seed=-3, ignore_eos=True),
    SamplingParams(temperature=0.9, top_k=40, top_p=0.9, max_new_tokens=8, seed=7,
                   ignore_eos=True),
    SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True),
]
SCENARIOS = ("mixed", "preempt", "graphs", "abort", "eos")


def _engine(model, tokenizer, **config) -> Engine:
    # the scheduler without prefix caching (tests/infer/test_prefix_cache.py checks that it
    # gives the same tokens)
    defaults = {"max_num_seqs": 8, "block_size": 4, "max_model_len": 96, "prefill_chunk": 8,
                "prefix_cache": False}
    return Engine(model, tokenizer, EngineConfig(**{**defaults, **config}))


def _requests(vocab: int) -> dict[str, tuple[list[int], SamplingParams]]:
    return {str(i): (p, PARAMS[i]) for i, p in enumerate(_prompts(vocab, LENGTHS))}


def _with_stop(requests, stop: tuple[str, ...]) -> dict:
    """Request "5" (greedy) also stops at ``stop``."""
    prompt, params = requests["5"]
    return {**requests, "5": (prompt, dataclasses.replace(params, stop=stop))}


def _trace(engine: Engine, requests: dict, events: dict | None = None) -> dict:
    """Add ``requests``, step to the end; ``events`` maps a step number to a callable run
    before that step. Returns every step's outputs and the final stats."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    steps, n = [], 0
    while engine.has_unfinished():
        if events and n in events:
            events[n](engine)
        steps.append([[o.request_id, o.new_token_ids, o.new_text, o.finished, o.finish_reason,
                       o.prompt_tokens, o.completion_tokens] for o in engine.step()])
        n += 1
    stats = {k: v for k, v in dataclasses.asdict(engine.stats()).items()
             if not k.startswith("prefix_")}  # the prefix cache's counters (off here)
    return {"steps": steps, "stats": stats}


def _stop_string(tokenizer, trace: dict) -> str:
    """Three characters from the middle of request "5"'s greedy text in ``trace``."""
    ids = [t for step in trace["steps"] for o in step if o[0] == "5" for t in o[1]]
    return tokenizer.decode(ids)[4:7]


def scenario(name: str, model, tokenizer) -> dict:
    requests = _requests(model.cfg.vocab_size)
    if name == "mixed":
        plain = _trace(_engine(model, tokenizer), requests)
        stop = _stop_string(tokenizer, plain)
        stopped = _trace(_engine(model, tokenizer), _with_stop(requests, (stop, "\x00never")))
        return {"plain": plain, "stop": stop, "stopped": stopped}
    if name == "preempt":  # 48 tokens of KV for 6 sequences of 11..43 tokens (138 in all)
        return _trace(_engine(model, tokenizer, num_blocks=12, max_model_len=48), requests)
    if name == "graphs":  # batch buckets 1, 2, 4, 7 and width buckets up to 24, eager replay
        engine = _engine(model, tokenizer, max_num_seqs=7, prefill_chunk=64)
        engine.graphs = DecodeGraphs(engine.model, engine.cache, 7, 24, capture=False)
        return _trace(engine, requests)
    if name == "abort":
        late = _prompts(model.cfg.vocab_size, (14,))[0]
        events = {
            3: lambda e: e.abort("3"),
            4: lambda e: e.add_request("late", late, PARAMS[1]),
            6: lambda e: (e.abort("1"), e.abort("late"), e.abort("unknown")),
        }
        return _trace(_engine(model, tokenizer, max_num_seqs=4), requests, events)
    if name == "eos":
        free = _trace(_engine(model, tokenizer), requests)
        ids = [t for step in free["steps"] for o in step if o[0] == "0" for t in o[1]]
        tok = copy.copy(tokenizer)
        tok.eos_id = ids[3]  # request "0"'s 4th greedy token plays EOS
        honour = {rid: (p, dataclasses.replace(sp, ignore_eos=False))
                  for rid, (p, sp) in requests.items()}
        return {"eos_id": tok.eos_id, "trace": _trace(_engine(model, tok), honour)}
    raise ValueError(name)


def _build(family: str, tokenizer):
    build = _tiny if family == "tiny" else _latent
    return _model(build(tokenizer.vocab_size))


def _jsonable(value):
    return json.loads(json.dumps(value))


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text(encoding="utf-8"))


@pytest.fixture(scope="module", params=["tiny", "latent"])
def family_model(request, tokenizer):
    return request.param, _build(request.param, tokenizer)


def _tokenizer() -> CppTokenizer:
    texts = [p.read_text(encoding="utf-8") for p in HEADERS]
    return CppTokenizer.from_hf(train_tokenizer(texts, vocab_size=600))


@pytest.fixture(scope="module")
def tokenizer() -> CppTokenizer:
    return _tokenizer()


@pytest.mark.parametrize("name", SCENARIOS)
def test_engine_outputs_equal_the_recorded_ones(name, family_model, tokenizer, golden):
    family, model = family_model
    recorded = golden[family][name]
    got = _jsonable(scenario(name, model, tokenizer))
    assert got == recorded


def test_the_recording_exercises_what_it_pins(golden):
    """The scenarios really preempt, abort, stop, hit EOS and vary their tokens."""
    for family in ("tiny", "latent"):
        g = golden[family]
        assert g["preempt"]["stats"]["preemptions"] > 0
        reasons = {o[0]: o[4] for step in g["abort"]["steps"] for o in step if o[3]}
        assert reasons["3"] == reasons["1"] == reasons["late"] == "abort"
        reasons = {o[0]: o[4] for step in g["mixed"]["stopped"]["steps"] for o in step if o[3]}
        assert reasons["5"] == "stop"
        reasons = {o[0]: o[4] for step in g["eos"]["trace"]["steps"] for o in step if o[3]}
        assert reasons["0"] == "eos"
        tokens = {o[0]: tuple(o[1]) for step in g["mixed"]["plain"]["steps"] for o in step}
        assert len(set(tokens.values())) > 3


def record() -> None:
    tokenizer = _tokenizer()
    out: dict = {"torch": torch.__version__}
    for family in ("tiny", "latent"):
        model = _build(family, tokenizer)
        out[family] = {name: _jsonable(scenario(name, model, tokenizer)) for name in SCENARIOS}
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(out, separators=(",", ":")) + "\n", encoding="utf-8")
    print(f"wrote {GOLDEN}", file=sys.stderr)


if __name__ == "__main__":
    record()
