"""Logprobs: the engine's prompt and sampled-token logprobs equal a full forward of the model
(chunked prefill, preemption and requests that do not ask mixed in), and the server's
``logprobs`` / ``echo`` / ``max_tokens=0`` (completions), ``logprobs`` / ``top_logprobs``
(chat), JSON and SSE, the ``openai`` client, ``response_format`` and bad bodies, all on a
real server on loopback."""

from __future__ import annotations

import dataclasses
import json
import math

import httpx
import pytest
import torch

from megacpp.errors import MegaCppError
from megacpp.infer.engine import Engine, EngineConfig
from megacpp.infer.logprobs import LOGPROB_FLOOR, token_logprobs
from megacpp.infer.sampling import SamplingParams
from megacpp.model.config import load_config
from megacpp.model.model import HybridLM
from tests.infer.server_helpers import live_server, tiny_specialist, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTHS = (1, 5, 17, 33, 9, 23)  # 1: BOS only; prefill chunks of 8


def reference_logprobs(model: HybridLM, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] log-softmax of a plain full-sequence forward (position t predicts t+1)."""
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=device)).logits[0]
    return torch.log_softmax(logits.double(), dim=-1).cpu()


def assert_entry(entry, token: int, row: torch.Tensor, k: int, tol: float) -> None:
    """One logprob entry against the reference distribution ``row`` [V] at its position."""
    assert entry.token == token
    assert math.isclose(entry.logprob, row[token].item(), abs_tol=tol)
    top = row.topk(k)
    assert len(entry.top) == k
    assert [lp for _, lp in entry.top] == pytest.approx(top.values.tolist(), abs=tol)
    assert all(math.isclose(row[t].item(), lp, abs_tol=tol) for t, lp in entry.top)


# ---- the engine --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model() -> HybridLM:
    torch.manual_seed(0)
    cfg = dataclasses.replace(load_config("tiny"), vocab_size=tiny_tokenizer().vocab_size,
                              init_std=0.3)
    return HybridLM(cfg).double().eval()


def run_engine(model, requests: dict, device: str = "cpu", **config) -> tuple[dict, Engine]:
    """Every request to the end: per request id, (generated ids, outputs)."""
    defaults = {"max_num_seqs": 8, "block_size": 4, "max_model_len": 96, "prefill_chunk": 8}
    engine = Engine(model, tiny_tokenizer(), EngineConfig(**{**defaults, **config}), device)
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outs = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].append(out)
    return {rid: ([t for o in o_ for t in o.new_token_ids], o_) for rid, o_ in outs.items()}, engine


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [[1, *torch.randint(3, vocab, (n - 1,), generator=g).tolist()] for n in LENGTHS]


@pytest.mark.parametrize("tight", [False, True], ids=["roomy", "preempting"])
def test_engine_logprobs_equal_a_full_forward(model, tight):
    # sampled at temperature 0.8 with top-k: the logprobs are still the raw distribution's
    scored = SamplingParams(temperature=0.8, top_k=5, max_new_tokens=6, seed=3, ignore_eos=True,
                            logprobs=3, prompt_logprobs=2)
    plain = dataclasses.replace(scored, logprobs=None, prompt_logprobs=None)
    requests = {str(i): (p, scored if i % 2 else plain)
                for i, p in enumerate(prompts(model.cfg.vocab_size))}
    config = {"num_blocks": 11, "max_model_len": 44} if tight else {}
    results, engine = run_engine(model, requests, **config)
    assert (engine.stats().preemptions > 0) == tight
    unscored, _ = run_engine(model, {rid: (p, plain) for rid, (p, _) in requests.items()})
    for rid, (prompt, params) in requests.items():
        generated, outs = results[rid]
        assert generated == unscored[rid][0]  # asking for logprobs changes no token
        if params is plain:
            assert all(o.logprobs is None and o.prompt_logprobs is None for o in outs)
            continue
        ref = reference_logprobs(model, prompt + generated)
        prompt_entries = outs[0].prompt_logprobs
        assert len(prompt_entries) == len(prompt) and prompt_entries[0] is None
        assert all(o.prompt_logprobs is None for o in outs[1:])
        for t in range(1, len(prompt)):
            assert_entry(prompt_entries[t], prompt[t], ref[t - 1], 2, 1e-5)
        entries = [e for o in outs for e in o.logprobs]
        assert len(entries) == len(generated)
        for i, (token, entry) in enumerate(zip(generated, entries, strict=True)):
            assert_entry(entry, token, ref[len(prompt) + i - 1], 3, 1e-5)


@pytest.mark.gpu
def test_engine_logprobs_on_cuda_with_graphs_equal_a_full_forward():
    torch.manual_seed(0)
    cfg = dataclasses.replace(load_config("tiny"), vocab_size=tiny_tokenizer().vocab_size,
                              init_std=0.3)
    model = HybridLM(cfg).double().cuda().eval()
    params = SamplingParams(temperature=0.8, top_k=5, max_new_tokens=12, seed=3,
                            ignore_eos=True, logprobs=3, prompt_logprobs=2)
    requests = {str(i): (p, params) for i, p in enumerate(prompts(cfg.vocab_size))}
    results, engine = run_engine(model, requests, device="cuda")
    assert engine.graphs is not None and engine.graphs.graphs  # decode replayed graphs
    for rid, (prompt, _) in requests.items():
        generated, outs = results[rid]
        ref = reference_logprobs(model, prompt + generated)
        for t in range(1, len(prompt)):
            assert_entry(outs[0].prompt_logprobs[t], prompt[t], ref[t - 1], 2, 1e-5)
        entries = [e for o in outs for e in o.logprobs]
        for i, (token, entry) in enumerate(zip(generated, entries, strict=True)):
            assert_entry(entry, token, ref[len(prompt) + i - 1], 3, 1e-5)


def test_logprob_settings_are_checked_and_a_skipped_prompt_position_is_an_error(model):
    for bad in (-1, 21, True, 2.0):
        with pytest.raises(MegaCppError, match="logprobs must be None or an integer in 0..20"):
            SamplingParams(logprobs=bad)
        with pytest.raises(MegaCppError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    engine = Engine(model, tiny_tokenizer(), EngineConfig(max_num_seqs=2, max_model_len=64))
    engine.add_request("a", list(range(1, 20)), SamplingParams(prompt_logprobs=0))
    entries = token_logprobs(torch.zeros(3, 8), torch.tensor([1, 2, 3]), 0)
    with pytest.raises(MegaCppError, match="prompt tokens 1..4 were not scored"):
        engine._add_prompt_logprobs(engine.sequences["a"], 5, entries)


def test_a_ruled_out_token_gets_the_floor_not_minus_infinity():
    logits = torch.tensor([[0.0, -math.inf, 1.0]])
    (entry,) = token_logprobs(logits, torch.tensor([1]), 3)
    assert entry.logprob == LOGPROB_FLOOR and entry.top[-1] == (1, LOGPROB_FLOOR)
    json.dumps(entry.top, allow_nan=False)


# ---- the server --------------------------------------------------------------------------------

PROMPT = "int main() {\n  return 0;\n}\n"


@pytest.fixture(scope="module")
def srv():
    with live_server([tiny_specialist("tiny", max_model_len=256, prefill_chunk=16)]) as server:
        yield server


@pytest.fixture(scope="module")
def client(srv):
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


def served_model(srv) -> HybridLM:
    return srv.specialists["tiny"].engine.engine.model


def complete(client, **body) -> dict:
    r = client.post("/v1/completions", json={"model": "tiny", **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_with_max_tokens_0_scores_the_prompt(srv, client):
    tok = tiny_tokenizer()
    ids = [tok.bos_id, *tok.encode(PROMPT).tolist()]
    body = complete(client, prompt=PROMPT, echo=True, max_tokens=0, logprobs=3)
    (choice,) = body["choices"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0,
                             "total_tokens": len(ids)}
    lp = choice["logprobs"]
    assert lp["tokens"] == [tok.hf.id_to_token(ids[0])] + [tok.decode([t]) for t in ids[1:]]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert "".join(lp["tokens"][1:]) == PROMPT  # ASCII: every token is whole text
    assert lp["text_offset"] == [0, *[len(tok.decode(ids[1:t])) for t in range(1, len(ids))]]
    ref = reference_logprobs(served_model(srv), ids)
    for t in range(1, len(ids)):
        assert lp["token_logprobs"][t] == pytest.approx(ref[t - 1, ids[t]].item(), abs=1e-4)
        top = lp["top_logprobs"][t]  # the top 3 and the prompt token, distinct strings
        assert len(top) in (3, 4) and lp["tokens"][t] in top
        best = ref[t - 1].topk(3).values.tolist()
        assert sorted(top.values(), reverse=True)[:3] == pytest.approx(best, abs=1e-4)
        assert top[lp["tokens"][t]] == lp["token_logprobs"][t]
    # token ids in, the same scores out (as lm-eval sends them)
    by_ids = complete(client, prompt=ids, echo=True, max_tokens=0, logprobs=3)["choices"][0]
    assert by_ids["logprobs"] == lp and by_ids["text"] == PROMPT
    # echo without logprobs: the text only
    plain = complete(client, prompt=PROMPT, echo=True, max_tokens=0)["choices"][0]
    assert plain["text"] == PROMPT and plain["logprobs"] is None


def test_generated_logprobs_follow_the_echoed_prompt(srv, client):
    tok = tiny_tokenizer()
    ids = [tok.bos_id, *tok.encode(PROMPT).tolist()]
    body = complete(client, prompt=PROMPT, echo=True, max_tokens=5, logprobs=2, temperature=0,
                    ignore_eos=True)
    (choice,) = body["choices"]
    lp = choice["logprobs"]
    model = served_model(srv)
    full = model.generate_greedy(torch.tensor([ids]), 5)[0].tolist()
    assert choice["text"] == PROMPT + tok.decode(full[len(ids):])
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == len(full)
    ref = reference_logprobs(model, full)
    for t in range(1, len(full)):
        assert lp["token_logprobs"][t] == pytest.approx(ref[t - 1, full[t]].item(), abs=1e-4)
    assert lp["text_offset"] == sorted(lp["text_offset"])
    # the prompt part is what echo alone returns; without echo, the completion's part only
    echo_only = complete(client, prompt=PROMPT, echo=True, max_tokens=0, logprobs=2)
    assert echo_only["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"][
        :len(ids)]
    alone = complete(client, prompt=PROMPT, max_tokens=5, logprobs=2, temperature=0,
                     ignore_eos=True)["choices"][0]
    assert alone["text"] == choice["text"][len(PROMPT):]
    assert alone["logprobs"]["token_logprobs"] == lp["token_logprobs"][len(ids):]
    assert alone["logprobs"]["top_logprobs"] == lp["top_logprobs"][len(ids):]
    assert alone["logprobs"]["text_offset"][0] == 0


def test_sse_pieces_add_up_to_the_json_response(client):
    body = {"model": "tiny", "prompt": PROMPT, "echo": True, "max_tokens": 6, "logprobs": 1,
            "temperature": 0}
    whole = complete(client, **{k: v for k, v in body.items() if k != "model"})["choices"][0]
    pieces = []
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                pieces.append(json.loads(line[6:])["choices"][0])
    assert "".join(p["text"] for p in pieces) == whole["text"]
    assert pieces[0]["text"].startswith(PROMPT)
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for p in pieces for v in p["logprobs"][key]] == whole["logprobs"][key]
    assert pieces[-1]["finish_reason"] == whole["finish_reason"]


def test_chat_logprobs_and_top_logprobs(client):
    messages = [{"role": "user", "content": "Write f."}]
    r = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": messages, "max_tokens": 4, "ignore_eos": True,
        "temperature": 0, "logprobs": True, "top_logprobs": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"] == 4
    for item in content:
        assert len(item["top_logprobs"]) == 2
        first, second = item["top_logprobs"]
        assert first["logprob"] >= second["logprob"] >= -9999.0
        assert item["logprob"] <= first["logprob"]  # greedy: the best token, ties aside
        assert bytes(item["bytes"]).decode("utf-8", "replace") == item["token"] or (
            "\ufffd" in item["token"])
    no_top = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": messages, "max_tokens": 2, "logprobs": True}).json()
    assert [i["top_logprobs"] for i in no_top["choices"][0]["logprobs"]["content"]] == [[], []]
    without = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": messages, "max_tokens": 2}).json()
    assert without["choices"][0]["logprobs"] is None


def test_the_openai_client_reads_logprobs(srv):
    openai = pytest.importorskip("openai")
    oa = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
    c = oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    assert c.choices[0].text == PROMPT and c.choices[0].logprobs.token_logprobs[0] is None
    chat = oa.chat.completions.create(model="tiny", max_tokens=3, logprobs=True, top_logprobs=1,
                                      messages=[{"role": "user", "content": "Hi."}])
    assert len(chat.choices[0].logprobs.content[0].top_logprobs) == 1
    text = oa.completions.create(model="tiny", prompt="x", max_tokens=1,
                                 extra_body={"response_format": {"type": "text"}})
    assert text.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.BadRequestError, match="cannot constrain its output"):
        oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "{"}],
                                   response_format={"type": "json_object"})


@pytest.mark.parametrize(("path", "body", "param", "needle"), [
    ("completions", {"logprobs": 21}, "logprobs", "less than or equal to 20"),
    ("completions", {"logprobs": -1}, "logprobs", "greater than or equal to 0"),
    ("completions", {"logprobs": True}, "logprobs", "valid integer"),
    ("completions", {"logprobs": "2"}, "logprobs", "valid integer"),
    ("completions", {"echo": "yes"}, "echo", "valid boolean"),
    ("completions", {"max_tokens": 0}, "max_tokens", "only on /v1/completions with echo=true"),
    ("completions", {"response_format": {"type": "json_object"}}, "response_format",
     "response_format type 'json_object' is not supported"),
    ("completions", {"response_format": {"type": "text", "strict": True}}, "response_format",
     'only {"type": "text"}'),
    ("completions", {"response_format": "text"}, "response_format", "valid dictionary"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format", "cannot constrain its output"),
    ("chat", {"logprobs": 2}, "logprobs", "valid boolean"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal"),
    ("chat", {"top_logprobs": 2}, "top_logprobs", "needs logprobs=true"),
    ("chat", {"max_tokens": 0, "echo": True}, "max_tokens", "only on /v1/completions"),
])
def test_bad_logprob_and_format_fields_are_400(client, path, body, param, needle):
    base = ({"prompt": "x"} if path == "completions"
            else {"messages": [{"role": "user", "content": "x"}]})
    url = "/v1/completions" if path == "completions" else "/v1/chat/completions"
    r = client.post(url, json={"model": "tiny", "max_tokens": 2, **base, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and needle in error["message"], error
