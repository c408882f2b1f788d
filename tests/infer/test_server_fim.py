"""Fill in the middle over HTTP: ``/v1/completions`` with ``suffix`` on a real server on
loopback (tiny preset, random init, the real Engine)."""

from __future__ import annotations

import copy
import json

import httpx
import pytest

from megacpp.data.fim import FimIds, psm_prompt
from megacpp.infer.async_engine import AsyncEngine
from megacpp.infer.engine import Engine, EngineConfig
from megacpp.infer.server import Specialist
from tests.infer.server_helpers import live_server, tiny_model, tiny_specialist, tiny_tokenizer

PREFIX = "int add(int a, int b) {\n    return "
SUFFIX = ";\n}\n"

pytestmark = pytest.mark.usefixtures("one_thread")


def no_fim_specialist(name: str) -> Specialist:
    """A model served with a tokenizer object that has no FIM ids (every megacpp tokenizer
    reserves them; this stands for one that does not)."""
    tok = copy.copy(tiny_tokenizer())
    tok.fim_prefix_id = tok.fim_middle_id = tok.fim_suffix_id = None
    cfg = EngineConfig(max_num_seqs=4, max_model_len=256)
    engine = Engine(tiny_model(tok.vocab_size), tok, cfg)
    return Specialist(name, AsyncEngine(engine, name), tok, cfg.max_model_len)


@pytest.fixture(scope="module")
def client():
    with live_server([tiny_specialist("tiny"), no_fim_specialist("plain")]) as server, \
            httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def fim_ids_prompt(prefix: str, suffix: str) -> list[int]:
    tok = tiny_tokenizer()
    return [tok.bos_id, *psm_prompt(tok.encode(prefix).tolist(), tok.encode(suffix).tolist(),
                                    FimIds.of(tok))]


def test_suffix_makes_the_psm_prompt_and_returns_the_middle(client):
    body = {"model": "tiny", "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 8,
            "temperature": 0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    answer = r.json()
    ids = fim_ids_prompt(PREFIX, SUFFIX)
    tok = tiny_tokenizer()
    assert ids[:2] == [tok.bos_id, tok.fim_prefix_id] and ids[-1] == tok.fim_middle_id
    assert answer["usage"]["prompt_tokens"] == len(ids)
    # the same prompt given as token ids is the same greedy completion
    same = client.post("/v1/completions", json={**body, "prompt": ids, "suffix": None}).json()
    assert answer["choices"][0]["text"] == same["choices"][0]["text"]
    assert answer["choices"][0]["finish_reason"] in ("stop", "length")
    # without a suffix the prompt is the plain one
    plain = client.post("/v1/completions", json={**body, "suffix": None}).json()
    assert plain["usage"]["prompt_tokens"] == 1 + len(tok.encode(PREFIX))
    # streamed, the chunks add up to the same middle
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as streamed:
        texts = [json.loads(line[6:])["choices"][0]["text"] for line in streamed.iter_lines()
                 if line.startswith("data: {")]
    assert "".join(texts) == answer["choices"][0]["text"]


def test_suffix_with_a_list_of_prompts(client):
    body = {"model": "tiny", "prompt": [PREFIX, "int x = "], "suffix": ";\n", "max_tokens": 4,
            "temperature": 0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    expected = len(fim_ids_prompt(PREFIX, ";\n")) + len(fim_ids_prompt("int x = ", ";\n"))
    assert r.json()["usage"]["prompt_tokens"] == expected
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]


@pytest.mark.parametrize(("body", "needle"), [
    ({"model": "plain", "prompt": PREFIX, "suffix": SUFFIX},
     ("suffix is not supported by model 'plain': this model's tokenizer has no "
     "fill-in-the-middle tokens")),
    ({"model": "tiny", "prompt": [1, 2, 3], "suffix": SUFFIX}, "suffix needs a text prompt"),
    ({"model": "tiny", "prompt": PREFIX, "suffix": 3}, "suffix"),
    ({"model": "tiny", "prompt": PREFIX, "suffix": "x" * 2000, "max_tokens": 4}, "context"),
    ({"model": "tiny", "prompt": PREFIX, "suffix": SUFFIX, "echo": True},
     "echo and suffix cannot be combined"),
])
def test_bad_fim_requests_are_one_400(client, body, needle):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and needle in error["message"], error
    assert "\n" not in error["message"]
