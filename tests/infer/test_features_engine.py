"""The serving engine with the model's input features on (model/features.py): a hashed
n-gram branch and a structure-id embedding decode the tokens of the full, uncached forward --
batched, in chunked prefill, under preemption and through the decode-graph runner -- and
the structure ids the serving path computes are the ids the data build stores."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from megacpp.data import structure as data_structure
from megacpp.data.encode import EncodedDoc, LabelRuns, encode_chunk
from megacpp.data.tokenizer import CppTokenizer, train_tokenizer
from megacpp.infer.engine import Engine, EngineConfig
from megacpp.infer.graphs import DecodeGraphs
from megacpp.infer.sampling import SamplingParams
from megacpp.infer.structure import FALLBACK_ID, StructureIds
from megacpp.model.config import ModelConfig
from megacpp.model.model import HybridLM

HEADERS = sorted(Path("/usr/include/c++/12/bits").glob("stl_*.h"))[:6]
GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
PROMPTS = (  # the continuations stay in a comment / a #define line: decode ids are not OTHER
    "int f() { return 1; }\n// note:",
    "#define GREETING",
    "// add two numbers\nint add(int a, int b) {\n    return",
)


@pytest.fixture(scope="module")
def tokenizer() -> CppTokenizer:
    if not HEADERS:
        pytest.skip("needs the libstdc++ headers in /usr/include/c++/12")
    texts = [p.read_text(encoding="utf-8") for p in HEADERS]
    return CppTokenizer.from_hf(train_tokenizer(texts, vocab_size=600))


def _model(vocab: int, structure: bool = False, orders: tuple[int, ...] = ()) -> HybridLM:
    cfg = ModelConfig.from_dict({
        "model": {"pattern": "AEMR", "vocab_size": vocab, "d_model": 32, "init_std": 0.3},
        "attention": {"n_heads": 2, "n_kv_heads": 1, "head_dim": 16},
        "mamba": {"d_state": 16, "headdim": 16, "chunk_size": 8},
        "rnn": {"n_heads": 2, "head_k_dim": 16, "head_v_dim": 16, "chunk_size": 8},
        "moe": {"n_experts": 4, "top_k": 2, "expert_ffn": 32},
        "structure": {"embedding": structure},
        "ngram": {"orders": list(orders), "table_size": 257},
    })
    torch.manual_seed(0)
    model = HybridLM(cfg).double().eval()
    for module in (model.structure_embed, model.ngram_embed):
        for p in [] if module is None else module.parameters():
            torch.nn.init.normal_(p, std=1.0)  # large: the features decide the tokens
    return model


def _engine(model, tokenizer, **config) -> Engine:
    defaults = {"max_num_seqs": 4, "block_size": 4, "max_model_len": 64, "prefill_chunk": 8}
    return Engine(model, tokenizer, EngineConfig(**{**defaults, **config}))


def _run(engine: Engine, prompts, params=GREEDY) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return tokens


def _reference(model: HybridLM, tokenizer: CppTokenizer, prompt: str, n: int,
               labeler: StructureIds | None) -> list[int]:
    """Greedy tokens of the full forward, re-run over the whole sequence at every step, with
    the structure ids the engine's rule gives (prompt: one parse; each new token: the label
    of its last byte in a parse of the sequence so far)."""
    ids = [tokenizer.bos_id, *tokenizer.encode(prompt).tolist()]
    sids = labeler.label(ids) if labeler is not None else None
    start = len(ids)
    for _ in range(n):
        structure = None if sids is None else torch.tensor([sids])
        with torch.no_grad():
            logits = model(torch.tensor([ids]), structure_ids=structure).logits[0, -1]
        ids.append(int(logits.argmax()))
        if sids is not None:
            sids.append(labeler.label_last(ids))
    return ids[start:]


@pytest.mark.parametrize("features", ["ngram", "structure", "both"])
def test_engine_greedy_equals_the_full_forward(features, tokenizer):
    structure = features in ("structure", "both")
    orders = (2, 3) if features in ("ngram", "both") else ()
    model = _model(tokenizer.vocab_size, structure, orders)
    labeler = StructureIds(tokenizer) if structure else None
    want = {str(i): _reference(model, tokenizer, p, GREEDY.max_new_tokens, labeler)
            for i, p in enumerate(PROMPTS)}
    assert len({t for tokens in want.values() for t in tokens}) > 2  # the tokens vary
    assert _run(_engine(model, tokenizer), PROMPTS) == want  # batched, chunked prefill
    # one prompt at a time, whole-prompt prefill
    alone = _engine(model, tokenizer, max_num_seqs=1, prefill_chunk=64)
    assert _run(alone, PROMPTS) == want
    # preemption by recompute: the recomputed rows carry the same ids and context
    tight = _engine(model, tokenizer, num_blocks=16, max_model_len=64)
    assert _run(tight, PROMPTS) == want and tight.stats().preemptions > 0
    # the decode-graph runner's static buffers and padding (run eagerly on the CPU)
    graphed = _engine(model, tokenizer, max_num_seqs=3, prefill_chunk=64)
    graphed.graphs = DecodeGraphs(graphed.model, graphed.cache, 3, 16, capture=False)
    assert _run(graphed, PROMPTS[:2]) == {k: want[k] for k in ("0", "1")}
    assert 2 in {b for b, _ in graphed.graphs.buckets_used}


def test_structure_ids_of_the_serving_path_are_the_data_builds(tokenizer, tmp_path):
    """The ids the data build stores for a document (its encode_chunk, and the runs path)
    == the ids the engine computes for the same text as a prompt (BOS: OTHER)."""
    path = tmp_path / "tokenizer.json"
    tokenizer.save(path)
    texts = [p.read_text(encoding="utf-8") for p in HEADERS[:3]] + [
        "// é ✓\nint f() { return 1; }\n", "int broken( {{ \"unterminated\n"]
    labeler = StructureIds(tokenizer)
    for text, doc in zip(texts, encode_chunk(texts, str(path), 5.0), strict=True):
        served = labeler.label([tokenizer.bos_id, *doc.ids.tolist()])
        assert served[0] == FALLBACK_ID  # BOS, as the build labels it
        assert served[1:] == doc.structure_ids.tolist()
        byte_labels, outcome = data_structure.StructureLabeler().byte_labels(text.encode())
        runs = EncodedDoc.from_runs(doc.ids, LabelRuns.encode(byte_labels, outcome),
                                    tokenizer.token_nbytes)
        assert served[1:] == runs.structure_ids.tolist()
    all_ids = set(labeler.label([tokenizer.bos_id, *tokenizer.encode(texts[0]).tolist()]))
    assert len(all_ids) >= 5  # comments, preprocessor, class bodies, functions, ...
    assert labeler.fallbacks == 0


def test_decode_time_id_is_the_label_of_the_sequence_so_far(tokenizer):
    labeler = StructureIds(tokenizer)
    text = "int f() {\n    // note\n    return 1;\n}\n"
    ids = [tokenizer.bos_id, *tokenizer.encode(text).tolist()]
    for end in range(2, len(ids) + 1):  # each token as if just generated
        assert labeler.label_last(ids[:end]) == labeler.label(ids[:end])[-1]
    assert labeler.label_last(ids[:1]) == FALLBACK_ID


def test_unparsed_sequences_fall_back_to_other_as_the_build_does(tokenizer, monkeypatch):
    monkeypatch.setattr(data_structure, "MAX_PARSE_BYTES", 8)
    labeler = StructureIds(tokenizer)
    ids = [tokenizer.bos_id, *tokenizer.encode("// a comment longer than 8 bytes\n").tolist()]
    assert labeler.label(ids) == [FALLBACK_ID] * len(ids)
    assert labeler.label_last(ids) == FALLBACK_ID
    assert labeler.fallbacks == 2
    assert np.all(data_structure.StructureLabeler().byte_labels(b"// long comment")[0] == 0)


def test_decode_graphs_refuse_missing_feature_inputs(tokenizer):
    model = _model(tokenizer.vocab_size, structure=True, orders=(2,))
    engine = _engine(model, tokenizer)
    graphs = DecodeGraphs(engine.model, engine.cache, 2, 4, capture=False)
    with pytest.raises(ValueError, match="structure ids missing"):
        graphs.run([5], [0], [0], [0], [[0]], None, [[-1]])
    with pytest.raises(ValueError, match="n-gram context missing"):
        graphs.run([5], [0], [0], [0], [[0]], [0], None)
    params = dataclasses.replace(GREEDY, max_new_tokens=2)
    assert len(_run(engine, PROMPTS[:1], params)["0"]) == 2
